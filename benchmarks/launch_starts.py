"""Starts of a tiny gloo DDP script under ``python -m sn_trainer.launch``, counted by how each ended.

    python benchmarks/launch_starts.py [--starts 50] [--tree <checkout>]

Each run appends its table to results/<machine>/launch_starts.md (or --out), so that runs of two
checkouts stand side by side.

Each start is a fresh launcher with 2 ranks pinned to a core each, the script training one DDP step over
gloo and ending. A rank that aborts in the interpreter's teardown (gloo's thread still releasing the
backward's last work: std::terminate, SIGABRT) fails the start. ``--tree`` runs another checkout's
launcher (e.g. one from before the fix, made with ``git worktree add``), to compare in one session.
"""
from __future__ import annotations

import collections
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness

RESULT = "launch_starts"
RESULT_FILES = "results/<machine>/launch_starts.md, each run's table appended"
SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
model(torch.ones(1, 2)).sum().backward()
dist.destroy_process_group()
"""


def start(tree: Path, script: Path) -> str:
    """One launch: "ok", or how it failed (an aborted rank, another exit code, a hang)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(tree)
    try:
        done = subprocess.run([sys.executable, "-m", "sn_trainer.launch", "--nproc-per-node=2",
                               "--monitor-interval=0.05", str(script)], env=env, capture_output=True, text=True,
                              timeout=300, start_new_session=True)
    except subprocess.TimeoutExpired:
        return "hung"
    if done.returncode == 0:
        return "ok"
    return "aborted (SIGABRT)" if "SIGABRT" in done.stderr or "terminate called" in done.stderr \
        else f"exit code {done.returncode}"


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--starts", type=int, default=50)
    parser.add_argument("--tree", type=Path, default=harness.ROOT, help="the checkout whose launcher starts")
    args = parser.parse_args()
    if args.tiny:
        args.starts = 1
    commit = subprocess.run(["git", "-C", str(args.tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "tiny.py"
        script.write_text(SCRIPT)
        began = time.monotonic()
        outcomes = collections.Counter(start(args.tree, script) for _ in range(args.starts))
        seconds = time.monotonic() - began
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    text = (f"# {args.starts} starts of a gloo DDP script under sn_trainer.launch, checkout {commit}\n\n"
            f"- CPU: {cpu}; {len(os.sched_getaffinity(0))} cores usable; torch {torch.__version__}\n"
            f"- measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC in {seconds:.0f} s with "
            f"`{harness.command({str(args.tree): '<checkout>'})}`\n\n| outcome | starts |\n|---|---:|\n"
            + "".join(f"| {outcome} | {count} |\n" for outcome, count in outcomes.most_common()))
    out = harness.out_of(args, RESULT).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as markdown:
        markdown.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
