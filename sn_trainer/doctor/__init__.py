"""The doctor: a slow run read the way the seeds' section 5 and checklist read one: the machine
first (``machine``), then where the step's time went (``run``), then the data against the disk
(``data``). ``python -m sn_trainer.doctor [RUN_DIR]``; ``diagnose(result)`` for a FitResult."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .findings import Finding, ranked, render
from .run import STAGES, Knee, RunFacts, busy_machine, run_findings

__all__ = ["Diagnosis", "Finding", "diagnose", "diagnose_facts"]


@dataclass
class Diagnosis:
    """A run's findings, the costliest first, and the condition its figures were taken in."""

    title: str
    condition: Finding  # other processes' CPU while it was measured
    findings: list[Finding]  # ranked
    facts: RunFacts

    @property
    def top(self) -> Finding:
        """The costliest of what the run's settings can change (the machine's condition is apart)."""
        return self.findings[0]

    def __str__(self) -> str:
        return self.report()

    def report(self) -> str:
        facts = self.facts
        lines = [self.title]
        seconds = facts.stage_seconds
        if seconds:
            per_step = ", ".join(f"{s} {1000 * seconds[s] / facts.steps:.3g}" for s in STAGES)
            lines.append(f"ms per step over {facts.steps} measured steps: {per_step} "
                         f"(step {1000 * facts.step_seconds:.3g} ms)")
        cost = f" [costs about {self.condition.seconds:.3g} s]" if self.condition.seconds and not self.condition.ok \
            else ""
        lines.append(f"0. {self.condition.line()}{cost}" if not self.condition.ok else f"   {self.condition.line()}")
        lines.append(render(self.findings, facts.get("train_seconds")))
        return "\n".join(lines)


def diagnose(result, tuned=None) -> Diagnosis:
    """``result`` (a FitResult) read against the seeds' tables.

    Args:
        tuned: the ``TuneResult`` of ``trainer.tune(...)`` for this model and batch, if made: its
            measured speeds are the knee the per-worker batch is read against, and its compiled
            and eager speeds the compile check's.
    Returns:
        The findings, the costliest first (``.top``; ``str()`` prints them).
    """
    from ..node.cpu import describe_machine

    summary = {**result.summary(), "machine": describe_machine()}
    facts = RunFacts(summary, cli=False, losses=[r["loss"] for r in result.history if r.get("loss") is not None])
    if tuned is not None:
        facts.knee = tuner_knee(tuned, summary)
        if tuned.compile_rates:
            summary["compile_rates"] = dict(tuned.compile_rates)
    return diagnose_facts(facts, "this fit")


def tuner_knee(tuned, summary: dict[str, Any]) -> Knee | None:
    """The tuner's fastest measured workers x threads, and what it measured at the run's own."""
    measured = [r for r in tuned.rows if r.get("measured")]
    if not measured:
        return None
    best = max(measured, key=lambda r: r["measured"])
    own = [r["measured"] for r in measured if (r["workers"], r["threads"]) == (summary["workers"], summary["threads"])]
    return Knee(best["per_worker_batch"], best["measured"], "the tuner's", own[0] if own else None)


def diagnose_facts(facts: RunFacts, name: str) -> Diagnosis:
    """The diagnosis of one run's facts (a summary.json's, or a FitResult's)."""
    if "skipped" in facts.summary:
        skipped = Finding("run", f"skipped before training: {facts.get('skipped')}")
        return Diagnosis(f"run {name}: nothing was measured", skipped, [skipped], facts)
    title = (f"run {name}: {facts.get('model') or 'a model'}, batch {facts.get('batch_size')} on "
             f"{facts.get('workers')} workers x {facts.get('threads')} threads "
             f"({facts.get('per_worker_batch')} per worker), {facts.get('samples_per_sec') or 0:.0f} samples/s")
    return Diagnosis(title, busy_machine(facts), ranked(run_findings(facts)), facts)
