"""How the house is built, read from the source alone (no import, no torch): for a before/after.

    python benchmarks/house.py [PACKAGE_DIR]    # default: this checkout's sn_trainer/

Prints:
- the lines of the ``Trainer`` class, and the ten longest functions of the package;
- the settings containers: dataclasses other than ``TrainerConfig`` (and the parts it holds) that
  declare a field named as a setting (a ``<Name>Config``'s field ``f`` is the setting ``<name>_f``:
  ``CheckpointConfig.dir`` is ``checkpoint_dir``), how many such fields, how many of them with a
  default of their own, and the most declarations of any one setting;
- the engine's face: the imports from outside ``engine/`` of a module inside one of its rooms
  (``engine.<room>.<module>``), or of a name its face does not offer;
- namesakes: file names that two modules share, and modules named like one of the package's folders;
- sizes: the modules over 400 lines and the classes over 250;
  these three with the readings tests/test_structure.py checks (it imports them from here);
- what each of three extensions touches, as the modules that name the kinds it adds to:
  a data source (modules naming a class with ``micro_slice``, or comparing with a source kind's
  string), a reducer (modules naming a reducer kind: a class with ``reduce``, ``barrier`` and a
  ``name`` of its own, or the reducers' modules' shared-buffer classes or ``COMMS``, or comparing with a
  reducer's name), a worker-fed hook
  (the module defining the events, the one defining ``Callback``, those constructing an event,
  and those testing an event's class with ``isinstance``).
These are counts of where the code names concrete kinds, a proxy for the files a new kind must
change; the module that defines the new kind itself is counted.
"""
from __future__ import annotations

import ast
from collections import Counter, defaultdict
from pathlib import Path

import harness

RESULT = None  # it prints; a before/after keeps both printouts


def modules(package: Path) -> dict[str, ast.Module]:
    return {str(p.relative_to(package.parent)): ast.parse(p.read_text()) for p in sorted(package.rglob("*.py"))}


def is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def fields(node: ast.ClassDef) -> list[tuple[str, bool, str]]:
    """(name, has a default, annotation) of each annotated class-level field."""
    out = []
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.append((item.target.id, item.value is not None, ast.unparse(item.annotation)))
    return out


def classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def names_used(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rsplit(".", 1)[-1])
    return found


def compared_strings(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                for sub in ast.walk(part):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        found.add(sub.value)
    return found


def methods(node: ast.ClassDef) -> set[str]:
    return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def is_protocol(node: ast.ClassDef) -> bool:
    return any(ast.unparse(b).endswith("Protocol") for b in node.bases)


def class_attribute(node: ast.ClassDef, name: str) -> str | None:
    """A string class attribute, as ``name = "x"`` or ``name, other = "x", ...`` sets it."""
    for item in node.body:
        if not isinstance(item, ast.Assign):
            continue
        for target in item.targets:
            pairs = zip(target.elts, item.value.elts) if isinstance(target, ast.Tuple) and \
                isinstance(item.value, ast.Tuple) else [(target, item.value)]
            for t, v in pairs:
                if isinstance(t, ast.Name) and t.id == name and isinstance(v, ast.Constant) and isinstance(v.value, str):
                    return v.value
    return None


def settings_report(mods: dict[str, ast.Module]) -> list[str]:
    all_classes = {c.name: (path, c) for path, tree in mods.items() for c in classes(tree)}
    if "TrainerConfig" not in all_classes:
        return ["no TrainerConfig found"]
    settings, parts = set(), {"TrainerConfig"}
    for name, _, annotation in fields(all_classes["TrainerConfig"][1]):
        part = all_classes.get(annotation)
        if part is not None and is_dataclass(part[1]):  # a component config the settings hold
            parts.add(annotation)
            settings |= {f"{name}_{sub}" for sub, _, _ in fields(part[1])}
        else:
            settings.add(name)
    declared: Counter = Counter({s: 1 for s in settings})
    containers, duplicated, with_default = [], 0, 0
    for name, (path, node) in sorted(all_classes.items()):
        if name in parts or not is_dataclass(node):
            continue
        prefix = name[: -len("Config")].lower() + "_" if name.endswith("Config") else ""
        hits = [(f, d) for f, d, _ in fields(node) if (prefix + f if prefix else f) in settings]
        if hits:
            containers.append(f"  {name} ({path}): {len(hits)} of its fields are settings' names, "
                              f"{sum(d for _, d in hits)} with a default: {', '.join(f for f, _ in hits)}")
            duplicated += len(hits)
            with_default += sum(d for _, d in hits)
            for f, _ in hits:
                declared[prefix + f if prefix else f] += 1
    most = max(declared.values()) if declared else 0
    return [f"settings: {len(settings)}; other containers declaring them: {len(containers)}; "
            f"fields repeating a setting's name: {duplicated} ({with_default} with a default of their own); "
            f"most declarations of one setting: {most}", *containers]


def extension_report(mods: dict[str, ast.Module]) -> list[str]:
    used = {path: names_used(tree) for path, tree in mods.items()}
    strings = {path: compared_strings(tree) for path, tree in mods.items()}
    defined = defaultdict(set)
    sources, reducers, events, source_kinds, reducer_names = set(), set(), set(), set(), set()
    reducer_modules, events_module, callback_module = set(), None, None  # the reducers may span modules
    for path, tree in mods.items():
        for c in classes(tree):
            defined[c.name].add(path)
            if is_protocol(c):
                continue
            if "micro_slice" in methods(c):
                sources.add(c.name)
                source_kinds.add(class_attribute(c, "kind"))
            if {"reduce", "barrier"} <= methods(c) and class_attribute(c, "name"):
                reducers.add(c.name)
                reducer_names.add(class_attribute(c, "name"))
                reducer_modules.add(path)
            if c.name == "Callback":
                callback_module = path
        if path.endswith("events.py"):
            events_module = path
    if events_module:
        events = {c.name for c in classes(mods[events_module]) if c.name != "WorkerResult"}
    for path in reducer_modules:
        reducers |= {c.name for c in classes(mods[path]) if c.name.endswith("Buffers")}
    source_kinds.discard(None)
    reducer_names.discard(None)

    def naming(names: set[str], kinds: set[str], extra: set[str] = frozenset()) -> list[str]:
        return sorted(p for p in mods if (used[p] & (names | extra)) or (strings[p] & kinds)
                      or any(p in defined[n] for n in names))

    out = [f"a data source ({', '.join(sorted(sources))}): " + ", ".join(naming(sources, source_kinds))]
    out.append(f"a reducer ({', '.join(sorted(reducers))}): " + ", ".join(naming(reducers, reducer_names, {"COMMS"})))
    senders, dispatchers = set(), set()
    for path, tree in mods.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in events and path != events_module:
                    senders.add(path)
                if node.func.id == "isinstance" and len(node.args) == 2 and \
                        {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & events:
                    dispatchers.add(path)
    touched = sorted({events_module, callback_module, *senders, *dispatchers} - {None})
    out.append(f"a worker-fed hook ({', '.join(sorted(events))}): " + ", ".join(touched))
    return [f"{line.split(': ', 1)[0]}: {len(line.split(': ', 1)[1].split(', '))} files: {line.split(': ', 1)[1]}"
            for line in out]


# The limits and the engine's face that tests/test_structure.py holds the house to: it imports these
# readings, so that what this script counts and what the tests check cannot drift apart.
ENGINE_FACE_MODULES = {"plan", "worker", "events"}  # the engine's top modules; the rest lives in its rooms
# A module a reader takes in at one sitting, a class one can hold in mind (docs/contributing.md, "The house").
MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 250
PACKAGE = harness.ROOT / "sn_trainer"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``<package>/engine/step/board.py`` -> ``sn_trainer.engine.step.board`` (a package: its name)."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path, package: Path = PACKAGE) -> str:
    name = module_name(path, package)
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def from_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names, relative imports resolved."""
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([base] if base else []))
    return base


def engine_face(package: Path = PACKAGE) -> set[str]:
    """The names the engine's package offers: the keys of FACE in its __init__.py, read from the source."""
    init = package / "engine" / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text())) if init.exists() else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and "FACE" in ast.unparse(node).split("=")[0]:
            return {key.value for key in node.value.keys}
    return set()


def behind_the_engine_face(package: Path = PACKAGE) -> list[str]:
    """Every import, from outside the engine, of a module inside one of its rooms, or of a name its
    face does not offer (lazy imports inside functions included)."""
    face, offenders = engine_face(package), []
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, package)
        if name.startswith("sn_trainer.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = from_module(node, package_of(path, package))
                taken = [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                base, taken = None, [alias.name for alias in node.names]
            else:
                continue
            for target in [base] if base is not None else taken:
                parts = target.split(".")
                if parts[:2] != ["sn_trainer", "engine"]:
                    continue
                if len(parts) > 2 and parts[2] not in ENGINE_FACE_MODULES:
                    offenders.append(f"{name} imports {target}")
                elif len(parts) == 2 and base is not None:
                    offenders += [f"{name} takes {t} from the engine, which its face does not offer"
                                  for t in taken if t not in face and t not in ENGINE_FACE_MODULES]
    return offenders


def namesakes(package: Path = PACKAGE) -> list[str]:
    """File names two modules share, and modules named like one of the package's folders (``__init__``
    and ``__main__`` aside)."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(path.relative_to(package.parent).as_posix())
    folders = {init.parent.name for init in package.rglob("__init__.py")}
    found = [f"{name} is {' and '.join(paths)}" for name, paths in by_name.items() if len(paths) > 1]
    found += [f"{path} is named like the folder {name[:-3]}/" for name, paths in by_name.items()
              for path in paths if name[:-3] in folders]
    return found


def too_long(package: Path = PACKAGE) -> list[str]:
    """The modules over MAX_MODULE_LINES lines and the classes over MAX_CLASS_LINES."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text, where = path.read_text(), path.relative_to(package.parent).as_posix()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines")
        found += [f"{where}: class {node.name}, {node.end_lineno - node.lineno + 1} lines"
                  for node in ast.walk(ast.parse(text))
                  if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    return found


def listed(title: str, found: list[str]) -> list[str]:
    return [f"{title}: {len(found)}", *(f"  {line}" for line in found)]


def main() -> None:
    parser = harness.options(__doc__, RESULT)  # --tiny changes nothing: reading the source is quick at any size
    parser.add_argument("package", nargs="?", default=str(harness.ROOT / "sn_trainer"))
    package = Path(parser.parse_args().package)
    mods = modules(package)
    for path, tree in mods.items():
        for c in classes(tree):
            if c.name == "Trainer":
                print(f"Trainer class: {c.end_lineno - c.lineno + 1} lines, {len(methods(c))} methods ({path})")
    longest = sorted(((f.end_lineno - f.lineno + 1, f"{path}:{f.name}") for path, tree in mods.items()
                      for f in functions(tree)), reverse=True)
    print(f"functions: {len(longest)}; over 60 lines: {sum(1 for n, _ in longest if n > 60)}; the ten longest:")
    for lines, where in longest[:10]:
        print(f"  {lines:4d}  {where}")
    for line in settings_report(mods):
        print(line)
    for line in (listed("imports behind the engine's face (tests/test_structure.py)", behind_the_engine_face(package))
                 + listed("namesakes", namesakes(package))
                 + listed(f"modules over {MAX_MODULE_LINES} lines and classes over {MAX_CLASS_LINES}", too_long(package))):
        print(line)
    print("files an extension touches:")
    for line in extension_report(mods):
        print(f"  {line}")


if __name__ == "__main__":
    main()
