"""The results document of a study (``python -m core.study``): what the study can show, then scores per task.

Reads the study's runs back from MLflow (:func:`core.report.data.load_study`), and those
of earlier sessions archived beside the document (:mod:`core.report.archive`). One run
counts per planned cell (task, arm, seed): the latest whose code key (tag ``study.cell``:
config and code) is the planned cell's, finished or not, in the store or the archive;
runs of the same config at other code are set aside and counted. The archive is then
rewritten with the counted runs (and the archived runs of the spec's cells not planned
this time), and the document says which counted runs came from it. Each run is scored
by the metric its cell names (tag ``study.score``): ``fitness`` for an arm of one
training, ``final/fresh_mean`` for an arm that searches (its best candidate retrained on
fresh seeds).

The document opens with a summary: each task's calibration (can it show an effect at this
budget?), each target met, missed or not scored and why, and every arm's IQM of normalised
scores across tasks (:mod:`core.report.evidence`). Then the scores per task and arm (IQM
and mean with 95 % stratified-bootstrap CIs, :func:`core.report.study.analyze`), a search
arm's intent-to-treat IQM beside its conditional one, the LLM's contribution per cell
(:mod:`core.report.contribution`), costs, and the figures of
:func:`core.report.render.render_figures`. The document and its figures are logged to a
``report`` run of the study's experiment.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.report.contribution import contribution
from core.report.data import FAILED, OK, REPORT_TAG, TRAIN_RETURN, StudyRun, TaskResult, candidate_curve, load_study
from core.report.evidence import (
    BASELINES,
    Aggregate,
    Calibration,
    Comparison,
    Scored,
    TargetResult,
    aggregate,
    bounds,
    calibrate,
    check_target,
    compare_variants,
    controls_of,
    describe,
    random_arm,
    score,
    variant_pairs,
)
from core.report.render import aggregate_figure, curve_note, estimate, number, render_figures, table
from core.report.study import analyze

if TYPE_CHECKING:
    from core.study_records import Invocation, PlannedCell, StudySpec

#: per-arm totals of the cost table: (run metric, column title)
COSTS = (
    ("llm/calls", "LLM calls"),
    ("llm/cache_hits", "cache hits"),
    ("llm/prompt_tokens", "prompt tokens"),
    ("llm/completion_tokens", "completion tokens"),
    ("llm/latency_s", "LLM time (s)"),
)
AGGREGATE_FIGURE = "aggregate.png"


@dataclass
class Archived:
    """What the runs archived beside the report (:mod:`core.report.archive`) gave to the counted runs."""

    used: bool = False  # read (False: no archive read, or --no-archive)
    read: int = 0  # records in the file
    counted: set[str] = field(default_factory=set)  # run ids of counted runs that came from the archive
    replaced: int = 0  # archived runs of a counted cell that a later attempt in the store replaced
    set_aside: int = 0  # archived runs of a planned cell at another config or code: dropped from the file
    unplanned: list[StudyRun] = field(default_factory=list)  # archived runs of cells this invocation did not plan
    outside: int = 0  # archived runs of no cell of the spec (another task or arm): dropped from the file
    path: str = ""  # the file, relative to the report's folder
    written: int = 0  # runs the file holds now


@dataclass
class Counted:
    """The runs that count for a study: one per planned cell that ran, and what was set aside."""

    runs: list[StudyRun]  # the chosen run of each planned cell that has one
    chosen: dict[tuple[str, str, int], StudyRun]  # (task, arm, seed) -> the run that counts
    other_config: int  # runs of the study's experiment made with another config (other budgets, code edits kept)
    other_code: int = 0  # runs of a planned cell's config at other code (set aside)
    retried: int = 0  # earlier runs of a planned cell's key: the latest counts
    archive: Archived = field(default_factory=Archived)


def study_runs(
    planned: list[PlannedCell], uri: str, experiment: str, archived: list[StudyRun] | None = None
) -> Counted:
    """The study's runs of the planned cells, one per cell, scored by their cell's metric.

    ``archived``: runs of earlier sessions (:func:`core.report.archive.read_runs`), merged with
    the store's as if they were in it: per cell key the latest attempt counts, and a run in
    both (the same run id) is read from the store. Archived runs were scored when they were
    archived; their curves are the ones that scored.
    """
    wanted = {p.config_key: p for p in planned}
    names = {(p.cell.task, p.cell.arm, p.cell.seed) for p in planned}
    try:
        loaded = load_study(uri, experiment, "fitness")
    except Exception:  # no experiment yet: nothing ran
        loaded = []
    in_store = {r.run_id for r in loaded}
    archive = Archived(used=archived is not None, read=len(archived or []))
    from_archive = {r.run_id for r in archived or [] if r.run_id not in in_store}
    merged = loaded + [r for r in archived or [] if r.run_id in from_archive]
    latest: dict[tuple[str, str, int], StudyRun] = {}
    other = other_code = retried = 0
    for r in sorted(merged, key=lambda r: r.start_time):
        p = wanted.get(r.tags.get("study.config", ""))
        archived_run = r.run_id in from_archive
        if archived_run and (p is None or r.tags.get("study.cell") != p.key):
            if _cell_of(r) in names:  # a planned cell at another config or code: set aside, as the store's
                archive.set_aside += 1
            else:
                archive.unplanned.append(r)
            continue
        if p is None:
            other += r.tags.get("study") == experiment
            continue
        if r.tags.get("study.cell") != p.key:  # the same config at other code: not this study's result
            other_code += 1
            continue
        key = (p.cell.task, p.cell.arm, p.cell.seed)
        if key in latest:
            if latest[key].run_id in from_archive:
                archive.replaced += 1
            else:
                retried += 1
        latest[key] = r  # the latest attempt counts, whatever its status: not the best of attempts
    # in the planned order, wherever a run came from: a report from the archive alone is the store's
    order = {(p.cell.task, p.cell.arm, p.cell.seed): i for i, p in enumerate(planned)}
    latest = dict(sorted(latest.items(), key=lambda item: order[item[0]]))
    for (task, arm, _), r in latest.items():
        r.env, r.arm = task, arm
        if r.run_id in from_archive:
            archive.counted.add(r.run_id)
        else:
            _score(r, uri)
    return Counted(list(latest.values()), latest, other, other_code, retried, archive)


def _score(r: StudyRun, uri: str) -> None:
    """Score a run by its cell's metric; a search arm's curve is the retraining that scored."""
    metric = r.tags.get("study.score", "fitness")
    if r.status != OK:
        return
    value = r.metrics.get(metric)
    if value is None or not math.isfinite(value):
        r.status, r.fitness, r.note = FAILED, None, f"no '{metric}' (a fresh-seed retraining failed)"
        return
    r.fitness = float(value)
    if metric != "fitness" and r.tags.get("best_candidate"):  # the curve of the policy that scored
        fresh = f"{r.tags['best_candidate']}-seed{r.seed + 1}"
        r.curve = candidate_curve(uri, r.run_id, fresh) or r.curve
        r.train_curve = candidate_curve(uri, r.run_id, fresh, TRAIN_RETURN) or r.train_curve


@dataclass
class Findings:
    """What the study shows: per task its results and calibration, per cell its scores, the targets, the aggregate."""

    tasks: list[TaskResult]
    cells: dict[tuple[str, str], Scored]  # (task, arm) -> scores, for every planned cell
    calibrations: dict[str, Calibration]
    targets: list[TargetResult]
    aggregate: list[Aggregate]
    scale: dict[str, tuple[float, float]]  # task -> (random, human): the tasks whose scores normalise
    random: str | None  # the random-policy arm
    controls: dict[str, list[str]] = field(default_factory=dict)  # LLM arm -> its controls
    variants: list[Comparison] = field(default_factory=list)  # arms of one method with other settings, compared


def assess(spec: StudySpec, planned: list[PlannedCell], counted: Counted, reps: int = 2000) -> Findings:
    """Analyse the counted runs: the per-task statistics, then calibration, targets and the aggregate."""
    tasks = analyze(counted.runs, reps=reps, versus=list(BASELINES), order=list(spec.arms)) if counted.runs else []
    arm_order = {a: i for i, a in enumerate(spec.arms)}
    task_order = {t: i for i, t in enumerate(spec.tasks)}
    tasks.sort(key=lambda t: task_order.get(t.env, len(task_order)))
    for t in tasks:
        t.arms.sort(key=lambda a: arm_order.get(a.arm, len(arm_order)))
        for a in t.arms:  # missing: planned seeds without a run, whatever other arms ran
            planned_seeds = {p.cell.seed for p in planned if p.cell.task == t.env and p.cell.arm == a.arm}
            a.missing = sorted(s for s in planned_seeds if s not in a.scores and s not in a.failed)
    by_task = {t.env: {a.arm: a for a in t.arms} for t in tasks}
    random = random_arm(spec)
    task_names = [t for t in spec.tasks if any(p.cell.task == t for p in planned)]
    calibrations = {t: calibrate(t, spec.tasks[t], by_task.get(t, {}), random, reps) for t in task_names}
    cells = {}
    for task, arm in dict.fromkeys((p.cell.task, p.cell.arm) for p in planned):
        runs = [r for (t, a, _), r in counted.chosen.items() if t == task and a == arm]
        cells[(task, arm)] = score(
            task,
            arm,
            by_task.get(task, {}).get(arm),
            spec.arms[arm].search,
            contribution(spec.arms[arm], runs),
            calibrations[task].random,
            reps,
        )
    applies = set(cells)
    targets = []
    for target in spec.targets:
        scope = target.tasks or [t for t in task_names if (t, target.arm) in applies and (t, target.other) in applies]
        targets.append(check_target(target, cells, calibrations, list(scope), controls_of(spec, target.arm), reps))
    arm_names = [a for a in spec.arms if any(p.cell.arm == a for p in planned)]
    scale = bounds(cells, task_names, random)
    controls = {a: controls_of(spec, a) for a in arm_names if controls_of(spec, a)}
    variants = [
        compare_variants(a, b, cells, calibrations, task_names, reps)
        for a, b in variant_pairs(spec)
        if a in arm_names and b in arm_names
    ]
    return Findings(
        tasks, cells, calibrations, targets, aggregate(arm_names, cells, scale, reps), scale, random, controls, variants
    )


def write_results(
    spec: StudySpec,
    planned: list[PlannedCell],
    uri: str,
    out: Path,
    invocation: Invocation,
    reps: int = 2000,
    archived: list[StudyRun] | None = None,
) -> list[Path]:
    """Analyse the planned cells' runs, write ``out`` (Markdown) and its figures, log them to
    MLflow; returns the files.

    ``archived``: the runs read from the archive beside ``out`` (None: none read). The archive
    is then rewritten with the counted runs and the archived runs of the spec's cells this
    invocation did not plan (:func:`archive_contents`).
    """
    from core.report.archive import archive_path, write_runs

    counted = study_runs(planned, uri, spec.name, archived)
    findings = assess(spec, planned, counted, reps)
    kept = archive_contents(spec, counted)
    path = archive_path(out)
    counted.archive.path, counted.archive.written = f"{path.parent.name}/{path.name}", len(kept)
    figures_dir = out.with_suffix("")
    figures_dir.mkdir(parents=True, exist_ok=True)
    figures = render_figures(findings.tasks, figures_dir, kinds=("final", "curves"))
    links = {env: [f"{figures_dir.name}/{name}" for name in names] for env, names in figures.items()}
    files = [figures_dir / name for names in figures.values() for name in names]
    fig = aggregate_figure(
        [(a.arm, a.iqm) for a in findings.aggregate],
        "normalised score: (x - random) / (human - random), IQM over (task, seed), 95% CI",
    )
    if fig is not None:
        import matplotlib.pyplot as plt

        fig.savefig(figures_dir / AGGREGATE_FIGURE, bbox_inches="tight")
        plt.close(fig)
        files.append(figures_dir / AGGREGATE_FIGURE)
        links["aggregate"] = [f"{figures_dir.name}/{AGGREGATE_FIGURE}"]
    text = render_results(spec, planned, counted, findings, invocation, links, reps)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    write_runs(path, spec.name, kept)
    log_results(uri, spec.name, out, files, findings)
    return [out, path] + files


def archive_contents(spec: StudySpec, counted: Counted) -> list[StudyRun]:
    """What the archive keeps, in the spec's order: the counted runs (failed and unfinished ones
    too, as the report lists them), and the archived runs of the spec's cells that this
    invocation did not plan (other tasks, arms or seeds: a study run task by task keeps each
    task's runs). Archived runs of a task or arm the spec no longer has are dropped (counted
    in ``counted.archive.outside``); so are those of planned cells that did not count."""
    pairs = {(t, a) for t in spec.tasks for a, arm in spec.arms.items() if arm.tasks is None or t in arm.tasks}
    others = [r for r in counted.archive.unplanned if _cell_of(r)[:2] in pairs]
    counted.archive.outside = len(counted.archive.unplanned) - len(others)
    tasks, arms = {t: i for i, t in enumerate(spec.tasks)}, {a: i for i, a in enumerate(spec.arms)}
    return sorted(
        list(counted.chosen.values()) + others,
        key=lambda r: (tasks.get(_cell_of(r)[0], len(tasks)), arms.get(_cell_of(r)[1], len(arms)), r.seed),
    )


def _cell_of(run: StudyRun) -> tuple[str, str, int]:
    """A study run's (task, arm, seed), as its tags name them."""
    return run.tags.get("study.task", run.env), run.tags.get("study.arm", run.arm), run.seed


def log_results(uri: str, experiment: str, out: Path, figures: list[Path], findings: Findings) -> str | None:
    """Log the document and its figures to a ``report`` run of the study's experiment (None: no experiment yet)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    run = client.create_run(exp.experiment_id, run_name="results", tags={REPORT_TAG: "true"})
    rid = run.info.run_id
    client.log_artifact(rid, str(out), "report")
    for path in figures:
        client.log_artifact(rid, str(path), f"report/{path.parent.name}")
    for (task, arm), cell in findings.cells.items():
        if cell.result is not None and np.isfinite(cell.result.iqm.value):
            client.log_metric(rid, _metric_key(f"iqm/{task}/{arm}"), cell.result.iqm.value)
    for a in findings.aggregate:
        if np.isfinite(a.iqm.value):
            client.log_metric(rid, _metric_key(f"aggregate/{a.arm}"), a.iqm.value)
    client.set_terminated(rid)
    return rid


def _metric_key(key: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in key)


# -- what a run cost -------------------------------------------------------------------------


def search_frames(run: StudyRun) -> float:
    """Frames the run's search trained (all its candidates); for an arm of one training, that training."""
    return run.metrics.get("frames", float("nan"))


def final_frames(run: StudyRun) -> float:
    """Frames of one final-policy training: a fresh-seed retraining, or the run's one training
    (NaN for a run without a final policy: it trained none)."""
    if run.status != OK:
        return float("nan")
    fresh = run.metrics.get("final/seeds", 0.0) - 1
    if run.tags.get("study.score") != "fitness" and fresh > 0 and "final/frames" in run.metrics:
        return run.metrics["final/frames"] / fresh
    return run.metrics.get("frames", float("nan"))


def _total(values: Any) -> float:
    return float(sum(v for v in values if v == v))


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return float(np.mean(finite)) if finite else float("nan")


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


def render_results(
    spec: StudySpec,
    planned: list[PlannedCell],
    counted: Counted,
    findings: Findings,
    invocation: Invocation,
    figures: dict[str, list[str]],
    reps: int,
) -> str:
    """The results document as Markdown: the summary first, then the scores, targets, costs and tasks."""
    by_task = {t.env: t for t in findings.tasks}
    task_names = [t for t in spec.tasks if any(p.cell.task == t for p in planned)]
    arm_names = [a for a in spec.arms if any(p.cell.arm == a for p in planned)]
    chosen = counted.chosen
    lines = [f"# {spec.title or spec.name}", ""]
    reduced = _reduced(spec, planned, invocation.overrides)
    if reduced:
        lines += [
            f"> **A reduced run of the study** ({reduced}): it checks the whole path, and its numbers are "
            "what this run measured, not the study's findings. The full study is the same command without "
            "the options that shrink it.",
            "",
        ]
    lines += _provenance(spec, planned, counted, invocation)
    lines += _summary(spec, findings, task_names, figures.get("aggregate", []), reps)
    lines += [
        "",
        "## Scores",
        "",
        "Each cell is the task's ground-truth fitness of the final policy: IQM over seeds with a 95 % "
        f"stratified-bootstrap CI ({reps} replications, `rliable`, Agarwal et al., NeurIPS 2021); one run has "
        "no interval (`n=1, no CI`). An arm that searches is scored on "
        f"its best candidate retrained on {spec.final_seeds} fresh seed(s) (`final/fresh_mean`), never on the "
        "training it was selected by; any other arm by the fitness of its one training. n/a: the arm does not "
        "apply to the task; `n=k/N`: only k of the N seeds have a score (`j failed`: j seeds ended without "
        "one, e.g. a search whose every candidate failed). The IQM is over the searches that succeeded; "
        "`ITT`: the intent-to-treat IQM, where each failed search scores the random arm's IQM on the task "
        "(what its user gets), the score the targets read. **inert**: an LLM arm whose LLM put nothing "
        "into any of its runs with a policy here.",
        "",
    ]
    rows = []
    for name in task_names:
        t = by_task.get(name)
        row = [f"{name} ({t.fitness_name if t else '?'})"]
        for arm in arm_names:
            cell = findings.cells.get((name, arm))
            row.append("n/a" if cell is None else _grid_cell(cell))
        rows.append(row)
    lines += table(["task (fitness)", *arm_names], rows)
    lines += [
        "",
        "## Targets",
        "",
        "A target is scored per task: `beats` holds where the 95 % CI of P(X > Y) lies above 0.5 and the "
        "exact one-sided Mann-Whitney test gives p < 0.025 (the bootstrap interval collapses to 1 [1, 1] on "
        "any complete separation, which chance gives 1 time in 20 with 3 runs against 3), `matches` "
        "where X's IQM is within the tolerance of Y's (both stated with their intervals). A search arm's "
        "scores are its intent-to-treat ones. A task scores no target where it cannot show an effect "
        "(calibration), where either arm has one run, or where the LLM arm is inert there. A target of an LLM "
        "arm is also judged against its controls (the arm declared its control, else the sparse and the "
        "designers' reward): it must beat each control other than the target's own other arm (the same two "
        "tests), unless the target is itself `beats` a control. Met: it holds on the share of its tasks "
        "the target asks; missed: it cannot, even if every task not scored held; else not scored.",
        "",
    ]
    if not spec.targets:
        lines.append("The spec sets none.")
    for target, result in zip(spec.targets, findings.targets):
        controls = findings.controls.get(target.arm)
        judged = f"; judged against its control(s) {', '.join(controls)}" if controls else ""
        lines.append(f"- {describe(target)}: **{result.verdict}** ({result.reason}){judged}")
        lines += [f"  - {v.text}" for v in result.tasks]
    if findings.variants:
        lines += [
            "",
            "## Variants of one method",
            "",
            "Arms that run the same plugins with other settings (see [The arms](#the-arms) for what differs), "
            "compared both ways on each task by the rules of `beats` (95 % CI of P(X > Y) above 0.5 and the "
            "rank test's p < 0.025, for X over Y or Y over X), on the tasks that can show an effect where both "
            "have two or more scores (a search arm's intent-to-treat ones); over those tasks, the mean P(X > Y) "
            "with a 95 % CI (each arm's runs resampled within each task): better where the interval lies above "
            "or below 0.5, else no difference shown.",
            "",
        ]
        for c in findings.variants:
            lines.append(f"- {c.line()}")
            lines += [f"  - {text}" for text in c.lines]
    lines += [
        "",
        "## What each arm cost",
        "",
        "Totals over the arm's counted runs (every task). LLM time: the summed request time of its LLM calls. "
        "Search frames: what the arm trained to choose its final candidate (all candidates; for an arm of one "
        "training, that training). Retraining frames: the fresh-seed trainings of a search arm's best candidate, "
        "each as long as any arm's one training on the task (the final-policy frames of the per-task tables).",
        "",
    ]
    rows = []
    for arm in arm_names:
        runs = [r for (t, a, s), r in chosen.items() if a == arm]
        row = [arm, str(len(runs))] + [number(sum(r.metrics.get(k, 0.0) for r in runs)) for k, _ in COSTS]
        row += [
            number(_total(map(cell_seconds, runs))),
            number(_total(map(search_frames, runs))),
            number(_total(r.metrics.get("final/frames", 0.0) for r in runs)),
        ]
        rows.append(row)
    lines += table(
        ["arm", "runs", *[title for _, title in COSTS], "wall time (s)", "search frames", "retraining frames"], rows
    )
    for name in task_names:
        lines += _task_section(name, by_task.get(name), findings, chosen, figures.get(name, []))
    lines += ["", "## The arms", ""]
    for arm in arm_names:
        a = spec.arms[arm]
        what = f"`+plugins=[{','.join(a.plugins)}]`" if a.plugins else "no plugin"
        what += f", `trainer={a.trainer}`" if a.trainer else ""
        overrides = f", `{' '.join(a.overrides)}`" if a.overrides else ""
        given = next(p.cell.extra for p in planned if p.cell.arm == arm)
        overrides += f", then from the command line `{' '.join(given)}`" if given else ""
        ignored = next(p.cell.ignored for p in planned if p.cell.arm == arm)
        overrides += f"; ignored here (its plugins do not include theirs): `{' '.join(ignored)}`" if ignored else ""
        where = ", ".join(a.tasks) if a.tasks is not None else "every task"
        control = f"; the control of {a.control_of}" if a.control_of else ""
        lines.append(
            f"- **{arm}** ({what}{overrides}; {'searches' if a.search else 'one training'}; {where}{control}): {a.note}"
        )
    lines += ["", "## The tasks", ""]
    for name in task_names:
        task = spec.tasks[name]
        first = next(p.cell for p in planned if p.cell.task == name)
        extra = f", `{' '.join(task.overrides)}`" if task.overrides else ""
        runs = [r for (t, _, _), r in chosen.items() if t == name]
        spent = _total(map(cell_seconds, runs))
        wall = f"; wall time {_duration(spent)} summed over its {len(runs)} run(s)" if runs else "; no run yet"
        lines.append(f"- **{name}**: `env={task.env}`{extra}; {first.frames:,} frames per training{wall}")
    problems = [r for r in chosen.values() if r.status != OK]
    if problems:
        lines += ["", "## Runs left out of the statistics", ""]
        lines += [f"- `{r.name}`: {r.status}, {r.note}" for r in sorted(problems, key=lambda r: r.name)]
    return "\n".join(lines) + "\n"


def _summary(spec: StudySpec, findings: Findings, task_names: list[str], figure: list[str], reps: int) -> list[str]:
    """The summary: calibration per task, each target's verdict and why, the aggregate over tasks."""
    lines = [
        "",
        "## Summary",
        "",
        "Calibration: can each task show an effect at this budget? Its calibration arm's "
        "IQM against the task's threshold, and the random policy's score.",
        "",
    ]
    lines += [f"- **{t}**: {findings.calibrations[t].line()}" for t in task_names]
    lines += ["", "Targets (details under [Targets](#targets)):", ""]
    lines += [
        f"- {describe(target)}: **{result.verdict}** ({result.reason})"
        for target, result in zip(spec.targets, findings.targets)
    ] or ["- the spec sets none"]
    if findings.variants:
        lines += ["", "Variants of one method (details under [Variants of one method](#variants-of-one-method)):", ""]
        lines += [f"- {c.line()}" for c in findings.variants]
    random = findings.random or "random"
    lines += [
        "",
        f"Across tasks: per arm, the IQM over (task, seed) of the normalised score (x - {random}) / "
        f"(human - {random}), with the task's {random} and human IQMs (0: the random policy, 1: the designers' "
        f"reward), and a 95 % stratified-bootstrap CI ({reps} replications, runs resampled within each task); "
        "over the tasks where both ran and differ"
        + (f" ({', '.join(findings.scale)})" if findings.scale else "")
        + ". A search arm's scores are its intent-to-treat ones. Arms over different tasks are not comparable.",
        "",
    ]
    if not findings.aggregate:
        lines.append(f"No task has both a {random} and a human score that differ: nothing to normalise.")
        return lines
    rows = [
        [
            a.arm,
            str(len(a.tasks)),
            str(a.runs),
            estimate(a.iqm, a.runs),
            ", ".join(a.tasks) + (f" (**inert** on {', '.join(a.inert)})" if a.inert else ""),
        ]
        for a in findings.aggregate
    ]
    lines += table(["arm", "tasks", "runs", "normalised IQM [95% CI]", "over"], rows)
    lines += ["", *[f"![aggregate]({f})" for f in figure]] if figure else []
    return lines


def _grid_cell(cell: Scored) -> str:
    """One cell of the scores table: the IQM, how many seeds, the intent-to-treat IQM, inert."""
    a = cell.result
    if a is None or not a.scores:
        text = "not run" if a is None or not a.failed else f"failed ({len(a.failed)})"
        if a is not None and cell.search and a.failed and not cell.no_itt:
            text += f"; ITT {number(cell.itt.value)}"
    else:
        expected = len(a.scores) + len(a.failed) + len(a.missing)
        failed = f", {len(a.failed)} failed" if a.failed else ""
        text = estimate(a.iqm, len(a.scores)) + ("" if a.complete else f" (n={len(a.scores)}/{expected}{failed})")
        if cell.search and a.failed:
            text += " (ITT: random not run)" if cell.no_itt else f"; ITT {estimate(cell.itt, len(cell.counted))}"
    return text + (" **inert**" if cell.contribution.inert else "")


def cell_seconds(run: StudyRun) -> float:
    """A cell's wall time: setup and recording included where the study measured it (``study/seconds``)."""
    return run.metrics.get("study/seconds", run.metrics.get("seconds", float("nan")))


def _provenance(spec: StudySpec, planned: list[PlannedCell], counted: Counted, invocation: Invocation) -> list[str]:
    runs = list(counted.chosen.values())
    seconds = sum(v for v in map(cell_seconds, runs) if v == v)
    commits = Counter(r.tags.get("study.commit", "unknown") for r in runs)
    machines = Counter(r.tags.get("study.machine", "unknown") for r in runs)
    loads = [float(r.tags["study.load"]) for r in runs if "study.load" in r.tags]
    load = (
        f"1-minute load average {min(loads):.1f} to {max(loads):.1f} (mean {np.mean(loads):.1f}) as the cells started"
        if loads
        else "load not recorded"
    )
    if invocation.report_only:
        # the time to read the store only: the bootstrap intervals after it take minutes more
        this = (
            "this document was rewritten from the finished cells (`--report-only`), "
            f"{_duration(invocation.seconds)} to read them"
        )
    else:
        this = (
            f"this invocation ran {invocation.ran} cell(s) and skipped {invocation.skipped} finished before, in "
            f"{_duration(invocation.seconds)}, load average {invocation.load_start:.1f} at its start and "
            f"{invocation.load_end:.1f} at its end"
        )
    lines = [
        f"- Command: `{invocation.command}`",
        (
            f"- Commit: the cells are keyed by the code of `{invocation.code_of}` (`--code-of`); this document was "
            f"written by the code of `{invocation.commit}`"
            if invocation.code_of
            else f"- Commit: `{invocation.commit}`"
        )
        + (
            ""
            if set(commits) <= {invocation.code_of or invocation.commit}
            else "; the counted runs ran at " + ", ".join(f"`{c}` ({n} run(s))" for c, n in commits.most_common())
        ),
        f"- Machine: {invocation.machine}; {load}"
        + (
            ""
            if set(machines) <= {invocation.machine}
            else "; the counted runs ran on " + "; ".join(f"{m} ({n} run(s))" for m, n in machines.most_common())
        ),
        f"- Study wall time: {_duration(seconds)} summed over the {len(runs)} counted runs (cells run one after "
        f"another, setup and recording included); {this}"
        + (f"; {len(invocation.crashed)} crashed: {', '.join(invocation.crashed)}" if invocation.crashed else ""),
        *_projection(spec, planned, counted),
        f"- Cells planned: {len(planned)}; with a run: {len(runs)} (the latest run of the cell's config and code)"
        + (f"; earlier runs of the same cells, not counted: {counted.retried}" if counted.retried else "")
        + (f"; runs of the same configs at other code, set aside: {counted.other_code}" if counted.other_code else "")
        + (
            f"; runs of other configs in the experiment, not counted: {counted.other_config}"
            if counted.other_config
            else ""
        ),
        _archive_line(counted),
    ]
    return lines


def _archive_line(counted: Counted) -> str:
    """Which counted runs came from the archive of earlier sessions, and at which commits they ran."""
    a = counted.archive
    link = f"[{a.path}]({a.path})"
    if not a.used:
        return f"- Archive: not read (`--no-archive`); {link} now holds this document's {a.written} counted run(s)"
    if not a.read:
        return f"- Archive: none beside this document before; {link} now holds its {a.written} counted run(s)"
    runs = [r for r in counted.chosen.values() if r.run_id in a.counted]
    commits = Counter(r.tags.get("study.commit", "unknown") for r in runs)
    line = (
        f"- Archive: {len(runs)} of the {len(counted.chosen)} counted runs read from {link} (runs of earlier "
        "sessions, kept beside this document)"
    )
    line += ", recorded at " + ", ".join(f"`{c}` ({n} run(s))" for c, n in commits.most_common()) if runs else ""
    line += f"; archived runs replaced by a later attempt in the store: {a.replaced}" if a.replaced else ""
    line += f"; archived runs of planned cells at other config or code, dropped: {a.set_aside}" if a.set_aside else ""
    line += f"; archived runs of no cell of the spec, dropped: {a.outside}" if a.outside else ""
    kept = a.written - len(counted.chosen)
    return (
        line
        + f"; it now holds {a.written} run(s)"
        + (f", {kept} of them of cells not planned in this invocation" if kept else "")
    )


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
    return [
        f"- Projected at the spec's frames: {_duration(total)} for the same {len(counted.chosen)} runs "
        f"({_duration(total / len(seeds))} per seed), cells one after another on this machine: a search arm's "
        "LLM time as measured plus the rest of its wall time times the frames ratio, a one-training arm's whole "
        "wall time times the ratio; with this run's arm settings (not the spec's where `--set` changed them)"
    ]


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def _task_section(
    name: str,
    t: TaskResult | None,
    findings: Findings,
    chosen: dict[tuple[str, str, int], StudyRun],
    figures: list[str],
) -> list[str]:
    """One task: its calibration, each arm's seeds, scores, LLM contribution, costs and status,
    P(X > baseline), failures, figures."""
    lines = ["", f"## {name}: {t.fitness_name if t else 'no finished run'}", "", findings.calibrations[name].line()]
    if t is None:
        return lines
    rows = []
    for a in t.arms:
        runs = [r for (task, arm, _), r in chosen.items() if task == name and arm == a.arm]
        cell = findings.cells.get((name, a.arm))
        per_seed = ", ".join(f"{s}: {number(v)}" for s, v in a.scores.items()) or "—"
        rows.append(
            [
                a.arm,
                f"{len(a.scores)}/{len(a.scores) + len(a.failed) + len(a.missing)}",
                estimate(a.iqm, len(a.scores)),
                _itt(cell),
                estimate(a.mean, len(a.scores)),
                per_seed,
                cell.contribution.text() if cell else "-",
                _candidates(runs),
                number(_mean([search_frames(r) for r in runs])),
                number(_mean([final_frames(r) for r in runs])),
                number(_mean([r.metrics.get("llm/calls", 0.0) for r in runs])),
                number(_mean([r.metrics.get("llm/latency_s", 0.0) for r in runs])),
                number(_mean([cell_seconds(r) for r in runs])),
                a.status(),
            ]
        )
    lines += [
        "",
        "ITT: a search arm's intent-to-treat IQM, each failed search scored as the random policy (the "
        "count of failed searches in brackets). LLM contribution: for a search arm, its candidates that "
        "trained with a program an LLM wrote, of its candidates; for another LLM arm, what its plugin logs of "
        "its LLM's part; `-`: no LLM. Final-policy frames: one final-policy training, over the runs that "
        "trained one.",
        "",
    ]
    lines += table(
        [
            "arm",
            "n",
            "IQM [95% CI]",
            "ITT IQM (failed)",
            "mean [95% CI]",
            "per seed",
            "LLM contribution",
            "candidates (failed)",
            "search frames / run",
            "final-policy frames",
            "LLM calls / run",
            "LLM time / run (s)",
            "wall time / run (s)",
            "status",
        ],
        rows,
    )
    pairs = [
        (x, y, p)
        for x, y, p in t.improvement
        if np.isfinite(p.value) and not (x in BASELINES and BASELINES.index(x) < BASELINES.index(y))
    ]  # human > sparse, not both ways
    if pairs:
        lines += ["", "| X | Y | P(X > Y) [95% CI] (the runs with a score) |", "|---|---|---|"]
        lines += [f"| {x} | {y} | {p.fmt()} |" for x, y, p in pairs]
    failures = [
        f"- `{r.name}`: {int(r.metrics['study/failed_candidates'])} of {int(r.metrics.get('candidates', 0))} "
        f"candidate(s) failed; the first: {r.tags.get('study.first_error', 'no error recorded')}"
        for r in sorted(runs_of(chosen, name), key=lambda r: r.name)
        if r.metrics.get("study/failed_candidates")
    ]
    if failures:
        lines += ["", "Failed candidates (a search goes on with the others):", "", *failures]
    if figures:
        lines += [
            "",
            "Figures: each run's final score with the arm's IQM and CI; the final policy's training curve "
            "(for an arm that searches, its best candidate's first fresh-seed retraining), IQM over seeds."
            + (f" {curve_note(t)}" if t.curve_metric != "fitness" else ""),
            "",
        ]
    lines += [f"![{Path(f).stem}]({f})" for f in figures]
    return lines


def _itt(cell: Scored | None) -> str:
    """A search arm's intent-to-treat IQM and its failed searches; ``-`` for an arm that does not search."""
    if cell is None or not cell.search:
        return "-"
    if cell.no_itt:
        return f"random not run ({cell.failed})"
    return f"{estimate(cell.itt, len(cell.counted))} ({cell.failed})"


def runs_of(chosen: dict[tuple[str, str, int], StudyRun], task: str) -> list[StudyRun]:
    return [r for (t, _, _), r in chosen.items() if t == task]


def _candidates(runs: list[StudyRun]) -> str:
    """Candidates trained per run (mean) and the failed ones in total, e.g. ``2 (1)``."""
    total = _mean([r.metrics.get("candidates", float("nan")) for r in runs])
    failed = sum(int(r.metrics.get("study/failed_candidates", 0)) for r in runs)
    recorded = any("study/failed_candidates" in r.metrics for r in runs)
    return f"{number(total)} ({failed})" if recorded else number(total)


__all__ = [
    "Archived",
    "Counted",
    "Findings",
    "archive_contents",
    "assess",
    "log_results",
    "render_results",
    "study_runs",
    "write_results",
]
