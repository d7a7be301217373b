"""The benchmarks' one entry point: list them, or run one or several by name, options passed through.

    python benchmarks/run.py                              # each: what it measures, the results it writes
    python benchmarks/run.py bench --rounds 5             # one, with its own options (bench.py --help)
    python benchmarks/run.py startup w1_bench --tiny      # several in turn, each given the same options
    python benchmarks/run.py all --tiny --out-dir DIR --timeout 300   # every one at its smallest: a smoke run

``--out-dir DIR`` sends each one's results to DIR/<RESULT> and ``--timeout S`` stops one that runs
longer than S seconds; every other option goes to each benchmark as it is.

Each benchmark is a script of this folder, run in a fresh process of its own as
``python benchmarks/<name>.py [options]`` would run it; a run of several goes on past one that fails
and ends with exit code 1 naming those that did. What a benchmark measures is its docstring's first
paragraph; the stem of the results files it writes is its ``RESULT`` (results/<machine>/<RESULT>.md
and .json unless given ``--out``; ``RESULT_FILES`` says otherwise where it writes otherwise). Read
from the source, so the list imports nothing.
"""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"harness", "run"}  # the shared part and this file


@dataclass(frozen=True)
class Benchmark:
    name: str
    measures: str  # its docstring's first paragraph
    result: str | None  # the stem of its results files; None: it prints only
    writes: str  # the files, as the list shows them


def constant(tree: ast.Module, name: str) -> str | None:
    """The value of a module-level ``name = "..."`` (or None), read without importing the module."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets) \
                and isinstance(node.value, ast.Constant):
            return node.value.value
    return None


def benchmarks() -> list[Benchmark]:
    """Every benchmark of this folder, by name."""
    found = []
    for path in sorted(HERE.glob("*.py")):
        if path.stem in NOT_BENCHMARKS:
            continue
        tree = ast.parse(path.read_text())
        result = constant(tree, "RESULT")
        writes = constant(tree, "RESULT_FILES") or (f"results/<machine>/{result}.md and .json" if result
                                                    else "nothing: it prints")
        measures = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
        found.append(Benchmark(path.stem, measures, result, writes))
    return found


def listing(known: list[Benchmark]) -> str:
    return "\n".join(f"{b.name}: {b.measures}\n    writes {b.writes}" for b in known)


def run_one(benchmark: Benchmark, options: list[str], out_dir: Path | None, timeout: float | None) -> str | None:
    """Run one benchmark to its end; None, or why it failed. Its processes share a session of their own, so
    that a run over ``timeout`` seconds is stopped whole, workers and all."""
    command = [sys.executable, str(HERE / f"{benchmark.name}.py"), *options]
    if out_dir is not None and benchmark.result is not None:
        command += ["--out", str(out_dir / benchmark.result)]
    print(f"== {benchmark.name}: {' '.join(command[1:])}", flush=True)
    process = subprocess.Popen(command, start_new_session=True)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"still running after {timeout:.0f} s, stopped"
    return None if code == 0 else f"exit code {code}"


def main(argv: list[str]) -> int:
    known = benchmarks()
    by_name = {b.name: b for b in known}
    names = []
    while argv and not argv[0].startswith("-"):
        names.append(argv.pop(0))
    out_dir, timeout = None, None
    options = []
    while argv:  # run.py's own options; everything else goes to the benchmarks
        word = argv.pop(0)
        if word == "--out-dir":
            out_dir = Path(argv.pop(0))
        elif word == "--timeout":
            timeout = float(argv.pop(0))
        else:
            options.append(word)
    if not names:
        print(listing(known) if not options else __doc__ + "\n" + listing(known))
        return 0
    chosen = known if names == ["all"] else [by_name.get(n) for n in names]
    if None in chosen:
        unknown = [n for n in names if n not in by_name]
        print(f"unknown benchmark {', '.join(unknown)}; the benchmarks:\n{listing(known)}", file=sys.stderr)
        return 2
    failed = {b.name: why for b in chosen if (why := run_one(b, options, out_dir, timeout)) is not None}
    for name, why in failed.items():
        print(f"{name} failed: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
