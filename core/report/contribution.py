"""What an arm's LLM put into its runs, read from the metrics the run and its plugins log.

A search arm's LLM writes the candidates' programs: its measure is ``llm_programs_trained``,
the candidates that trained with a program an LLM wrote, of ``candidates``. An arm of one
training is measured by what its plugin logs on that training (its best candidate's nested
run, :attr:`~core.report.data.StudyRun.training_metrics`) or on the run, per plugin in
:data:`MEASURES`; a plugin that logs nothing usable is "not measured". An LLM arm whose
measure is zero on every run that trained a policy is **inert**: it ran as the arm without
its LLM, so its scores are no evidence for the method. A run without a policy (a search
whose every candidate failed) is left out: it failed, and the report counts it so. Arms
without a plugin, and controls (an arm with ``control_of``: the method with the LLM's part
removed), are not LLM arms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.report.data import OK, StudyRun

if TYPE_CHECKING:
    from core.study_records import ArmSpec


@dataclass(frozen=True)
class Measure:
    """One plugin's measure of what its LLM put into a run."""

    metric: str  # the metric; zero means the LLM put nothing in
    what: str  # the measure in words, as the report prints it
    on: str = "training"  # where it is logged: "training" (the best candidate's run) or "run" (the parent run)
    minus: tuple[str, ...] = ()  # metrics subtracted from it (labels that decide nothing)
    extra: tuple[tuple[str, str], ...] = ()  # (metric, words): shown beside it, not part of the measure


#: a search arm's measure (the loop's own count), unless its plugin has one in MEASURES
SEARCH = Measure("llm_programs_trained", "candidates trained with an LLM's program", on="run")
#: per plugin: the measure of its LLM's part
MEASURES = {
    "envgen": Measure(
        "envgen/generated_envs",
        "LLM-generated worlds in the last cycle",
        on="run",
        extra=(("envgen/original_share", "original world's share"),),
    ),
    "progress_reward": Measure(
        "llm/changed_share",
        "share of steps whose reward the LLM term changed",
        extra=(
            ("judge/llm_calls", "states the LLM scored"),
            ("judge/llm_term_std", "spread (std) of the LLM term"),
            ("judge/rank_correlation", "rank correlation with reference progress"),
            ("judge/sparse_fraction", "steps its weight went to exploration"),
        ),
    ),
    "rlaif_preference": Measure(
        "llm/changed_share",
        "share of steps whose reward the learned preference term changed",
        extra=(
            ("preference/labels", "LLM labels"),
            ("preference/label_margin", "labels' mean distance from a tie"),
            ("preference/rm_loss", "reward model's loss (ln 2 = 0.693: it learned nothing)"),
            ("preference/term_spread", "spread (std) of the preference term"),
            ("preference/heldout_agreement", "reward model's held-out agreement"),
            ("preference/truth_agreement", "agreement with the ground truth"),
        ),
    ),
    "ellm": Measure(
        "llm/changed_share",
        "share of steps whose reward an LLM-suggested goal changed",
        extra=(
            ("ellm/goal_reward", "reward paid for suggested goals"),
            ("ellm/goals_achieved_from_suggestions", "goals achieved that came from suggestions"),
        ),
    ),
    "saycan": Measure(
        "llm/changed_share",
        "share of steps whose action distribution the LLM prior changed",
        extra=(("saycan/covered", "share of action rows the prior covered"), ("saycan/queries", "queries")),
    ),
    "plan4mc": Measure(
        # not llm/changed_share: before this measure, plan4mc logged there the share of steps whose skill the
        # LLM wrote, which reads 1 for an LLM plan equal to the control's; such runs are "not measured"
        "plan4mc/changed_share",
        "share of steps whose skill differs from the rules' plan (the control's)",
        extra=(
            ("plan4mc/llm_written_share", "share of steps whose skill is a step the LLM wrote"),
            ("plan4mc/llm_steps", "plan steps the LLM wrote"),
            ("plan4mc/rule_steps", "plan steps from the rules"),
        ),
    ),
    "rlingua": Measure("rlingua/controller_ok", "LLM controller passed its probe"),
}


@dataclass
class Contribution:
    """The LLM's part in one cell (task, arm): the measure on each of its runs."""

    kind: str  # "llm" | "none" (not an LLM arm) | "unmeasured" (an LLM arm whose plugin logs nothing usable)
    measure: Measure | None = None
    runs: int = 0  # runs that trained a policy
    values: list[float] = field(default_factory=list)  # per such run that logged the measure
    totals: list[float] = field(default_factory=list)  # per run, the candidates (the search measure's "of")
    extras: dict[str, list[float]] = field(default_factory=dict)  # extra metric -> its values

    @property
    def inert(self) -> bool:
        """An LLM arm whose LLM put nothing into any run that trained a policy."""
        return self.kind == "llm" and bool(self.values) and all(v == 0 for v in self.values)

    def text(self) -> str:
        """The cell's contribution in words: ``-`` for an arm without an LLM."""
        from core.report.render import number

        if self.kind == "none":
            return "-"
        if self.kind == "llm" and self.runs == 0:
            return "no run with a policy"
        if self.kind == "unmeasured" or self.measure is None or not self.values:
            return "not measured"
        mean = sum(self.values) / len(self.values)
        of = f" of {number(sum(self.totals) / len(self.totals))}" if self.totals else ""
        head = f"{self.measure.what}: {number(mean)}{of} per run"
        if self.inert:
            return f"**inert** ({head}: 0 on all {len(self.values)} runs)"
        zero = sum(v == 0 for v in self.values)
        parts = [head + (f", 0 on {zero} of {len(self.values)} runs" if zero else "")]
        for metric, words in self.measure.extra:
            values = [v for v in self.extras.get(metric, []) if math.isfinite(v)]
            if values:
                parts.append(f"{words} {number(sum(values) / len(values))}")
        return "; ".join(parts)


def is_llm_arm(arm: ArmSpec) -> bool:
    """An arm whose result an LLM decides: it runs a plugin and is not a control."""
    return bool(arm.plugins) and not arm.control_of


def measure_of(arm: ArmSpec) -> Measure | None:
    """The measure of an LLM arm's LLM part: its plugin's, else the search measure for a search arm."""
    for name in arm.plugins:
        if name in MEASURES:
            return MEASURES[name]
    return SEARCH if arm.search else None


def contribution(arm: ArmSpec, runs: list[StudyRun]) -> Contribution:
    """The LLM's part in the runs of one cell that trained a policy."""
    if not is_llm_arm(arm):
        return Contribution("none")
    measure = measure_of(arm)
    if measure is None:
        return Contribution("unmeasured")
    result = Contribution("llm", measure)
    for r in runs:
        if r.status != OK:  # still going (nothing logged yet), or no policy: a failure, not an inert LLM
            continue
        result.runs += 1
        metrics = r.metrics if measure.on == "run" else r.training_metrics
        value = _final(metrics, measure.metric)
        if value is None or not math.isfinite(value):
            continue
        result.values.append(value - sum(_final(metrics, m) or 0.0 for m in measure.minus))
        if measure is SEARCH and "candidates" in r.metrics:
            result.totals.append(r.metrics["candidates"])
        for metric, _ in measure.extra:
            if (extra := _final(metrics, metric)) is not None:
                result.extras.setdefault(metric, []).append(extra)
    return result


def _final(metrics: dict[str, float], key: str) -> float | None:
    """A training's final value of ``key``: its summary where the series' last point differs
    (``summary/<key>``, :func:`core.tracking.candidate_metrics`), else the metric."""
    return metrics.get(f"summary/{key}", metrics.get(key))


__all__ = ["MEASURES", "SEARCH", "Contribution", "Measure", "contribution", "is_llm_arm", "measure_of"]
