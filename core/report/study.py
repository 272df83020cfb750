"""``python -m core.report``: the comparison report of a study (an MLflow experiment).

For every task: each arm's final fitness over seeds (interquartile mean and mean with
95 % stratified-bootstrap intervals), the probability of improvement between arms,
sample-efficiency curves (IQM fitness over frames with bands), and the LLM cost per arm.
Runs that failed, never finished or are missing for a seed other arms have are listed
per arm and flagged; the statistics use the finished runs only and say how many. A seed
run more than once counts by its latest run, finished or not.

    python -m core -m '+plugins=[eureka],[]' env=cartpole seed=0,1   # the study
    python -m core.report                                          # -> reports/llm4rl/

Writes ``report.md``, ``report.html``, ``summary.json``, ``runs.csv`` and PNG figures,
and logs the folder to a ``report`` run of the same experiment (``--no-log`` skips it).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from core.report.data import (  # ArmResult, COST_METRICS, TaskResult: read here by callers
    COST_METRICS,
    OK,
    REPORT_TAG,
    TRAIN_RETURN,
    UNFINISHED,
    ArmResult,
    StudyRun,
    TaskResult,
    assign_arms,
    load_study,
)
from core.report.stats import curve_band, final_score_intervals, improvement

#: arms that are the comparison's reference, shown first in this order (a label's first word)
BASELINE_ARMS = ("baseline", "sparse", "human")
#: fewer evaluations than this per run and the curves fall back to training returns
MIN_EVAL_POINTS = 2


def arm_order(runs: list[StudyRun]) -> list[str]:
    """The arms of ``runs`` in report order: the reference arms first (:data:`BASELINE_ARMS`),
    then the rest in the order the study declared them, i.e. the order their first runs started
    (a Hydra sweep and ``python -m core.study`` launch arms in the order they were written)."""
    first: dict[str, int] = {}
    for r in sorted(runs, key=lambda r: r.start_time):
        first.setdefault(r.arm, len(first))

    def rank(arm: str) -> tuple[int, int]:
        head = arm.split(" ", 1)[0]
        return (BASELINE_ARMS.index(head) if head in BASELINE_ARMS else len(BASELINE_ARMS), first[arm])

    return sorted(first, key=rank)


def analyze(
    runs: list[StudyRun],
    reps: int = 2000,
    seed: int = 0,
    versus: list[str] | None = None,
    order: list[str] | None = None,
    metric: str = "fitness",
) -> list[TaskResult]:
    """Group runs by task and arm and compute every statistic of the report.

    ``versus``: compute P(X > Y) only for Y among these arms (default: every pair).
    ``order``: the arms' order (default :func:`arm_order`); pairs follow it, Y before X.
    ``metric``: the parent-run metric the scores are (for the best-of-N note).
    The curves are the best candidates' evaluations; where a run of the task has fewer
    than :data:`MIN_EVAL_POINTS`, every arm's curve is its training returns instead
    (:data:`~core.report.data.TRAIN_RETURN`), and the task says so.
    """
    tasks = []
    for env in sorted({r.env for r in runs}):
        group = [r for r in runs if r.env == env]
        seeds = sorted({r.seed for r in group})
        names = order or arm_order(group)
        present = {r.arm for r in group}
        names = [a for a in names if a in present] + sorted(present - set(names))
        finished = [r for r in group if r.status == OK]
        points = min((len(r.curve) for r in finished), default=0)
        use_train = points < MIN_EVAL_POINTS and any(len(r.train_curve) >= MIN_EVAL_POINTS for r in finished)
        arms = [_arm_result(arm, [r for r in group if r.arm == arm], seeds, reps, seed, use_train) for arm in names]
        pairs = []
        for j, b in enumerate(arms):  # Y: the earlier arm (the reference first); X: each other arm
            for i, a in enumerate(arms):
                if i != j and (versus is None or b.arm in versus):
                    pairs.append(
                        (a.arm, b.arm, improvement(list(a.scores.values()), list(b.scores.values()), reps, seed))
                    )
        fitness_names = {r.fitness_name for r in finished}
        tasks.append(
            TaskResult(
                env,
                ", ".join(sorted(fitness_names)) or "fitness",
                seeds,
                arms,
                pairs,
                metric=metric,
                curve_metric=TRAIN_RETURN if use_train else "fitness",
                eval_points=points,
            )
        )
    return tasks


def _arm_result(
    arm: str, runs: list[StudyRun], seeds: list[int], reps: int, seed: int, use_train: bool = False
) -> ArmResult:
    chosen: dict[int, StudyRun] = {}
    duplicates = 0
    # the latest attempt of a seed counts, whatever its status: a finished run does not beat a
    # failed one for having finished (that would be the best of attempts)
    for r in sorted(runs, key=lambda r: r.start_time):
        duplicates += r.seed in chosen
        chosen[r.seed] = r
    scores = {s: float(r.fitness) for s, r in sorted(chosen.items()) if r.status == OK and r.fitness is not None}
    # a run still going, or stopped without an end (a killed study), is a seed not run yet, not a failure
    failed = {s: (r.note or r.status) for s, r in sorted(chosen.items()) if s not in scores and r.status != UNFINISHED}
    iqm, mean = final_score_intervals(list(scores.values()), reps, seed)
    cost = {key: float(sum(r.metrics.get(key, 0.0) for r in runs)) for key, _ in COST_METRICS}
    missing = [s for s in seeds if s not in scores and s not in failed]
    result = ArmResult(arm, scores, failed, missing, duplicates, iqm, mean, cost)
    counted = [chosen[s] for s in scores]
    result.curve = _curve([r.train_curve if use_train else r.curve for r in counted], reps, seed)
    result.candidates = float(np.median([r.metrics.get("candidates", 1.0) for r in counted])) if counted else 1.0
    return result


def _curve(curves: list[list[tuple[int, float]]], reps: int, seed: int) -> dict[str, list[float]]:
    """IQM over frames across runs' curves, on the frames every curve covers."""
    curves = [c for c in curves if c]
    if not curves:
        return {}
    end = min(c[-1][0] for c in curves)
    grid = sorted({f for c in curves for f, _ in c if f <= end})
    matrix = np.array([np.interp(grid, [f for f, _ in c], [v for _, v in c]) for c in curves])
    mid, low, high = curve_band(matrix, reps=max(reps // 2, 200), seed=seed)
    return {
        "frames": [float(g) for g in grid],
        "iqm": mid.tolist(),
        "low": low.tolist(),
        "high": high.tolist(),
        "runs": [float(len(curves))],
    }


# -- output -------------------------------------------------------------------------------


def write_report(tasks: list[TaskResult], runs: list[StudyRun], out: Path, experiment: str, reps: int) -> list[Path]:
    """Markdown, HTML, JSON, CSV and PNG files of the report in ``out``; returns them."""
    from core.report.render import render_figures, render_html, render_markdown

    out.mkdir(parents=True, exist_ok=True)
    figures = render_figures(tasks, out)
    md = render_markdown(tasks, runs, experiment, reps, figures)
    files = [out / "report.md", out / "report.html", out / "summary.json", out / "runs.csv"]
    files[0].write_text(md)
    files[1].write_text(render_html(md, experiment))
    files[2].write_text(json.dumps([_jsonable(asdict(t)) for t in tasks], indent=2))
    with files[3].open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run_id", "name", "env", "arm", "plugins", "seed", "status", "fitness", "note"])
        for r in sorted(runs, key=lambda r: (r.env, r.arm, r.seed)):
            writer.writerow([r.run_id, r.name, r.env, r.arm, r.plugins, r.seed, r.status, r.fitness, r.note])
    return files + [out / name for names in figures.values() for name in names]


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def log_to_mlflow(uri: str, experiment: str, out: Path, tasks: list[TaskResult]) -> str:
    """Log the report folder (figures included) to a ``report`` run of the experiment."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"  # the analysis read its runs
    run = client.create_run(exp.experiment_id, run_name="report", tags={REPORT_TAG: "true"})
    rid = run.info.run_id
    client.log_artifacts(rid, str(out), "report")
    for t in tasks:
        for a in t.arms:
            if np.isfinite(a.iqm.value):
                key = "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in f"iqm/{t.env}/{a.arm}")
                client.log_metric(rid, key, a.iqm.value)
    client.set_terminated(rid)
    return rid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="llm4rl", help="MLflow experiment of the study (default: llm4rl)")
    parser.add_argument("--uri", default="sqlite:///mlflow.db", help="MLflow tracking URI (default: ./mlflow.db)")
    parser.add_argument("--out", default=None, help="report folder (default: reports/<experiment>)")
    parser.add_argument(
        "--by", nargs="*", default=None, help="config keys that define an arm (default: plugins + what varies)"
    )
    parser.add_argument("--metric", default="fitness", help="parent-run metric to compare (e.g. final/fitness_mean)")
    parser.add_argument(
        "--filter", default="", help="MLflow filter on the runs, e.g. \"attributes.run_name LIKE 'abl-%%'\""
    )
    parser.add_argument("--reps", type=int, default=2000, help="bootstrap replications")
    parser.add_argument("--no-log", action="store_true", help="do not log the report back to MLflow")
    args = parser.parse_args(argv)

    from rich.console import Console

    from core.errors import UserError
    from core.quiet import quiet_third_party

    quiet_third_party()
    console = Console()
    try:
        runs = assign_arms(load_study(args.uri, args.experiment, args.metric, args.filter), args.by)
    except UserError as err:
        console.print(f"[bold red]error:[/bold red] {err}")
        return 2
    if not runs:
        console.print(f"[bold red]error:[/bold red] experiment '{args.experiment}' has no runs of `python -m core`.")
        return 2
    tasks = analyze(runs, reps=args.reps, metric=args.metric)
    out = Path(args.out or f"reports/{args.experiment}")
    write_report(tasks, runs, out, args.experiment, args.reps)
    for t in tasks:
        for a in t.arms:
            console.print(f"{t.env:14} {a.arm:28} n={len(a.scores)}/{len(t.seeds)}  IQM {a.iqm.fmt()}  {a.status()}")
    if not args.no_log:
        rid = log_to_mlflow(args.uri, args.experiment, out, tasks)
        console.print(f"logged to MLflow run {rid}")
    from core.progress import next_steps

    console.print(f"report: {out / 'report.md'}")
    console.print(next_steps(args.uri, args.experiment)[1], markup=False, highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
