"""Start-up time: a bare ``import torch`` against the first ``fit`` of a process and the ones after it.

Side by side in one run, alternating rounds: (a) ``python -c "import torch"``; (b) a fresh
process that has imported sn_trainer, then times a one-step ``fit`` of LeNet with 2 workers
(the first fit), then more one-step fits with new Trainer objects and other worker counts (later
fits), with warm workers (the default, a fork server) and, for comparison, workers spawned cold.

    python benchmarks/startup.py [--rounds 5]
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

RESULT = "startup"
# Later fits: a new Trainer each, worker counts in this order (a tiny run's: one).
LATER, TINY_LATER = (2, 1, 2, 2), (1,)

JOB = """
import json, sys, time, functools
if __name__ == "__main__" and sys.argv[2] == "early":
    import sn_trainer
    sn_trainer.warm_up()  # first thing, before torch: the fork server imports it meanwhile
import torch
from torch.utils.data import TensorDataset
from sn_trainer import Trainer
from sn_trainer.models import build_model

def fit(workers, start_method):
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    data = TensorDataset(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))
    started = time.perf_counter()
    Trainer(workers=workers, batch_size=32, max_steps=1, log_every=10**9, start_method=start_method,
            verify_every=0).fit(  # the start alone: a one-step fit would verify its step
        model, data, optimizer=functools.partial(torch.optim.SGD, lr=0.01))
    return time.perf_counter() - started

if __name__ == "__main__":
    start_method = sys.argv[1]
    first = fit(2, start_method)
    later = [fit(w, start_method) for w in json.loads(sys.argv[3])]
    print(json.dumps({"first": first, "later": later}))
"""


def bare_import(code: str = "import torch") -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - started


# What any plain training script pays before its first step: torch, and torch.optim's first
# optimizer (which imports torch._dynamo).
FIRST_OPTIMIZER = ("import torch; p = torch.nn.Parameter(torch.zeros(1)); p.grad = torch.ones(1); "
                   "torch.optim.SGD([p], lr=0.1).step()")


def fits(start_method: str, script: Path, later: tuple[int, ...], when: str = "late") -> dict:
    out = subprocess.run([sys.executable, str(script), start_method, when, json.dumps(list(later))], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = harness.options(__doc__, RESULT)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds, later = (1, TINY_LATER) if args.tiny else (args.rounds, LATER)
    script = harness.out_of(args, RESULT).with_suffix(".job.py")
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(JOB)
    samples: dict[str, list[float]] = {"bare import torch": [], "import torch + a first optimizer step": [],
                                       "first fit, warm workers": [], "first fit, warm_up() at the script's start": [],
                                       "later fits, warm workers": [], "first fit, spawned": [],
                                       "later fits, spawned": []}
    try:
        for round_index in range(rounds):
            samples["bare import torch"].append(bare_import())
            samples["import torch + a first optimizer step"].append(bare_import(FIRST_OPTIMIZER))
            for start_method, label in (("forkserver", "warm workers"), ("spawn", "spawned")):
                timed = fits(start_method, script, later)
                samples[f"first fit, {label}"].append(timed["first"])
                samples[f"later fits, {label}"].extend(timed["later"])
            samples["first fit, warm_up() at the script's start"].append(
                fits("forkserver", script, later, "early")["first"])
            print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in samples.items()),
                  flush=True)
    finally:
        script.unlink(missing_ok=True)
    bare = statistics.median(samples["bare import torch"])
    rows = [{"what": k, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "n": len(v),
             "over_bare_import": statistics.median(v) / bare} for k, v in samples.items()]
    machine = harness.describe()
    report = {"machine": machine, "rounds": rounds, "later_fit_workers": list(later), "rows": rows,
              "command": harness.command()}
    lines = ["# Start-up: a bare import of torch against fits of one step", "",
             f"{harness.machine_line(machine)} `{report['command']}`: {rounds} alternating rounds; each fit is a new Trainer and a one-step "
             f"`fit` of LeNet (batch 32): the first with 2 workers, the later ones with {', '.join(map(str, later))} "
             "workers, in the same process; a fit is timed from its Trainer's construction (made just before it, "
             "or after `sn_trainer.warm_up()` at the script's start, before `import torch`). Seconds, medians "
             "[min-max].", "",
             "| what | seconds | / bare import |", "|---|---:|---:|"]
    lines += [f"| {r['what']} | {r['median_s']:.2f} [{r['min_s']:.2f}-{r['max_s']:.2f}] | {r['over_bare_import']:.2f}x |"
              for r in rows]
    harness.write(harness.out_of(args, RESULT), report, "\n".join(lines))


if __name__ == "__main__":
    main()
