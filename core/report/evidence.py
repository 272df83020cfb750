"""What a study's scores can show: task calibration, intent-to-treat scores, targets judged with intervals.

- **Calibration.** A task can show an effect only if its calibration arm (the designers'
  reward, or a positive control) reaches the task's threshold at the study's budget (IQM
  over seeds), or, on a task with no score that means "solved" (Crafter), beats the arm the
  calibration names (the random policy) as a target's ``beats`` would. A task that misses
  it, has neither, or whose calibration arm has not run scores no target.
- **Intent to treat.** A search that found no policy (a failed run, or no final score)
  leaves its user the random policy: it scores the random arm's IQM on the task. The
  targets read a search arm's scores so; the conditional IQM (the searches that
  succeeded only) is shown beside it.
- **Targets.** ``beats`` holds where the lower bound of the 95 % CI of P(X > Y) is above
  0.5 (not where one IQM is higher) and the exact one-sided Mann-Whitney test gives p below
  0.025 (the bootstrap interval collapses to ``1 [1, 1]`` on any complete separation, even
  of 3 runs against 3, which chance gives 1 time in 20); ``matches`` holds where X's IQM is within the
  tolerance of Y's, its intervals stated. No target is scored from one run, on an inert
  arm (:mod:`core.report.contribution`), or on an uncalibrated task.
- **Across tasks.** Per arm, the IQM over (task, seed) of scores normalised per task,
  ``(x - random) / (human - random)`` with the random and the designers'-reward arms' IQMs,
  with a stratified-bootstrap CI; only over tasks where both ran and differ.
- **Variants.** Arms that run the same plugins with other settings (eureka's 2 x 4 with
  reflection and 1 x 8 without) are compared both ways on each task, by the rules of
  ``beats``, and over tasks by the interval of the mean P(X > Y).
- **Controls.** A target of an LLM arm is also judged against its controls (the arms whose
  ``control_of`` names it, else the sparse and the designers' reward): it must beat each
  control other than the target's own other arm, unless the target itself is ``beats``
  a control.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.report.contribution import Contribution, is_llm_arm
from core.report.render import number
from core.report.stats import (
    ALPHA_ONE_SIDED,
    Interval,
    average_improvement,
    final_score_intervals,
    improvement,
    normalised,
    rank_test_p,
    stratified_iqm,
)

if TYPE_CHECKING:
    from core.report.data import ArmResult
    from core.study_records import StudySpec, TargetSpec, TaskSpec

BASELINES = ("sparse", "human")  # the arms every other arm is compared with, P(X > Y)
HUMAN = "human"  # the designers' reward: 1 of the normalised scores
HOLDS, FAILS, UNSCORED = "holds", "fails", "not scored"


def random_arm(spec: StudySpec) -> str | None:
    """The study's random-policy arm (``trainer: random``): the 0 of normalised scores."""
    return next((name for name, arm in spec.arms.items() if arm.trainer == "random"), None)


def controls_of(spec: StudySpec, arm: str) -> list[str]:
    """An LLM arm's controls: the arms declared its control (``control_of``), else the baselines."""
    if not is_llm_arm(spec.arms[arm]):
        return []
    declared = [name for name, a in spec.arms.items() if a.control_of == arm]
    return declared or [b for b in BASELINES if b in spec.arms and b != arm]


# -- calibration ------------------------------------------------------------------------


@dataclass
class Calibration:
    """Whether one task can show an effect at the study's budget."""

    task: str
    arm: str  # the calibration arm
    threshold: float | None
    note: str  # where the threshold comes from
    value: float  # the calibration arm's IQM (NaN: it has not run)
    runs: int  # its runs with a score
    random: float  # the random arm's IQM on the task (NaN: it has not run)
    beats: str | None = None  # instead of a threshold: the arm the calibration arm must beat
    p: Interval | None = None  # beats: P(arm > beats) with its CI (None: fewer than 2 scores of either)
    rank_p: float = math.nan  # beats: the exact one-sided rank test's p

    @property
    def ok(self) -> bool:
        if self.beats:
            return self.p is not None and clearly_greater(self.p, self.rank_p)
        return self.threshold is not None and math.isfinite(self.value) and self.value >= self.threshold

    def reason(self) -> str:
        """Why the task cannot show an effect ('' where it can)."""
        if self.threshold is None and not self.beats:
            return "no calibration threshold"
        if not math.isfinite(self.value):
            return f"its calibration arm {self.arm} has not run"
        if self.ok:
            return ""
        if self.beats:
            if self.p is None:
                return f"{self.arm} or {self.beats} has fewer than 2 scores"
            return f"{self.arm} does not beat {self.beats}: P {self.p.fmt()}, rank p {number(self.rank_p)}"
        assert self.threshold is not None  # neither beats nor a threshold returned above
        return f"{self.arm} {number(self.value)} < {number(self.threshold)}"

    def line(self) -> str:
        """``calibration: shaped 0.88 ≥ 0.5 (success rate; ...) — random 0``, and the verdict where it fails."""
        note = f" ({self.note})" if self.note else ""
        if self.beats:
            if self.p is None:
                head = f"calibration: {self.arm} must beat {self.beats}{note}; too few runs (n={self.runs})"
            else:
                verdict = "beats" if self.ok else "does not beat"
                head = (
                    f"calibration: {self.arm} {number(self.value)} {verdict} {self.beats}, P(X > Y) {self.p.fmt()}, "
                    f"rank p {number(self.rank_p)}{note}"
                )
        elif self.threshold is None:
            head = f"calibration: {self.arm}, no threshold set"
        elif not math.isfinite(self.value):
            head = f"calibration: {self.arm} has not run (threshold {number(self.threshold)}{note})"
        else:
            sign = "≥" if self.ok else "<"
            n = f", n={self.runs}" if self.runs < 2 else ""
            head = f"calibration: {self.arm} {number(self.value)}{n} {sign} {number(self.threshold)}{note}"
        random = number(self.random) if math.isfinite(self.random) else "not run"
        tail = "" if self.ok else ": **cannot show an effect at this budget**"
        return f"{head} — random {random}{tail}"


def calibrate(
    name: str, task: TaskSpec, arms: dict[str, ArmResult], random: str | None, reps: int = 2000
) -> Calibration:
    """The calibration of task ``name`` from its arms' results."""
    spec = task.calibration
    cal = arms.get(spec.arm)
    rnd = arms.get(random) if random else None
    value = cal.iqm.value if cal is not None and cal.scores else float("nan")
    p, rank_p = None, math.nan
    other = arms.get(spec.beats) if spec.beats else None
    if cal is not None and other is not None and len(cal.scores) >= 2 and len(other.scores) >= 2:
        xs, ys = list(cal.scores.values()), list(other.scores.values())
        p, rank_p = improvement(xs, ys, reps), rank_test_p(xs, ys)
    return Calibration(
        name,
        spec.arm,
        spec.threshold,
        spec.note,
        value,
        len(cal.scores) if cal is not None else 0,
        rnd.iqm.value if rnd is not None and rnd.scores else float("nan"),
        spec.beats,
        p,
        rank_p,
    )


# -- the scores the targets read ---------------------------------------------------------------


@dataclass
class Scored:
    """One arm on one task as the targets read it."""

    task: str
    arm: str
    result: ArmResult | None  # None: no run of the cell
    search: bool
    contribution: Contribution
    counted: dict[int, float] = field(default_factory=dict)  # seed -> score; a failed search: random's IQM
    # the IQM of ``counted`` for a search arm (intent to treat), NaN for any other
    itt: Interval = field(default_factory=lambda: Interval(math.nan, math.nan, math.nan))
    no_itt: bool = False  # a search arm failed seeds and the random arm has not run: no score for them

    @property
    def failed(self) -> int:
        return len(self.result.failed) if self.result is not None else 0


def score(
    task: str,
    arm: str,
    result: ArmResult | None,
    search: bool,
    contribution: Contribution,
    random: float,
    reps: int = 2000,
) -> Scored:
    """The cell's scores: for a search arm, each failed search scores ``random`` (intent to treat)."""
    cell = Scored(task, arm, result, search, contribution)
    if result is None:
        return cell
    cell.counted = dict(result.scores)
    if search:
        if result.failed and not math.isfinite(random):
            cell.no_itt = True
        elif result.failed:
            cell.counted.update({s: random for s in result.failed})
        cell.itt, _ = final_score_intervals(list(cell.counted.values()), reps)
    return cell


# -- targets -----------------------------------------------------------------------------------


@dataclass
class TaskVerdict:
    """A target on one task."""

    task: str
    status: str  # HOLDS | FAILS | UNSCORED
    text: str  # the line the report prints
    reason: str = ""  # UNSCORED: why


@dataclass
class TargetResult:
    """A target over its tasks: met, missed or not scored, with the reason and one line per task."""

    verdict: str  # "met" | "missed" | "not scored"
    reason: str
    tasks: list[TaskVerdict]


def describe(target: TargetSpec) -> str:
    """The target in words."""
    where = f"on {', '.join(target.tasks)}" if target.tasks else "on the tasks both run"
    if target.relation == "beats":
        how = f"**{target.arm}** beats **{target.other}** (95 % CI of P(X > Y) above 0.5, rank test p < 0.025)"
    else:
        tol = f" within {target.tolerance:.0%} of |{target.other}|" if target.tolerance else ""
        how = f"**{target.arm}** reaches **{target.other}**'s IQM{tol}"
    share = "" if target.share >= 1.0 else f" on at least {target.share:.0%} of them"
    return f"{how} {where}{share}"


def check_target(
    target: TargetSpec,
    cells: dict[tuple[str, str], Scored],
    calibrations: dict[str, Calibration],
    scope: list[str],
    controls: list[str],
    reps: int = 2000,
) -> TargetResult:
    """The target on each task of ``scope`` and its verdict.

    ``cells``: (task, arm) -> the cell's scores, for the cells planned; ``controls``: the
    target arm's controls (:func:`controls_of`). Met: it holds on at least ``share`` of the
    scope; missed: it cannot, even if every task not scored held; else not scored.
    """
    verdicts = [_on_task(target, t, cells, calibrations.get(t), controls, reps) for t in scope]
    if not verdicts:
        return TargetResult("not scored", "no task of this study runs both arms", [])
    held = sum(v.status == HOLDS for v in verdicts)
    open_ = sum(v.status == UNSCORED for v in verdicts)
    need = "all" if target.share >= 1.0 else f"{target.share:.0%}"
    counts = (
        f"holds on {held} of {len(verdicts)} task(s)" + (f", {open_} not scored" if open_ else "") + f"; needs {need}"
    )
    if held > 0 and held / len(verdicts) >= target.share - 1e-9:
        return TargetResult("met", counts, verdicts)
    if (held + open_) / len(verdicts) < target.share - 1e-9:
        return TargetResult("missed", counts, verdicts)
    why = "; ".join(f"{v.task}: {v.reason}" for v in verdicts if v.status == UNSCORED)
    return TargetResult("not scored", f"{counts}: {why}", verdicts)


def _on_task(
    target: TargetSpec,
    task: str,
    cells: dict[tuple[str, str], Scored],
    cal: Calibration | None,
    controls: list[str],
    reps: int,
) -> TaskVerdict:
    x, y = cells.get((task, target.arm)), cells.get((task, target.other))

    def unscored(reason: str) -> TaskVerdict:
        return TaskVerdict(task, UNSCORED, f"{task}: not scored: {reason}", reason)

    if x is None or y is None:
        return unscored("not planned in this run of the study")
    if cal is not None and not cal.ok:
        return unscored(f"the task cannot show an effect at this budget ({cal.reason()})")
    if x.contribution.inert:
        return unscored(f"{x.arm} is inert here (its LLM put nothing into any run that trained a policy)")
    for c in (x, y):
        if c.no_itt:
            return unscored(
                f"{c.arm} failed {c.failed} search(es) and the random arm has not run (no intent-to-treat score)"
            )
        if not c.counted:
            return unscored(f"{c.arm} has no score")
        if len(c.counted) < 2:
            return unscored(f"{c.arm} has one run (n=1, no CI)")
    xs, ys = list(x.counted.values()), list(y.counted.values())
    p = improvement(xs, ys, reps)
    xi, _ = final_score_intervals(xs, reps)
    yi, _ = final_score_intervals(ys, reps)
    rank_p = rank_test_p(xs, ys)
    if target.relation == "beats":
        ok = clearly_greater(p, rank_p)
    else:
        ok = xi.value >= yi.value - target.tolerance * abs(yi.value)
    text = f"{task}: {x.arm} {xi.fmt()} vs {y.arm} {yi.fmt()}, P(X > Y) {p.fmt()}, rank test p {rank_p:.2g}"
    for c in (x, y):
        if c.search and c.failed:
            text += f"; {c.failed} failed search(es) of {c.arm} scored as the random policy"
    if x.result is not None and x.result.failed and not x.search:
        ok, text = False, text + f"; {x.arm} failed {x.failed} of {x.failed + len(x.result.scores)} runs"
    if not ok or (target.relation == "beats" and target.other in controls):
        mine = f"; {target.other} is its control" if ok and controls else ""
        return TaskVerdict(task, HOLDS if ok else FAILS, f"{text}{mine}: {'holds' if ok else 'fails'}")
    for name in controls:
        if name == target.other:
            continue
        control = cells.get((task, name))
        if control is None or len(control.counted) < 2 or control.no_itt:
            return unscored(f"holds against {target.other}, but its control {name} has no scores to judge it against")
        cs = list(control.counted.values())
        pc, pc_rank = improvement(xs, cs, reps), rank_test_p(xs, cs)
        beats = clearly_greater(pc, pc_rank)
        text += f"; against its control {name}: P(X > {name}) {pc.fmt()}, rank test p {pc_rank:.2g}" + (
            "" if beats else " (does not beat it)"
        )
        ok = ok and beats
    return TaskVerdict(task, HOLDS if ok else FAILS, f"{text}: {'holds' if ok else 'fails'}")


def clearly_greater(p: Interval, rank_p: float) -> bool:
    """X beats Y: the 95 % CI of P(X > Y) lies above 0.5 and the exact rank test agrees."""
    return p.low > 0.5 and rank_p < ALPHA_ONE_SIDED


# -- variants of one method --------------------------------------------------------------------


@dataclass
class Comparison:
    """Two arms of one method with other settings (eureka 2 x 4 with reflection against 1 x 8 without)."""

    arm: str
    other: str
    lines: list[str]  # one per task of either arm
    overall: Interval  # the mean over the tasks compared of P(arm > other)
    tasks: list[str]  # the tasks compared
    answer: str  # the overall answer in words

    def line(self) -> str:
        if not self.tasks:
            return f"**{self.arm}** against **{self.other}**: {self.answer}"
        where = f"over {len(self.tasks)} task(s) ({', '.join(self.tasks)})"
        return f"**{self.arm}** against **{self.other}**: mean P(X > Y) {where} {self.overall.fmt()}: {self.answer}"


def variant_pairs(spec: StudySpec) -> list[tuple[str, str]]:
    """The pairs of arms that run the same plugins with other overrides, in the spec's order."""
    names = [n for n, a in spec.arms.items() if a.plugins]
    return [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if sorted(spec.arms[a].plugins) == sorted(spec.arms[b].plugins)
    ]


def _answer(p: Interval, p_xy: float, p_yx: float, x: str, y: str) -> str:
    if clearly_greater(p, p_xy):
        return f"{x} better"
    if clearly_greater(Interval(1 - p.value, 1 - p.high, 1 - p.low), p_yx):
        return f"{y} better"
    return "no difference shown"


def compare_variants(
    arm: str,
    other: str,
    cells: dict[tuple[str, str], Scored],
    calibrations: dict[str, Calibration],
    tasks: list[str],
    reps: int = 2000,
) -> Comparison:
    """``arm`` against ``other`` on each task both ran, by the rules of ``beats`` in both directions.

    A task is compared where it can show an effect (calibration) and both arms have two or
    more scores (a search arm's intent-to-treat ones); the overall answer is read from the
    interval of the mean P(X > Y) over those tasks: above 0.5, below, or holding it.
    """
    lines, pairs, compared = [], [], []
    for task in tasks:
        x, y = cells.get((task, arm)), cells.get((task, other))
        if x is None or y is None:
            continue
        cal = calibrations.get(task)
        short = [c.arm for c in (x, y) if len(c.counted) < 2 or c.no_itt]
        if cal is not None and not cal.ok:
            lines.append(f"{task}: not compared: the task cannot show an effect at this budget ({cal.reason()})")
            continue
        if short:
            lines.append(f"{task}: not compared: {', '.join(short)} has fewer than 2 scores")
            continue
        xs, ys = list(x.counted.values()), list(y.counted.values())
        p, p_xy, p_yx = improvement(xs, ys, reps), rank_test_p(xs, ys), rank_test_p(ys, xs)
        xi, _ = final_score_intervals(xs, reps)
        yi, _ = final_score_intervals(ys, reps)
        inert = [c.arm for c in (x, y) if c.contribution.inert]
        lines.append(
            f"{task}: {arm} {xi.fmt()} vs {other} {yi.fmt()}, P(X > Y) {p.fmt()}, rank test p {p_xy:.2g} "
            f"(X > Y) and {p_yx:.2g} (Y > X)"
            + (f"; **inert** here: {', '.join(inert)}" if inert else "")
            + f": {_answer(p, p_xy, p_yx, arm, other)}"
        )
        pairs.append((xs, ys))
        compared.append(task)
    if not pairs:
        nan = Interval(math.nan, math.nan, math.nan)
        return Comparison(arm, other, lines, nan, [], "not compared: no task has two or more scores of both")
    overall = average_improvement(pairs, reps)
    if overall.low > 0.5:
        answer = f"{arm} better"
    elif overall.high < 0.5:
        answer = f"{other} better"
    else:
        answer = "no difference shown (the interval holds 0.5)"
    return Comparison(arm, other, lines, overall, compared, answer)


# -- across tasks ------------------------------------------------------------------------------


@dataclass
class Aggregate:
    """One arm across tasks: the IQM of its normalised scores."""

    arm: str
    tasks: list[str]  # the tasks it has scores on, of those that normalise
    runs: int
    iqm: Interval
    inert: list[str]  # of those tasks, where its LLM put nothing into any run


def bounds(
    cells: dict[tuple[str, str], Scored], tasks: list[str], random: str | None
) -> dict[str, tuple[float, float]]:
    """Task -> (random's IQM, human's IQM): the tasks whose scores normalise (both ran and differ)."""
    out = {}
    for t in tasks:
        r, h = cells.get((t, random or "")), cells.get((t, HUMAN))
        if r is None or h is None or r.result is None or h.result is None or not (r.result.scores and h.result.scores):
            continue
        low, high = r.result.iqm.value, h.result.iqm.value
        if math.isfinite(low) and math.isfinite(high) and low != high:
            out[t] = (low, high)
    return out


def aggregate(
    arms: list[str], cells: dict[tuple[str, str], Scored], scale: dict[str, tuple[float, float]], reps: int = 2000
) -> list[Aggregate]:
    """Per arm with scores on a task of ``scale``: the IQM of its normalised scores over (task, seed), stratified CI."""
    rows = []
    for arm in arms:
        per_task = {
            t: [normalised(v, *scale[t]) for v in c.counted.values()]
            for t in scale
            if (c := cells.get((t, arm))) is not None and c.counted and not c.no_itt
        }
        if not per_task:
            continue
        inert = [t for t in per_task if cells[(t, arm)].contribution.inert]
        rows.append(
            Aggregate(
                arm,
                list(per_task),
                sum(map(len, per_task.values())),
                stratified_iqm(list(per_task.values()), reps),
                inert,
            )
        )
    return rows


__all__ = [
    "BASELINES",
    "Aggregate",
    "Calibration",
    "Comparison",
    "Scored",
    "TargetResult",
    "TaskVerdict",
    "aggregate",
    "bounds",
    "calibrate",
    "check_target",
    "compare_variants",
    "controls_of",
    "describe",
    "random_arm",
    "score",
    "variant_pairs",
]
