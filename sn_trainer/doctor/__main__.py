"""``python -m sn_trainer.doctor [RUN_DIR]``: this machine checked as the seeds check one; with a
run's (or a sweep's) folder, the run read against their tables, the costliest finding first."""
from __future__ import annotations

import argparse
import sys

from ..errors import InputError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", help="a run's output folder (holding summary.json), or a sweep's")
    parser.add_argument("--machine", action="store_true", help="with RUN_DIR: check the machine too")
    parser.add_argument("--no-data", action="store_true", help="skip timing the files of a folder or text run")
    parser.add_argument("--sys-root", default="/sys", help="the sysfs to read (default /sys)")
    parser.add_argument("--proc-root", default="/proc", help="the procfs to read (default /proc)")
    parser.add_argument("--sample", type=float, default=0.5, help="seconds other processes' CPU is sampled for")
    args = parser.parse_args(argv)
    from . import diagnose_facts
    from .findings import render
    from .folders import read_folder
    from .machine import machine_findings

    runs = []
    if args.run_dir:
        try:
            runs = read_folder(args.run_dir)
        except InputError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if not runs or args.machine:
        need = max((facts.get("peak_memory_bytes") or 0 for _, facts in runs), default=0) or None
        print("machine:")
        print(render(machine_findings(args.sys_root, args.proc_root, args.sample, need)))
    for name, facts in runs:
        print()
        print(diagnose_facts(facts, name).report())
        if not args.no_data and "skipped" not in facts.summary:
            from .data_speed import data_findings

            found = data_findings(facts)
            if any(f.visible for f in found):
                print("data at the disk's bandwidth:")
                print(render(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
