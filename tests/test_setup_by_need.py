"""Training needs only pyproject.toml's base dependencies: ``scripts/setup.sh`` installs those
(``pip install -e .``) and ``scripts/train.sh`` trains with them; the test toolchain (``.[test]``,
``scripts/setup.sh test``) is the tests' alone. Checked without installing anything: every module
of sn_trainer is imported in a process where what the base install would not hold cannot be found.
"""
from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import sn_trainer

PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"
PACKAGE = Path(sn_trainer.__file__).parent

# What the test toolchain brings and training must never need.
TEST_ONLY = ("transformers", "datasets", "lightning", "pytorch_lightning", "accelerate", "mlflow", "optuna", "pytest",
             "timm", "ipykernel", "nbclient", "webdataset", "torchmetrics", "mkdocs", "ray")
# Imported inside a function only where a setting or the user asks for it, each with an extra or a
# one-line advice: logger=mlflow, the weights as safetensors, the GPT-2 encoding, a notebook's widget.
OPTIONAL = {"mlflow", "safetensors", "tiktoken", "IPython", "ray"}
# Modules that are an extra's own (a framework's adapter that subclasses its classes): without the extra,
# their import fails in one line that names it, and no other module imports them.
NEEDS_EXTRA = {"sn_trainer.integrations.ray": "ray"}

# Imports every module of sn_trainer (__main__.py ones too) with only the named top-level
# packages (and the standard library) to be found: any other raises ModuleNotFoundError, as it
# would where it is not installed. A module of NEEDS_EXTRA (argv[2]) must fail instead, in one line
# naming its extra, and leave nothing of the extra's package imported.
IMPORT_ALL = """
import importlib, importlib.abc, json, pkgutil, sys
allowed = set(sys.argv[1].split(",")) | set(sys.stdlib_module_names) | {"sn_trainer"}
needs_extra = json.loads(sys.argv[2])

class BaseInstallOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in allowed:
            raise ModuleNotFoundError(f"No module named {name!r} in the base install", name=name)
        return None

sys.meta_path.insert(0, BaseInstallOnly())
import sn_trainer
for module in pkgutil.walk_packages(sn_trainer.__path__, "sn_trainer."):
    if module.name not in needs_extra:
        importlib.import_module(module.name)
        continue
    try:
        importlib.import_module(module.name)
    except ImportError as refused:
        said = str(refused)
        assert "\\n" not in said and f"pip install 'sn_trainer[{needs_extra[module.name]}]'" in said, said
        print(said)
    else:
        raise AssertionError(f"{module.name} imported without its extra")
assert not {name.partition(".")[0] for name in sys.modules} & set(needs_extra.values()), "an extra was imported"
print("imported", len(sys.modules))
"""


def base_requirements() -> list[str]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_install() -> set[str]:
    """The distributions ``pip install -e .`` installs: the base dependencies and theirs, no extras."""
    found, todo = set(), [Requirement(r) for r in base_requirements()]
    while todo:
        requirement = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        if (name := normalized(requirement.name)) in found:
            continue
        found.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(requirement.name) or []]
        except metadata.PackageNotFoundError:  # not installed here: its own needs cannot be read
            pass
    return found


def importable(distributions: set[str]) -> set[str]:
    """The top-level import names these installed distributions provide."""
    return {top for top, owners in metadata.packages_distributions().items()
            if any(normalized(owner) in distributions for owner in owners)}


def third_party_imports() -> set[str]:
    """Every top-level package a module of sn_trainer imports, lazy imports inside functions included."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.partition(".")[0])
    return found - set(sys.stdlib_module_names) - {"sn_trainer"}


def test_no_test_only_package_is_installed_for_training():
    names = importable(base_install())
    assert "torch" in names and "hydra" in names
    assert sorted(names & set(TEST_ONLY)) == []


def import_all(allowed: set[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", IMPORT_ALL, ",".join(sorted(allowed)), json.dumps(NEEDS_EXTRA)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.quick
def test_every_module_imports_with_the_base_install_alone():
    """And one that needs an extra says which, in one line: the Ray integration without Ray."""
    proc = import_all(importable(base_install()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sn_trainer.integrations.ray needs Ray Train, which is not installed here (No module named 'ray' in the " \
           "base install): pip install 'sn_trainer[ray]'" in proc.stdout.splitlines()


def test_what_sn_trainer_imports_beyond_the_base_install_is_optional():
    assert sorted(third_party_imports() - importable(base_install()) - OPTIONAL) == []


def test_a_test_only_import_at_module_level_is_found():
    """The subprocess check is not vacuous: refusing a package the import needs makes it fail."""
    proc = import_all(importable(base_install()) - {"psutil"})
    assert proc.returncode != 0 and "No module named 'psutil' in the base install" in proc.stderr
