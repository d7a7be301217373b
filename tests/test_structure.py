"""The house's arrows point one way: the engine knows no file format and no reporting."""
import ast
from pathlib import Path

import sn_trainer

PACKAGE = Path(sn_trainer.__file__).parent


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file imports, absolute, lazy imports inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # from .. import checkpoint
    return found


def test_imported_modules_resolves_relative_imports(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("from .. import checkpoint\nfrom ..report.machine import f\ndef g():\n    import json\n")
    assert {"sn_trainer.checkpoint", "sn_trainer.report.machine", "json"} <= imported_modules(source,
                                                                                           "sn_trainer.engine")


def test_no_engine_module_imports_the_checkpoint_file_or_reporting():
    offenders = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        for module in imported_modules(path, "sn_trainer.engine"):
            if module.split(".")[:2] in (["sn_trainer", "checkpoint"], ["sn_trainer", "report"]):
                offenders.append(f"{path.name} imports {module}")
    assert offenders == []
