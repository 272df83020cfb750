"""The results document of a study (``python -m core.study``): scores per task and arm, costs, targets.

Reads the study's runs back from MLflow (:func:`core.report.data.load_study`) and keeps
those of the cells the command planned (tag ``study.config``: the same config; the
commits they ran at are listed). Each run is scored by the metric its cell names (tag
``study.score``): ``fitness`` for an arm of one training, ``final/fresh_mean`` for an arm
that searches (its best candidate retrained on fresh seeds). The statistics are those of
:func:`core.report.study.analyze` (IQM and mean with 95 % stratified-bootstrap CIs, P(X > Y)
against the baselines), the figures those of :func:`core.report.render.render_figures`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.report.data import FAILED, OK, TRAIN_RETURN, StudyRun, candidate_curve, load_study
from core.report.render import curve_note, number, render_figures, table
from core.report.study import TaskResult, analyze

if TYPE_CHECKING:
    from core.study import Invocation, PlannedCell, StudySpec, TargetSpec

BASELINES = ("sparse", "human")  # the arms every other arm is compared with, P(X > Y)
#: per-arm totals of the cost table: (run metric, column title)
COSTS = (
    ("llm/calls", "LLM calls"),
    ("llm/cache_hits", "cache hits"),
    ("llm/prompt_tokens", "prompt tokens"),
    ("llm/completion_tokens", "completion tokens"),
    ("llm/latency_s", "LLM time (s)"),
)


@dataclass
class Counted:
    """The runs that count for a study: the chosen run of each planned cell, and what was set aside."""

    runs: list[StudyRun]  # every run of a planned cell's config (analysis keeps the latest per seed)
    chosen: dict[tuple[str, str, int], StudyRun]  # (task, arm, seed) -> the run that counts
    other_config: int  # runs of the study's experiment made with another config (other budgets, code edits kept)


def study_runs(planned: list[PlannedCell], uri: str, experiment: str) -> Counted:
    """The study's runs of the planned cells, scored by their cell's metric."""
    wanted = {p.config_key: p for p in planned}
    try:
        loaded = load_study(uri, experiment, "fitness")
    except Exception:  # noqa: BLE001 - no experiment yet: nothing ran
        loaded = []
    runs, other = [], 0
    for r in loaded:
        p = wanted.get(r.tags.get("study.config", ""))
        if p is None:
            other += r.tags.get("study") == experiment
            continue
        r.env, r.arm = p.cell.task, p.cell.arm
        metric = r.tags.get("study.score", "fitness")
        if r.status == OK:
            value = r.metrics.get(metric)
            if value is None or not math.isfinite(value):
                r.status, r.fitness, r.note = FAILED, None, f"no '{metric}' (a fresh-seed retraining failed)"
            else:
                r.fitness = float(value)
            if metric != "fitness" and r.tags.get("best_candidate"):  # the curve of the policy that scored
                fresh = f"{r.tags['best_candidate']}-seed{r.seed + 1}"
                r.curve = candidate_curve(uri, r.run_id, fresh) or r.curve
                r.train_curve = candidate_curve(uri, r.run_id, fresh, TRAIN_RETURN) or r.train_curve
        runs.append(r)
    chosen: dict[tuple[str, str, int], StudyRun] = {}
    for r in sorted(runs, key=lambda r: (r.status == OK, r.start_time)):  # finished and latest win, as in analyze
        chosen[(r.env, r.arm, r.seed)] = r
    return Counted(runs, chosen, other)


def write_results(spec: StudySpec, planned: list[PlannedCell], uri: str, out: Path, invocation: Invocation,
                  reps: int = 2000) -> list[Path]:
    """Analyse the planned cells' runs and write ``out`` (Markdown) and its figures; returns the files."""
    counted = study_runs(planned, uri, spec.name)
    tasks = analyze(counted.runs, reps=reps, versus=list(BASELINES), order=list(spec.arms)) if counted.runs else []
    arm_order = {a: i for i, a in enumerate(spec.arms)}
    task_order = {t: i for i, t in enumerate(spec.tasks)}
    tasks.sort(key=lambda t: task_order.get(t.env, len(task_order)))
    for t in tasks:
        t.arms.sort(key=lambda a: arm_order.get(a.arm, len(arm_order)))
        for a in t.arms:  # missing: planned seeds without a run, whatever other arms ran
            planned_seeds = {p.cell.seed for p in planned if p.cell.task == t.env and p.cell.arm == a.arm}
            a.missing = sorted(s for s in planned_seeds if s not in a.scores and s not in a.failed)
    figures_dir = out.with_suffix("")
    figures_dir.mkdir(parents=True, exist_ok=True)
    figures = render_figures(tasks, figures_dir, kinds=("final", "curves"))
    links = {env: [f"{figures_dir.name}/{name}" for name in names] for env, names in figures.items()}
    text = render_results(spec, planned, counted, tasks, invocation, links, reps)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return [out] + [figures_dir / name for names in figures.values() for name in names]


# -- what a run cost -------------------------------------------------------------------------


def search_frames(run: StudyRun) -> float:
    """Frames the run's search trained (all its candidates); for an arm of one training, that training."""
    return run.metrics.get("frames", float("nan"))


def final_frames(run: StudyRun) -> float:
    """Frames of one final-policy training: a fresh-seed retraining, or the run's one training."""
    fresh = run.metrics.get("final/seeds", 0.0) - 1
    if run.tags.get("study.score") != "fitness" and fresh > 0 and "final/frames" in run.metrics:
        return run.metrics["final/frames"] / fresh
    return run.metrics.get("frames", float("nan"))


def _total(values: Any) -> float:
    return float(sum(v for v in values if v == v))


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return float(np.mean(finite)) if finite else float("nan")


# -- targets ---------------------------------------------------------------------------------


def check_target(target: TargetSpec, tasks: list[TaskResult]) -> tuple[str, list[str]]:
    """(verdict, one line per task) of a target on the study's IQMs: met, missed or not measured."""
    lines, held = [], []
    for t in tasks:
        if target.tasks is not None and t.env not in target.tasks:
            continue
        arms = {a.arm: a for a in t.arms}
        x, y = arms.get(target.arm), arms.get(target.other)
        if x is not None and x.failed and not x.scores and y is not None and y.scores:
            held.append(False)  # every seed of the arm ended without a policy: a failure, not a gap
            lines.append(f"{t.env}: {target.arm} failed all {len(x.failed)} of its seeds (no score) vs {target.other} "
                         f"{number(y.iqm.value)}: fails")
            continue
        if x is None or y is None or not (np.isfinite(x.iqm.value) and np.isfinite(y.iqm.value)):
            continue
        if target.relation == "beats":
            ok = x.iqm.value > y.iqm.value
        else:
            ok = x.iqm.value >= y.iqm.value - target.tolerance * abs(y.iqm.value)
        # a seed without a score is a run the user got no policy from: the IQM of the others cannot vouch for it
        seeds = len(x.scores) + len(x.failed)
        no_policy = f"; {target.arm} failed {len(x.failed)} of {seeds} seeds" if x.failed else ""
        ok = ok and not x.failed
        held.append(ok)
        overlap = " (CIs overlap)" if x.iqm.low <= y.iqm.high and y.iqm.low <= x.iqm.high else ""
        lines.append(f"{t.env}: {target.arm} {number(x.iqm.value)} vs {target.other} {number(y.iqm.value)}: "
                     f"{'holds' if ok else 'fails'}{overlap}{no_policy}")
    wanted = target.tasks or []
    unmeasured = [name for name in wanted if name not in {line.split(':')[0] for line in lines}]
    if unmeasured:
        lines.append(f"not measured in this study: {', '.join(unmeasured)}")
    if not held:
        return "not measured", lines
    share = sum(held) / len(held)
    if unmeasured and target.share >= 1.0:
        return ("missed" if share < 1.0 else "not measured on every task"), lines
    return ("met" if share >= target.share else "missed"), lines


def _describe_target(target: TargetSpec) -> str:
    where = f"on {', '.join(target.tasks)}" if target.tasks else "on the tasks both ran"
    if target.relation == "beats":
        how = f"**{target.arm}** beats **{target.other}** (higher IQM)"
    else:
        tol = f" within {target.tolerance:.0%} of |{target.other}|" if target.tolerance else ""
        how = f"**{target.arm}** reaches **{target.other}**'s IQM{tol}"
    share = "" if target.share >= 1.0 else f" on at least {target.share:.0%} of them"
    return f"{how} {where}{share}"


# -- the document ----------------------------------------------------------------------------


def _reduced(spec: StudySpec, planned: list[PlannedCell], overrides: tuple[str, ...] = ()) -> str:
    """Why the planned cells are less than the whole study ('' if they are all of it)."""
    cells = [p.cell for p in planned]
    parts = []
    tasks, arms, seeds = {c.task for c in cells}, {c.arm for c in cells}, {c.seed for c in cells}
    if tasks != set(spec.tasks):
        parts.append(f"{len(tasks)} of {len(spec.tasks)} tasks")
    if arms != set(spec.arms):
        parts.append(f"{len(arms)} of {len(spec.arms)} arms")
    if seeds != set(spec.seeds):
        parts.append(f"{len(seeds)} seed(s) instead of {len(spec.seeds)}")
    frames = {c.task: c.frames for c in cells}
    scale = [frames[t] / spec.tasks[t].frames for t in frames]
    if scale and abs(max(scale) - 1.0) > 1e-9:
        parts.append(f"frames scaled by {max(scale):.3g}")
    if overrides:
        parts.append(f"overrides `{' '.join(overrides)}`")
    return ", ".join(parts)


def render_results(spec: StudySpec, planned: list[PlannedCell], counted: Counted, tasks: list[TaskResult],
                   invocation: Invocation, figures: dict[str, list[str]], reps: int) -> str:
    """The results document as Markdown."""
    by_task = {t.env: t for t in tasks}
    task_names = [t for t in spec.tasks if any(p.cell.task == t for p in planned)]
    arm_names = [a for a in spec.arms if any(p.cell.arm == a for p in planned)]
    applies = {(p.cell.task, p.cell.arm) for p in planned}
    chosen = counted.chosen
    lines = [f"# {spec.title or spec.name}", ""]
    reduced = _reduced(spec, planned, invocation.overrides)
    if reduced:
        lines += [f"> **A reduced run of the study** ({reduced}): it checks the whole path, and its numbers are "
                  "what this run measured, not the study's findings. The full study is the same command without "
                  "the options that shrink it.", ""]
    lines += _provenance(spec, planned, counted, invocation)
    lines += ["", "## Scores", "",
              "Each cell is the task's ground-truth fitness of the final policy: IQM over seeds with a 95 % "
              f"stratified-bootstrap CI ({reps} replications, `rliable`, Agarwal et al., NeurIPS 2021). An arm that searches is scored on "
              f"its best candidate retrained on {spec.final_seeds} fresh seed(s) (`final/fresh_mean`), never on the "
              "training it was selected by; any other arm by the fitness of its one training. n/a: the arm does not "
              "apply to the task; `n=k/N`: only k of the N seeds finished (`j failed`: j seeds ended without a "
              "score, e.g. a search whose every candidate failed; the IQM is over the k that finished, and a target "
              "does not hold on a task where the arm failed a seed).", ""]
    rows = []
    for name in task_names:
        t = by_task.get(name)
        arms = {a.arm: a for a in t.arms} if t else {}
        row = [f"{name} ({t.fitness_name if t else '?'})"]
        for arm in arm_names:
            if (name, arm) not in applies:
                row.append("n/a")
            elif arm not in arms or not arms[arm].scores:
                row.append("failed" if arm in arms and arms[arm].failed else "not run")
            else:
                a = arms[arm]
                expected = len(a.scores) + len(a.failed) + len(a.missing)
                failed = f", {len(a.failed)} failed" if a.failed else ""
                row.append(a.iqm.fmt() + ("" if a.complete else f" (n={len(a.scores)}/{expected}{failed})"))
        rows.append(row)
    lines += table(["task (fitness)", *arm_names], rows)
    lines += ["", "## Targets", ""]
    if not spec.targets:
        lines.append("The spec sets none.")
    for target in spec.targets:
        verdict, detail = check_target(target, tasks)
        lines.append(f"- {_describe_target(target)}: **{verdict}**")
        lines += [f"  - {d}" for d in detail]
    lines += ["", "## What each arm cost", "",
              "Totals over the arm's counted runs (every task). LLM time: the summed request time of its LLM calls. "
              "Search frames: what the arm trained to choose its final candidate (all candidates; for an arm of one "
              "training, that training). Retraining frames: the fresh-seed trainings of a search arm's best candidate, "
              "each as long as any arm's one training on the task (the final-policy frames of the per-task tables).", ""]
    rows = []
    for arm in arm_names:
        runs = [r for (t, a, s), r in chosen.items() if a == arm]
        row = [arm, str(len(runs))] + [number(sum(r.metrics.get(k, 0.0) for r in runs)) for k, _ in COSTS]
        row += [number(_total(map(cell_seconds, runs))), number(_total(map(search_frames, runs))),
                number(_total(r.metrics.get("final/frames", 0.0) for r in runs))]
        rows.append(row)
    lines += table(["arm", "runs", *[title for _, title in COSTS], "wall time (s)", "search frames", "retraining frames"], rows)
    for name in task_names:
        lines += _task_section(name, by_task.get(name), chosen, figures.get(name, []))
    lines += ["", "## The arms", ""]
    for arm in arm_names:
        a = spec.arms[arm]
        what = f"`+plugins=[{','.join(a.plugins)}]`" if a.plugins else "no plugin"
        overrides = f", `{' '.join(a.overrides)}`" if a.overrides else ""
        given = next(p.cell.extra for p in planned if p.cell.arm == arm)
        overrides += f", then from the command line `{' '.join(given)}`" if given else ""
        ignored = next(p.cell.ignored for p in planned if p.cell.arm == arm)
        overrides += f"; ignored here (its plugins do not include theirs): `{' '.join(ignored)}`" if ignored else ""
        where = ", ".join(a.tasks) if a.tasks is not None else "every task"
        lines.append(f"- **{arm}** ({what}{overrides}; {'searches' if a.search else 'one training'}; {where}): {a.note}")
    lines += ["", "## The tasks", ""]
    for name in task_names:
        task = spec.tasks[name]
        cell = next(p.cell for p in planned if p.cell.task == name)
        extra = f", `{' '.join(task.overrides)}`" if task.overrides else ""
        lines.append(f"- **{name}**: `env={task.env}`{extra}; {cell.frames:,} frames per training")
    problems = [r for r in chosen.values() if r.status != OK]
    if problems:
        lines += ["", "## Runs left out of the statistics", ""]
        lines += [f"- `{r.name}`: {r.status}, {r.note}" for r in sorted(problems, key=lambda r: r.name)]
    return "\n".join(lines) + "\n"


def cell_seconds(run: StudyRun) -> float:
    """A cell's wall time: setup and recording included where the study measured it (``study/seconds``)."""
    return run.metrics.get("study/seconds", run.metrics.get("seconds", float("nan")))


def _provenance(spec: StudySpec, planned: list[PlannedCell], counted: Counted, invocation: Invocation) -> list[str]:
    runs = list(counted.chosen.values())
    seconds = sum(v for v in map(cell_seconds, runs) if v == v)
    commits = Counter(r.tags.get("study.commit", "unknown") for r in runs)
    machines = Counter(r.tags.get("study.machine", "unknown") for r in runs)
    loads = [float(r.tags["study.load"]) for r in runs if "study.load" in r.tags]
    load = (f"1-minute load average {min(loads):.1f} to {max(loads):.1f} (mean {np.mean(loads):.1f}) as the cells started"
            if loads else "load not recorded")
    if invocation.report_only:
        this = f"this document was rewritten from the finished cells (`--report-only`) in {_duration(invocation.seconds)}"
    else:
        this = (f"this invocation ran {invocation.ran} cell(s) and skipped {invocation.skipped} finished before, in "
                f"{_duration(invocation.seconds)}, load average {invocation.load_start:.1f} at its start and "
                f"{invocation.load_end:.1f} at its end")
    lines = [
        f"- Command: `{invocation.command}`",
        f"- Commit: `{invocation.commit}`" + (
            "" if set(commits) <= {invocation.commit} else
            "; the counted runs ran at " + ", ".join(f"`{c}` ({n} run(s))" for c, n in commits.most_common())),
        f"- Machine: {invocation.machine}; {load}" + (
            "" if set(machines) <= {invocation.machine} else
            "; the counted runs ran on " + "; ".join(f"{m} ({n} run(s))" for m, n in machines.most_common())),
        f"- Study wall time: {_duration(seconds)} summed over the {len(runs)} counted runs (cells run one after "
        f"another, setup and recording included); {this}" + (
            f"; {len(invocation.crashed)} crashed: {', '.join(invocation.crashed)}" if invocation.crashed else ""),
        *_projection(spec, planned, counted),
        f"- Cells planned: {len(planned)}; with a run: {len(runs)}" + (
            f"; runs of other configs in the experiment, not counted: {counted.other_config}" if counted.other_config else ""),
    ]
    return lines


def _projection(spec: StudySpec, planned: list[PlannedCell], counted: Counted) -> list[str]:
    """What the counted runs would take at the spec's frames, for a study run with its frames scaled down.

    A search arm's LLM calls fall between its trainings, so its LLM time is kept as measured
    and the rest of its wall time is multiplied by the frames ratio; a one-training arm's LLM
    calls (if any) overlap its training, so its whole wall time is. A first-order estimate:
    setup does not grow with frames.
    """
    cells = {(p.cell.task, p.cell.arm, p.cell.seed): p.cell for p in planned}
    total, seeds, scaled_down = 0.0, set(), False
    for key, run in counted.chosen.items():
        cell, seconds = cells.get(key), cell_seconds(run)
        if cell is None or seconds != seconds:
            continue
        ratio = spec.tasks[cell.task].frames / cell.frames
        scaled_down |= ratio > 1.0 + 1e-9
        llm = min(run.metrics.get("llm/latency_s", 0.0), seconds) if cell.search else 0.0
        total += llm + (seconds - llm) * ratio
        seeds.add(cell.seed)
    if not scaled_down:
        return []
    return [f"- Projected at the spec's frames: {_duration(total)} for the same {len(counted.chosen)} runs "
            f"({_duration(total / len(seeds))} per seed), cells one after another on this machine: a search arm's "
            "LLM time as measured plus the rest of its wall time times the frames ratio, a one-training arm's whole "
            "wall time times the ratio; with this run's arm settings (not the spec's where `--set` changed them)"]


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def _task_section(name: str, t: TaskResult | None, chosen: dict[tuple[str, str, int], StudyRun],
                  figures: list[str]) -> list[str]:
    """One task: each arm's seeds, costs and status, P(X > baseline), the failures, the figures."""
    lines = ["", f"## {name}: {t.fitness_name if t else 'no finished run'}", ""]
    if t is None:
        return lines
    rows = []
    for a in t.arms:
        runs = [r for (task, arm, _), r in chosen.items() if task == name and arm == a.arm]
        per_seed = ", ".join(f"{s}: {number(v)}" for s, v in a.scores.items()) or "—"
        rows.append([
            a.arm, f"{len(a.scores)}/{len(a.scores) + len(a.failed) + len(a.missing)}", a.iqm.fmt(), a.mean.fmt(), per_seed,
            _candidates(runs), number(_mean([search_frames(r) for r in runs])), number(_mean([final_frames(r) for r in runs])),
            number(_mean([r.metrics.get("llm/calls", 0.0) for r in runs])),
            number(_mean([r.metrics.get("llm/latency_s", 0.0) for r in runs])),
            number(_mean([cell_seconds(r) for r in runs])),
            "complete" if a.complete else a.status(),
        ])
    lines += table(["arm", "n", "IQM [95% CI]", "mean [95% CI]", "per seed", "candidates (failed)", "search frames / run",
                     "final-policy frames", "LLM calls / run", "LLM time / run (s)", "wall time / run (s)", "status"], rows)
    pairs = [(x, y, p) for x, y, p in t.improvement if np.isfinite(p.value)
             and not (x in BASELINES and BASELINES.index(x) < BASELINES.index(y))]  # human > sparse, not both ways
    if pairs:
        lines += ["", "| X | Y | P(X > Y) [95% CI] |", "|---|---|---|"]
        lines += [f"| {x} | {y} | {p.fmt()} |" for x, y, p in pairs]
    failures = [f"- `{r.name}`: {int(r.metrics['study/failed_candidates'])} of {int(r.metrics.get('candidates', 0))} "
                f"candidate(s) failed; the first: {r.tags.get('study.first_error', 'no error recorded')}"
                for r in sorted(runs_of(chosen, name), key=lambda r: r.name) if r.metrics.get("study/failed_candidates")]
    if failures:
        lines += ["", "Failed candidates (a search goes on with the others):", "", *failures]
    if figures:
        lines += ["", "Figures: each run's final score with the arm's IQM and CI; the final policy's training curve "
                  "(for an arm that searches, its best candidate's first fresh-seed retraining), IQM over seeds."
                  + (f" {curve_note(t)}" if t.curve_metric != "fitness" else ""), ""]
    lines += [f"![{Path(f).stem}]({f})" for f in figures]
    return lines


def runs_of(chosen: dict[tuple[str, str, int], StudyRun], task: str) -> list[StudyRun]:
    return [r for (t, _, _), r in chosen.items() if t == task]


def _candidates(runs: list[StudyRun]) -> str:
    """Candidates trained per run (mean) and the failed ones in total, e.g. ``2 (1)``."""
    total = _mean([r.metrics.get("candidates", float("nan")) for r in runs])
    failed = sum(int(r.metrics.get("study/failed_candidates", 0)) for r in runs)
    recorded = any("study/failed_candidates" in r.metrics for r in runs)
    return f"{number(total)} ({failed})" if recorded else number(total)


__all__ = ["BASELINES", "Counted", "check_target", "render_results", "study_runs", "write_results"]
