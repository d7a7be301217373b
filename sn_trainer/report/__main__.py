"""``python -m sn_trainer.report <sweep dir>``: sweep.csv, the study's plots and the best setting.

(What the tuner predicts for another machine is ``python -m sn_trainer.tuner --predict ...``.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .sweep import ReportError, collect, plot_all, study, table, write_csv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--predict" in argv:  # where it was before the tuner had a command of its own
        print("error: the scaling prediction is the tuner's: python -m sn_trainer.tuner "
              + " ".join(argv), file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", nargs="?", help="a multirun directory (holding one folder per job)")
    parser.add_argument("--out", help="where to write sweep.csv and the PNGs (default: the sweep directory)")
    args = parser.parse_args(argv)
    if not args.sweep_dir:
        parser.error("give a sweep directory")
    try:
        rows = collect(args.sweep_dir)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or args.sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "sweep.csv")
    paths = plot_all(rows, out)
    print(table(rows))
    found = study(args.sweep_dir, rows)
    if found:
        print(found)
    print(f"wrote {out / 'sweep.csv'} and {', '.join(p.name for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
