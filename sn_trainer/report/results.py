"""A benchmark's result files: ``<out>.json`` with every figure, ``<out>.md`` with its table."""
from __future__ import annotations

import json
from pathlib import Path


def write_result(out: str | Path, report: dict, markdown: str) -> None:
    """Write both files (making their folder), and print the Markdown for the console."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)
