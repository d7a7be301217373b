"""``python -m sn_trainer.report <sweep dir>``: sweep.csv, the study's plots and the best setting."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .sweep import ReportError, collect, plot_all, table, write_csv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sn_trainer.report", description=__doc__)
    parser.add_argument("sweep_dir", help="a multirun directory (holding one folder per job)")
    parser.add_argument("--out", help="where to write sweep.csv and the PNGs (default: the sweep directory)")
    args = parser.parse_args(argv)
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
    print(f"wrote {out / 'sweep.csv'} and {', '.join(p.name for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
