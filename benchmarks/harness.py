"""What every benchmark here shares: its command line (--out, --tiny), the command and machine its
results name, medians with their spread, and the results files.

sn_trainer is imported inside the functions that need it, so that importing this module costs
nothing to a benchmark that reads no torch (house.py) and to the list run.py prints.
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout; results/ lies in it

TINY_HELP = ("every part once at the smallest size, for a smoke run (tests/test_benchmarks.py): the figures "
             "mean nothing")


def options(doc: str, result: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first line, ``--tiny``, and ``--out`` where it writes ``result``
    (the stem of its results files) by default to results/<machine>/<result>."""
    parser = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    parser.add_argument("--tiny", action="store_true", help=TINY_HELP)
    if result is not None:
        parser.add_argument("--out", default=None,
                            help=f"the results files' stem: <out>.md and <out>.json (default results/<machine>/{result})")
    return parser


def rounds_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of a benchmark that measures rows of cases in rounds, at W workers."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--workers", type=int, default=None, help="default: all physical cores")
    parser.add_argument("--cases", help="only these rows, by label, comma-separated (e.g. 'lenet b128 cl,gpt b32')")
    return parser


def picked(parser: argparse.ArgumentParser, cases: list, asked: str | None) -> list:
    """The ``cases`` (each with a ``label``) that ``--cases`` names, in their order (all where it names none);
    a label that is none of them ends the run with the parser's error, naming the cases."""
    if not asked:
        return cases
    wanted = [label.strip() for label in asked.split(",")]
    unknown = set(wanted) - {c.label for c in cases}
    if unknown:
        parser.error(f"unknown case {sorted(unknown)}; the cases: {', '.join(c.label for c in cases)}")
    return [c for c in cases if c.label in wanted]


def out_of(args: argparse.Namespace, result: str) -> Path:
    """Where the results go: ``--out``, else results/<machine>/<result> in the checkout."""
    return Path(args.out) if args.out else ROOT / "results" / machine_folder() / result


def machine_folder() -> str:
    """results/'s folder for this machine: the CPU, its widest vector instructions and its physical cores
    (e.g. amd-epyc-avx2-2c), since hosts of one CPU name compute at other speeds with other kernels."""
    from sn_trainer.node.cpu import describe_machine, machine_slug

    machine = describe_machine()
    isa = "avx512" if "avx512f" in machine["isa"] else "avx2" if "avx2" in machine["isa"] else ""
    slug, cores = machine_slug(machine), f"-{machine['physical_cores']}c"
    return slug.replace(cores, f"-{isa}{cores}") if isa else slug


def describe() -> dict:
    """The machine, as every results file records it (no host name, no user, no paths)."""
    from sn_trainer.node.cpu import describe_machine

    return describe_machine()


def machine_line(machine: dict, memory: bool = False) -> str:
    """The sentence that opens a results file's description: CPU, cores, instruction sets (memory), torch."""
    isa = f" ({', '.join(machine['isa'])})" if machine["isa"] else ""
    gib = f", {machine['memory_gib']} GiB" if memory else ""
    return f"Machine: {machine['cpu_model']}, {machine['physical_cores']} physical cores{isa}{gib}, torch {machine['torch']}."


def command(hidden: dict[str, str] | None = None) -> str:
    """The command this process runs, as the results file gives it to reproduce: ``--out`` left out (where
    the files went is not how they were made), each value in ``hidden`` replaced by its placeholder (a
    checkout's path by ``<base checkout>``): a results file names no path of the machine it ran on."""
    args, words = sys.argv[1:], []
    while args:
        word = args.pop(0)
        if word == "--out":
            args = args[1:]
        elif not word.startswith("--out="):
            words.append((hidden or {}).get(word, word))
    return shlex.join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *words])


def spread(values: list[float], digits: int = 0) -> str:
    """``median [min-max]`` of a measurement's rounds."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def write(out: Path | str, report: dict, markdown: str) -> None:
    """``<out>.json`` with every figure and ``<out>.md`` with the table, printed too."""
    from sn_trainer.report.results import write_result

    write_result(out, report, markdown)


BUSY_LOOP = ["sh", "-c", "while :; do :; done"]


@contextlib.contextmanager
def busy_loops(count: int):
    """``count`` busy loops of the benchmark's own priority (``sh -c 'while :; do :; done'``) for as long as
    the block runs: the other work of a workstation, a shared server or a CI runner."""
    loops = [subprocess.Popen(BUSY_LOOP, start_new_session=True) for _ in range(count)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
