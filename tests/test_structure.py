"""The house's arrows point one way, its folders stay small enough to enter, the engine is entered
through its face, no two modules share a name, none is too long to read, and every setting is
declared once.

Layers, lowest first; a module imports its own layer and lower ones only, and no import chain
runs in a circle (lazy imports inside functions and TYPE_CHECKING ones count). Inside the engine
the same holds between its rooms (ENGINE_ROOMS). No package folder holds more than a dozen
modules (MAX_MODULES): the engine's old flat layout, 30 modules side by side, fails both checks
(test_the_old_flat_engine_fails_the_room_checks).
"""
import ast
import sys
from pathlib import Path

import pytest

import sn_trainer
from sn_trainer.config import setting_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
# The readings benchmarks/house.py counts for a before/after are the ones checked here.
from house import (MAX_CLASS_LINES, MAX_MODULE_LINES, behind_the_engine_face,  # noqa: E402
                   engine_face, from_module, module_name, namesakes, package_of, too_long)

PACKAGE = Path(sn_trainer.__file__).parent

# Lowest first. A package's __main__.py is one of its modules, at its layer: a command line that
# needs more than its package's layer allows lives at the top (cli/) and is a doorway's (below).
LAYERS = {
    "errors": 0, "config": 0,  # the vocabulary: what can go wrong, and every setting
    "data": 1, "models": 1, "optim": 1, "phase": 1,  # the parts a run is made of
    "node": 1,  # what this node is: CPU, cores, runtimes, its place among nodes (facts the whole house reads)
    "recipe": 1,  # what one step computes: the objective, gathering, the flat layout (the launcher's and the workers')
    "shm": 1,  # the shared-memory core: segment, barrier, liveness, collectives (for engine/ and distributed/)
    "engine": 2,  # the workers: reads a resolved plan, owns no file format and no reporting
    "distributed": 3,  # the "sn" torch.distributed backend, for code that already runs DDP
    "callbacks": 3, "checkpoint": 3, "export": 3, "tuner": 3,  # the launcher's components
    "report": 4,  # writers the command line attaches (progress, TensorBoard, MLflow) and the sweep report
    "fit": 5,  # one fit: resolve, session, result
    # adapters to third-party frameworks (a LightningModule as fit's arguments): they read fit's inputs
    # (fit/resolve.py), so they sit at fit's layer, below the Trainer that calls them
    "integrations": 5,
    "doctor": 5,  # reads what a fit returned or a run's folder holds, against the seeds' tables
    "trainer": 6,  # the public API
    "cli": 7, "__main__": 7, "__init__": 7,  # the command lines, sn_trainer's own __main__, the lazy names
    "launch": 7,  # a pinning torchrun: an edge like the command line
    "verify": 7,  # prove it on your model: Trainer.verify's command line
}

# The engine's rooms, lowest first: a module of the engine imports its own room and lower ones only,
# so no import runs in a circle between rooms. Its face is three modules at its top (plan, worker,
# events) and the names its package offers (sn_trainer/engine/__init__.py's FACE); the rest lives
# in sub-packages no module outside the engine imports.
ENGINE_ROOMS = {
    "events": 0,  # what workers tell the launcher: typed events, plain data
    "plan": 1,  # the resolved plan the workers read
    "memory": 2,  # shared parameters, optimizer state by shard, peak memory
    "collectives": 3,  # reducers, compression between nodes
    "processes": 4,  # the fork server, spawning, supervision and teardown, pickling, signals, stages
    "step": 5,  # one step and evaluation in a worker: replica, phases, batch norm, board, verification
    "worker": 6,  # one worker process's life
}
# The face's top modules (ENGINE_FACE_MODULES) and the limits MAX_MODULE_LINES and MAX_CLASS_LINES are
# benchmarks/house.py's.

# A folder is a room a reader can enter (docs/contributing.md, "The house"): past a dozen modules, its parts
# deserve sub-packages of their own.
MAX_MODULES = 12

# `python -m` names kept inside a lower package for a command line that lives in cli/: such a
# __main__.py imports that one module and nothing else of ours, so it sits at the top with it.
DOORWAYS = {
    "sn_trainer.tuner.__main__": "sn_trainer.cli.tune",  # the tuner's command line calibrates with the Trainer
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file imports, absolute, lazy imports inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = from_module(node, package)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # from .. import checkpoint
    return found


def layer(module: str) -> int | None:
    """The layer of one of the package's modules (None: not one of ours, or the package itself)."""
    parts = module.split(".")
    if parts[0] != "sn_trainer" or len(parts) == 1:
        return None
    if module in DOORWAYS:
        return LAYERS["cli"]
    return LAYERS[parts[1]]


def own_imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each of the package's modules (every ``__main__.py`` included) and the package's modules it
    imports. ``from p import m`` of a module ``m`` imports ``p.m``; of any other name, ``p``. (A
    package is initialised by any import of its modules: that is no edge of its own.)"""
    files = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = from_module(node, package_of(path, package))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {t for t in targets if t in files and t != "sn_trainer"}
    return graph


@pytest.mark.unit
def test_imported_modules_resolves_relative_imports(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("from .. import checkpoint\nfrom ..report.machine import f\ndef g():\n    import json\n")
    assert {"sn_trainer.checkpoint", "sn_trainer.report.machine", "json"} <= imported_modules(source,
                                                                                           "sn_trainer.engine")


def test_every_module_has_a_layer():
    assert all(layer(name) is not None for name in own_imports() if name != "sn_trainer")


def imports_back_up(package: Path = PACKAGE) -> list[str]:
    """Every import of a module of a higher layer, and every import of a doorway's but the one it opens."""
    offenders = []
    for name, targets in own_imports(package).items():
        if name == "sn_trainer":  # the package's lazy names: every layer's, as its users' imports
            continue
        allowed = {DOORWAYS[name]} if name in DOORWAYS else {t for t in targets if layer(t) <= layer(name)}
        offenders += [f"{name} imports {target}" for target in sorted(targets - allowed)]
    return offenders


@pytest.mark.quick
def test_no_module_imports_a_higher_layer():
    assert imports_back_up() == []


def test_every_main_module_is_checked_at_its_packages_layer():
    mains = {name for name in own_imports() if name.endswith(".__main__")}
    assert mains == {module_name(p, PACKAGE) for p in PACKAGE.rglob("__main__.py")} and "sn_trainer.tuner.__main__" in mains
    assert layer("sn_trainer.report.__main__") == LAYERS["report"] < layer("sn_trainer.__main__")


@pytest.mark.unit
@pytest.mark.parametrize("main_py, offender", [
    # the tuner's command line as it was: fit -> tuner -> trainer -> fit
    ("def predict():\n    from ..trainer import Trainer\n", "sn_trainer.tuner.__main__ imports sn_trainer.trainer"),
    # a doorway that does more than open its command line
    ("from ..cli.tune import main\nfrom ..trainer import Trainer\n",
     "sn_trainer.tuner.__main__ imports sn_trainer.trainer"),
    ("from ..cli.job import run_job\n", "sn_trainer.tuner.__main__ imports sn_trainer.cli.job"),
])
def test_a_main_module_importing_back_up_is_found(tmp_path, main_py, offender):
    """The check above is not vacuous for __main__.py: one that imports above its package is reported."""
    package = tmp_path / "sn_trainer"
    for path, text in {"__init__.py": "", "trainer.py": "", "tuner/__init__.py": "", "tuner/__main__.py": main_py,
                       "cli/__init__.py": "", "cli/tune.py": "from ..trainer import Trainer\n",
                       "cli/job.py": ""}.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    assert imports_back_up(package) == [offender]


def test_no_import_runs_in_a_circle():
    graph, cycles, state = own_imports(), [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]) if target in path else target)
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize("where, forbidden", [
    ("report", ("sn_trainer.trainer", "sn_trainer.fit", "sn_trainer.tuner", "sn_trainer.cli")),  # predict_table
    ("tuner", ("sn_trainer.report",)),  # the hardware probes are the engine's (node/cpu.py)
    ("data", ("sn_trainer.cli",)),  # the command line's dataset catalogue is the command line's
])
def test_the_three_imports_that_ran_back_up_stay_gone(where, forbidden):
    offenders = [f"{name} imports {target}" for name, targets in own_imports().items()
                 if name.startswith(f"sn_trainer.{where}")
                 for target in sorted(targets) if target.startswith(forbidden)]
    assert offenders == []


@pytest.mark.unit
def test_the_layer_check_fails_on_an_import_back_up(tmp_path):
    """The check above is not vacuous: an upward import is one it reports."""
    source = tmp_path / "sweep.py"
    source.write_text("def f():\n    from ..trainer import Trainer\n")
    targets = {m for m in imported_modules(source, "sn_trainer.report") if m.startswith("sn_trainer.")}
    assert "sn_trainer.trainer" in targets and layer("sn_trainer.trainer") > layer("sn_trainer.report.sweep")


@pytest.mark.unit
def test_no_engine_module_imports_the_checkpoint_file_or_reporting():
    offenders = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        for module in imported_modules(path, package_of(path, PACKAGE)):
            if module.split(".")[:2] in (["sn_trainer", "checkpoint"], ["sn_trainer", "report"]):
                offenders.append(f"{path.name} imports {module}")
    assert offenders == []


# --- the engine's rooms, and folders a reader can enter ----------------------------------------

def engine_room(module: str) -> str | None:
    """The room of one of the engine's modules: its sub-package, or the module itself at the top
    (None: not inside the engine, or the engine package itself)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["sn_trainer", "engine"] and len(parts) > 2 else None


def engine_modules_without_a_room(package: Path = PACKAGE) -> list[str]:
    return sorted(name for name in own_imports(package)
                  if engine_room(name) is not None and engine_room(name) not in ENGINE_ROOMS)


def engine_imports_back_up(package: Path = PACKAGE) -> list[str]:
    """Every import by an engine module of a module in a higher room."""
    offenders = []
    for name, targets in own_imports(package).items():
        if engine_room(name) not in ENGINE_ROOMS:
            continue
        offenders += [f"{name} imports {target}" for target in sorted(targets)
                      if engine_room(target) in ENGINE_ROOMS
                      and ENGINE_ROOMS[engine_room(target)] > ENGINE_ROOMS[engine_room(name)]]
    return sorted(offenders)


def crowded_folders(package: Path = PACKAGE) -> list[str]:
    """Every package folder holding more than MAX_MODULES modules (``__init__.py`` counted)."""
    found = []
    for init in sorted(package.rglob("__init__.py")):
        count = len(list(init.parent.glob("*.py")))
        if count > MAX_MODULES:
            found.append(f"{init.parent.relative_to(package.parent).as_posix()} holds {count} modules")
    return found


@pytest.mark.unit
def test_every_engine_module_has_a_room():
    assert engine_modules_without_a_room() == []


@pytest.mark.unit
def test_no_engine_module_imports_a_higher_room():
    assert engine_imports_back_up() == []


@pytest.mark.unit
def test_no_package_folder_holds_more_than_a_dozen_modules():
    assert crowded_folders() == []


@pytest.mark.unit
def test_an_engine_import_up_a_room_is_found(tmp_path):
    """The room check is not vacuous: the memory room reaching up into the step is reported."""
    package = tmp_path / "sn_trainer"
    for path, text in {"__init__.py": "", "engine/__init__.py": "", "engine/memory/__init__.py": "",
                       "engine/memory/shared.py": "def f():\n    from ..step.replica import Replica\n",
                       "engine/step/__init__.py": "", "engine/step/replica.py": "from ..memory import shared\n",
                       "engine/plan.py": "from .step import replica\n"}.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    assert engine_imports_back_up(package) == ["sn_trainer.engine.memory.shared imports sn_trainer.engine.step.replica",
                                               "sn_trainer.engine.plan imports sn_trainer.engine.step.replica"]


@pytest.mark.unit
def test_the_old_flat_engine_fails_the_room_checks(tmp_path):
    """The engine as it was, 30 modules side by side: a folder too crowded to enter, and modules
    in no room."""
    old = ("_forkserver_preload ambient batchnorm board by_sums cluster comm compression events forkserver gather "
           "launch layout machine memory metric_states objective phases plan position replica runtime schedule "
           "shared signals split_check stages state topology worker").split()
    package = tmp_path / "sn_trainer"
    (package / "engine").mkdir(parents=True)
    for name in ["__init__", *(f"engine/{m}" for m in ["__init__", *old])]:
        (package / f"{name}.py").write_text("")
    assert crowded_folders(package) == ["sn_trainer/engine holds 31 modules"]
    assert engine_modules_without_a_room(package) == sorted(
        f"sn_trainer.engine.{m}" for m in old if m not in ENGINE_ROOMS)


# --- the engine's face ----------------------------------------------------------------------------

@pytest.mark.unit
def test_the_engine_is_entered_only_through_its_face():
    assert behind_the_engine_face(PACKAGE) == []


def test_every_name_of_the_engine_face_is_there():
    """Each name FACE offers loads from the module it names (a name moved in a room and not in FACE fails).
    Not a unit test: loading the reducers may build the shared-memory collectives' C core."""
    import sn_trainer.engine as engine

    assert engine_face(PACKAGE) == set(engine.FACE) and engine_face(PACKAGE)
    missing = []
    for name in engine.FACE:
        try:
            getattr(engine, name)
        except (AttributeError, ImportError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []


@pytest.mark.unit
def test_an_import_behind_the_engine_face_is_found(tmp_path):
    """The face check is not vacuous: a room's module, and a name the face does not offer, are reported;
    the top modules and the names FACE offers are not."""
    package = tmp_path / "sn_trainer"
    for path, text in {"__init__.py": "", "engine/__init__.py": 'FACE = {"run_workers": "processes.supervise:run_workers"}\n',
                       "fit/__init__.py": "",
                       "fit/session.py": "from ..engine.plan import Plan\nfrom ..engine import run_workers, Replica\n"
                                         "def f():\n    from ..engine.step.replica import Replica\n",
                       "trainer.py": "import sn_trainer.engine.processes.forkserver\nfrom .engine import events\n"}.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    assert behind_the_engine_face(package) == [
        "sn_trainer.fit.session takes Replica from the engine, which its face does not offer",
        "sn_trainer.fit.session imports sn_trainer.engine.step.replica",
        "sn_trainer.trainer imports sn_trainer.engine.processes.forkserver"]


# --- names that explain themselves, and modules short enough to read ----------------------------

@pytest.mark.unit
def test_no_two_modules_share_a_name_and_none_is_named_like_a_folder():
    assert namesakes(PACKAGE) == []


@pytest.mark.unit
def test_no_module_over_400_lines_and_no_class_over_250():
    assert too_long(PACKAGE) == []


@pytest.mark.unit
def test_namesakes_and_long_modules_are_found(tmp_path):
    """The two checks above are not vacuous: the namesakes of the house as it was, and a module and a
    class past their limits, are reported."""
    package = tmp_path / "sn_trainer"
    long_class = "class Replica:\n" + "    x = 1\n" * MAX_CLASS_LINES
    for path, text in {"__init__.py": "", "engine/plan.py": "", "report/__init__.py": "", "report/plan.py": "",
                       "launch/__init__.py": "", "engine/__init__.py": "", "engine/processes/__init__.py": "",
                       "engine/processes/launch.py": "", "engine/step/__init__.py": "", "engine/step/replica.py": long_class,
                       "fit/__init__.py": "", "fit/resolve.py": "\n" * (MAX_MODULE_LINES + 1)}.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    assert namesakes(package) == ["plan.py is sn_trainer/engine/plan.py and sn_trainer/report/plan.py",
                                  "sn_trainer/engine/processes/launch.py is named like the folder launch/"]
    assert too_long(package) == [f"sn_trainer/engine/step/replica.py: class Replica, {MAX_CLASS_LINES + 1} lines",
                                 f"sn_trainer/fit/resolve.py: {MAX_MODULE_LINES + 1} lines"]


# --- every setting declared once -------------------------------------------------------------

def dataclasses_in(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("dataclass") for d in node.decorator_list):
            yield node


def fields_with_defaults(node: ast.ClassDef) -> list[str]:
    return [item.target.id for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None
            and "ClassVar" not in ast.unparse(item.annotation)]


def settings_redeclared(package: Path) -> list[str]:
    """Fields of a dataclass other than TrainerConfig (and the parts it holds) that give a setting
    a default of its own: a ``<Name>Config``'s field ``f`` is the setting ``<name>_f``."""
    settings = {row.keyword for row in setting_rows()}
    parts = {"TrainerConfig", *{type(getattr(sn_trainer.config.TrainerConfig(), row.part)).__name__
                                for row in setting_rows() if row.part}}
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in dataclasses_in(ast.parse(path.read_text())):
            if node.name in parts:
                continue
            prefix = node.name[: -len("Config")].lower() + "_" if node.name.endswith("Config") else ""
            found += [f"{node.name}.{f} ({path.name})" for f in fields_with_defaults(node) if prefix + f in settings]
    return found


@pytest.mark.unit
def test_no_setting_has_a_default_anywhere_but_in_trainer_config():
    assert settings_redeclared(PACKAGE) == []


@pytest.mark.unit
def test_a_second_default_of_a_setting_is_found(tmp_path):
    """The check above is not vacuous: a class giving batch_size a default of its own is caught."""
    (tmp_path / "plan.py").write_text("from dataclasses import dataclass\n\n@dataclass(frozen=True)\nclass Plan:\n"
                                      "    batch_size: int = 64\n    steps: int = 1\n")
    (tmp_path / "cli.py").write_text("from dataclasses import dataclass\n\n@dataclass\nclass CheckpointingConfig:\n"
                                     "    keep: int = 3\n\n@dataclass\nclass DatasetConfig:\n    seed: int = 0\n")
    assert settings_redeclared(tmp_path) == ["Plan.batch_size (plan.py)"]


@pytest.mark.unit
def test_the_plan_and_the_placement_repeat_no_setting():
    """What the workers read holds the settings themselves, decided, and only what follows from them."""
    from dataclasses import fields

    from sn_trainer.engine.plan import Placement, Plan

    settings = {row.keyword for row in setting_rows()} | {f.name for f in fields(sn_trainer.config.TrainerConfig)}
    assert [f.name for kind in (Plan, Placement) for f in fields(kind) if f.name in settings] == []


# --- the unit tier -------------------------------------------------------------------------------

@pytest.mark.unit
def test_a_unit_test_that_starts_a_process_fails():
    """``-m unit`` selects tests that start no process; tests/conftest.py holds them to it: in a
    test marked unit, every way to start one (subprocess, multiprocessing's fork and spawn, os)
    raises instead (without starting one: the refusal comes first)."""
    import multiprocessing
    import os
    import subprocess

    with pytest.raises(AssertionError, match=r"is marked unit but started a process \(_fork_exec\)"):
        subprocess.run(["true"])
    for method in ("fork", "forkserver", "spawn"):
        with pytest.raises(AssertionError, match=r"started a process \(start\)"):
            multiprocessing.get_context(method).Process(target=print).start()
    with pytest.raises(AssertionError, match=r"started a process \(fork\)"):
        os.fork()
    with pytest.raises(AssertionError, match=r"started a process \(system\)"):
        os.system("true")


# --- the quick tier ------------------------------------------------------------------------------

TESTS = Path(__file__).parent


def names_quick(node: ast.AST) -> bool:
    """Whether ``pytest.mark.quick`` (or ``mark.quick``) is written inside ``node``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "quick" and ast.unparse(n.value).endswith("mark")
               for n in ast.walk(node))


def without_quick_tests(tests: Path = TESTS) -> list[str]:
    """The test modules with no test in the quick tier (``-m quick``, scripts/test.sh --quick), read
    from their source: a test (or test class) decorated with the mark, a module's ``pytestmark``
    holding it, or one parameter set's ``pytest.param(..., marks=...)`` holding it."""
    found = []
    for path in sorted(tests.glob("test_*.py")):
        tree, quick = ast.parse(path.read_text()), False
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                quick |= node.name.lower().startswith("test") and any(names_quick(d) for d in node.decorator_list)
            elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "param":
                quick |= any(k.arg == "marks" and names_quick(k.value) for k in node.keywords)
        quick |= any(isinstance(node, ast.Assign) and names_quick(node.value)
                     and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
                     for node in tree.body)
        if not quick:
            found.append(path.name)
    return found


@pytest.mark.unit
def test_every_test_module_has_a_quick_test():
    """``bash scripts/test.sh --quick`` tells each module's story once: a new module chooses its test."""
    assert without_quick_tests() == []


@pytest.mark.unit
def test_a_test_module_without_a_quick_test_is_found(tmp_path):
    """The check above is not vacuous: a module whose quick mark is only in a comment, on a helper or
    on a test's other marks is reported; each of the three ways to mark a test is found."""
    for name, text in {
        "test_none.py": "import pytest\n\n\n@pytest.mark.quick\ndef helper():\n    pass\n\n\n"
                        "@pytest.mark.unit  # not pytest.mark.quick\n@pytest.mark.parametrize('w', [1, "
                        "pytest.param(2, marks=pytest.mark.unit)])\ndef test_a(w):\n    pass\n",
        "test_decorated.py": "import pytest\n\n\n@pytest.mark.quick\ndef test_a():\n    pass\n",
        "test_module.py": "import pytest\n\npytestmark = [pytest.mark.unit, pytest.mark.quick]\n\n\ndef test_a():\n"
                          "    pass\n",
        "test_param.py": "import pytest\n\n\n@pytest.mark.parametrize('w', [1, pytest.param(2, marks=[pytest.mark.quick])])"
                         "\ndef test_a(w):\n    pass\n",
        "helpers.py": "def test_like_helper():\n    pass\n",  # no test module: not checked
    }.items():
        (tmp_path / name).write_text(text)
    assert without_quick_tests(tmp_path) == ["test_none.py"]


# --- side by side --------------------------------------------------------------------------------

# Two modules, for two test processes: their first tests meet (each waits for the other's file, so both
# ran at once); then one process runs a test marked alone while the other has an ordinary test to run.
_MEETS = '''
import os, time
from pathlib import Path

import pytest

LOG = Path(os.environ["SIDE_BY_SIDE_LOG"])


def timed(name, body):
    start = time.monotonic()
    body()
    LOG.joinpath(name).write_text(f"{{start}} {{time.monotonic()}}")


def meet(me, other):
    LOG.joinpath(me + ".here").touch()
    deadline = time.monotonic() + 60
    while not LOG.joinpath(other + ".here").exists():
        assert time.monotonic() < deadline, "the other test process never came"
        time.sleep(0.01)


def test_{me}_meets():
    timed("{me}_meets", lambda: meet("{me}", "{other}"))


{mark}
def test_{me}_then():
    timed("{me}_then", lambda: sum(range(3_000_000)))
'''


def test_a_test_marked_alone_runs_with_no_other_test_beside_it(tmp_path):
    """Run in two test processes (pytest -n 2, a module to each), tests/conftest.py holds a test marked
    alone (one that reads what the whole machine holds) to a turn of its own."""
    import os
    import shutil
    import subprocess

    tests, log = tmp_path / "tests", tmp_path / "log"
    tests.mkdir(), log.mkdir()
    shutil.copy(TESTS / "conftest.py", tests)
    tests.joinpath("test_a.py").write_text(_MEETS.format(me="a", other="b", mark=""))
    tests.joinpath("test_b.py").write_text(_MEETS.format(me="b", other="a", mark="@pytest.mark.alone"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadfile", str(tests)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SIDE_BY_SIDE_LOG": str(log)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    (alone_start, alone_end), (other_start, other_end) = [[float(t) for t in log.joinpath(name).read_text().split()]
                                                          for name in ("b_then", "a_then")]
    assert alone_end <= other_start or other_end <= alone_start  # one waited for the other
