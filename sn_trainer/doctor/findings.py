"""A finding of the doctor: what was checked, the figure that shows it, the fix (or none: ok), and
the time it cost; and how a list of them is ranked and printed."""
from __future__ import annotations

from dataclasses import dataclass

NOT_VISIBLE = "not visible"


@dataclass(frozen=True)
class Finding:
    """One line of a diagnosis.

    ``fix`` None: ok (or, with ``visible`` false, the fact could not be read). ``seconds``: what it
    cost the run, estimated from the measured stage times (0 where it costs no time, or is a risk).
    """

    check: str
    evidence: str
    fix: str | None = None
    seconds: float = 0.0
    visible: bool = True

    @property
    def ok(self) -> bool:
        return self.fix is None

    def line(self) -> str:
        if not self.visible:
            return f"{self.check}: {NOT_VISIBLE} ({self.evidence})"
        return f"{self.check}: {self.evidence} -> {self.fix or 'ok'}"


def not_visible(check: str, why: str) -> Finding:
    return Finding(check, why, visible=False)


def ranked(findings: list[Finding]) -> list[Finding]:
    """Problems first, the costliest first (stable: equal costs keep the order they were checked
    in); then the facts that could not be read; then what is ok."""
    problems = sorted((f for f in findings if not f.ok), key=lambda f: -f.seconds)
    return problems + [f for f in findings if f.ok and not f.visible] + [f for f in findings if f.ok and f.visible]


def problems(findings: list[Finding]) -> list[Finding]:
    return [f for f in ranked(findings) if not f.ok]


def render(findings: list[Finding], total_seconds: float | None = None) -> str:
    """Numbered problems, each with its cost (and its share of ``total_seconds``), then the rest."""
    lines = []
    for number, finding in enumerate(problems(findings), 1):
        cost = ""
        if finding.seconds > 0:
            share = f", {100 * finding.seconds / total_seconds:.0f}% of the run" if total_seconds else ""
            cost = f" [costs about {finding.seconds:.3g} s{share}]"
        lines.append(f"{number}. {finding.line()}{cost}")
    lines += [f"   {f.line()}" for f in ranked(findings) if f.ok]
    return "\n".join(lines)
