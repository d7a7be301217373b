"""The documentation: the site builds with warnings as errors, the code blocks that claim to run do,
and the README stays a few screens that start with the two commands."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# A fenced Python block whose line before is "<!-- runs -->": the docs say it runs, so it is run.
RUNS = re.compile(r"^<!-- runs -->\n```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in sorted(DOCS.rglob("*.md")):
        for n, match in enumerate(RUNS.finditer(page.read_text())):
            blocks.append((f"{page.relative_to(DOCS)}#{n}", match.group(1)))
    return blocks


def this_checkout_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.quick
def test_the_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**this_checkout_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()


@pytest.mark.unit
def test_some_blocks_are_marked_to_run():
    assert len(runnable_blocks()) >= 3


@pytest.mark.parametrize("where,code", runnable_blocks(), ids=[where for where, _ in runnable_blocks()])
def test_a_block_that_claims_to_run_runs(where, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=90,
                          env=this_checkout_env())
    assert proc.returncode == 0, f"{where}:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.unit
def test_the_readme_is_a_few_screens_that_start_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    first_block = re.search(r"^```[a-z]*\n(.*?)^```", readme, re.MULTILINE | re.DOTALL).group(1)
    assert "bash scripts/train.sh" in first_block and "bash scripts/test.sh" in first_block


@pytest.mark.unit
def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
