"""Reading a study back from MLflow: one :class:`StudyRun` per ``python -m core`` run.

A study is an MLflow experiment. Its parent runs (tags ``plugins``, ``env``, ``seed``)
are the runs of the study; nested runs are candidates, and the nested run of the best
candidate (tag ``best_candidate`` on the parent) carries the learning curve. An *arm*
is what changed between runs apart from the seed: the plugin set, plus any config value
that differs between runs of the same task (``trainer.lr=0.001``), or the keys given
with ``--by``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.report.stats import Interval

PARENT_TAG = "mlflow.parentRunId"
REPORT_TAG = "llm4rl.report"  # marks the runs that hold reports (skipped when reading)

#: config keys that never define an arm: bookkeeping, where things run, the task itself
IGNORED_PREFIXES = (
    "seed",
    "run_name",
    "experiment",
    "cache_dir",
    "progress",
    "resume",
    "save_policy",
    "tracking.",
    "executor.",
    "env.",
    "trainer.threads",
    "trainer.device",
    "sandbox.",
)

OK, FAILED, UNFINISHED = "ok", "failed", "unfinished"

#: what the trainers log of their training episodes (mean return of the episodes that
#: ended): the curve the report falls back to when evaluations are too few to draw one
TRAIN_RETURN = "charts/episodic_return"


@dataclass
class StudyRun:
    """One run of a study as the report sees it."""

    run_id: str
    name: str
    env: str
    plugins: str  # comma-joined plugin names, "none" for the baseline
    seed: int
    status: str  # OK | FAILED | UNFINISHED
    fitness: float | None = None
    fitness_name: str = "fitness"
    metrics: dict[str, float] = field(default_factory=dict)  # final metrics of the parent
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)  # the parent run's tags (a study's arm and cell, ...)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (frames, fitness) of the best candidate
    train_curve: list[tuple[int, float]] = field(default_factory=list)  # (frames, TRAIN_RETURN) of the same training
    training_metrics: dict[str, float] = field(default_factory=dict)  # final metrics of the best candidate's training
    start_time: int = 0
    arm: str = ""
    note: str = ""  # why a run is not ok
    mlflow_status: str = (
        ""  # how the MLflow run ended (FINISHED, FAILED, KILLED, RUNNING): a study skips FINISHED cells
    )


def run_status(mlflow_status: str, fitness: float | None) -> str:
    """A run counts only if it finished and recorded a finite fitness.

    A run that is still going, or that an interrupt ended (``KILLED``: Ctrl-C, SIGTERM, the end
    of a session; ``core.interrupts``), is unfinished, not failed: it says nothing about the
    method, and a study runs its cell again.
    """
    if mlflow_status in ("RUNNING", "SCHEDULED", "KILLED"):
        return UNFINISHED
    if mlflow_status != "FINISHED" or fitness is None or fitness != fitness:
        return FAILED
    return OK


def load_study(uri: str, experiment: str, metric: str = "fitness", filter_string: str = "") -> list[StudyRun]:
    """The parent runs of ``experiment`` at tracking ``uri`` (with curves of their best candidates)."""
    import mlflow

    from core.errors import UserError

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise UserError(
            f"No MLflow experiment '{experiment}' at {uri}. Experiments there: {', '.join(names) or 'none'}."
        )
    runs = _search_all(client, exp.experiment_id, filter_string)
    children: dict[str, list[Any]] = {}
    for r in runs:
        parent = r.data.tags.get(PARENT_TAG)
        if parent:
            children.setdefault(parent, []).append(r)
    study = []
    for r in runs:
        tags = r.data.tags
        if tags.get(PARENT_TAG) or tags.get(REPORT_TAG) or "env" not in tags or "seed" not in tags:
            continue
        value = r.data.metrics.get(metric)
        status = run_status(r.info.status, value)
        run = StudyRun(
            run_id=r.info.run_id,
            name=r.info.run_name or r.info.run_id,
            env=tags["env"],
            plugins=tags.get("plugins", "none"),
            seed=int(tags["seed"]),
            status=status,
            fitness=value if status == OK else None,
            fitness_name=tags.get("fitness_name", metric),
            metrics=dict(r.data.metrics),
            params=dict(r.data.params),
            tags=dict(tags),
            start_time=int(r.info.start_time or 0),
            mlflow_status=r.info.status,
        )
        if status != OK:
            run.note = _failure_note(r, children.get(r.info.run_id, []), metric)
        child = _best_child(tags.get("best_candidate", ""), children.get(r.info.run_id, []), run.seed)
        if child is not None:
            run.curve = _history(client, child.info.run_id)
            run.train_curve = _history(client, child.info.run_id, TRAIN_RETURN)
            run.training_metrics = dict(child.data.metrics)
        study.append(run)
    return study


def _search_all(client: Any, experiment_id: str, filter_string: str) -> list[Any]:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=filter_string, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _failure_note(run: Any, children: list[Any], metric: str) -> str:
    if run.info.status in ("RUNNING", "SCHEDULED"):
        return "still running or interrupted without an end"
    if run.info.status != "FINISHED":
        return f"run {run.info.status.lower()}"
    failed = sum(c.data.tags.get("ok") == "False" for c in children)
    if children and failed == len(children):
        return f"all {failed} candidate(s) failed"
    return f"no '{metric}' recorded"


def candidate_curve(uri: str, parent_id: str, candidate: str, metric: str = "fitness") -> list[tuple[int, float]]:
    """The ``metric``-over-frames history of one candidate's nested run (by its id), [] if none."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    runs = client.search_runs(
        [client.get_run(parent_id).info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}' and tags.candidate = '{candidate}'",
    )
    points = (
        {int(m.step): float(m.value) for m in client.get_metric_history(runs[0].info.run_id, metric)} if runs else {}
    )
    return sorted(points.items())


def _best_child(best: str, children: list[Any], seed: int) -> Any:
    """The best candidate's nested run on the run's seed (else on any seed); a run of one
    candidate without a best (it failed) has that candidate's run; else None."""
    matches = [c for c in children if c.data.tags.get("candidate") == best]
    same_seed = [c for c in matches if c.data.tags.get("seed") == str(seed)]
    if same_seed or matches:
        return (same_seed or matches)[0]
    return children[0] if len(children) == 1 else None


def _history(client: Any, run_id: str, metric: str = "fitness") -> list[tuple[int, float]]:
    """The ``metric``-over-frames history of a nested run."""
    points: dict[int, float] = {}
    for m in client.get_metric_history(run_id, metric):
        points[int(m.step)] = float(m.value)  # a value logged twice at one step: the later
    return sorted(points.items())


# -- arms ---------------------------------------------------------------------------------


def plugins_label(plugins: str) -> str:
    return "baseline" if plugins in ("", "none") else plugins.replace(",", "+")


def varying_keys(runs: list[StudyRun]) -> list[str]:
    """Config keys whose value differs between runs that have them (seed and bookkeeping excluded)."""
    values: dict[str, set[str]] = {}
    for r in runs:
        for k, v in r.params.items():
            if not k.startswith(IGNORED_PREFIXES) and not k.startswith("plugins."):
                values.setdefault(k, set()).add(v)
            elif k.startswith("plugins."):
                # a plugin knob separates arms only among runs with the same plugin set
                values.setdefault(f"{r.plugins}|{k}", set()).add(v)
    keys = {k.split("|", 1)[-1] for k, vs in values.items() if len(vs) > 1}
    return sorted(keys)


def assign_arms(runs: list[StudyRun], by: list[str] | None = None) -> list[StudyRun]:
    """Name each run's arm: plugin set + varying keys (or exactly the ``by`` keys)."""
    for env in {r.env for r in runs}:
        group = [r for r in runs if r.env == env]
        keys = by if by else varying_keys(group)
        for r in group:
            parts = [] if by else [plugins_label(r.plugins)]
            for k in keys:
                if k == "plugins":
                    parts.append(plugins_label(r.plugins))
                elif k in r.params:
                    parts.append(f"{k}={r.params[k]}")
            r.arm = " ".join(parts) or "all"
    return runs


# -- the analysis' records: what core.report.study computes and the renderers read --------

#: per-run LLM/compute metrics summed per arm in the cost table: (metric, column title)
COST_METRICS = (
    ("llm/calls", "LLM calls"),
    ("llm/prompt_tokens", "prompt tokens"),
    ("llm/completion_tokens", "completion tokens"),
    ("llm/cache_hits", "cache hits"),
    ("llm/cost", "cost (USD)"),
    ("llm/latency_s", "LLM time (s)"),
    ("seconds", "wall time (s)"),
    ("frames", "frames"),
    ("candidates", "candidates"),
)


@dataclass
class ArmResult:
    """One arm on one task."""

    arm: str
    scores: dict[int, float]  # seed -> final fitness of the finished runs
    failed: dict[int, str]  # seed -> why (failed or unfinished runs)
    missing: list[int]  # seeds other arms of the task ran and this arm did not
    duplicates: int  # extra runs of an (arm, seed) that were set aside (latest kept)
    iqm: Interval
    mean: Interval
    cost: dict[str, float]  # COST_METRICS summed over all this arm's runs (failed ones too)
    curve: dict[str, list[float]] = field(default_factory=dict)  # frames, iqm, low, high, runs
    candidates: float = 1.0  # candidates per finished run (median): >1 means its score is a best of N

    @property
    def complete(self) -> bool:
        return not self.failed and not self.missing

    def status(self) -> str:
        """``complete`` or ``PARTIAL: <why>`` (as :attr:`complete` decides), then the repeated runs
        set aside: a seed run twice counts once (its latest run) and leaves the arm complete.
        The console and ``report.md`` both print this."""
        parts = []
        if self.failed:
            parts.append("failed seed " + ", ".join(f"{s} ({why})" for s, why in sorted(self.failed.items())))
        if self.missing:
            parts.append("missing seed " + ", ".join(map(str, self.missing)))
        head = "complete" if self.complete else "PARTIAL: " + "; ".join(parts)
        return head + (
            f"; {self.duplicates} repeated run(s) set aside (the latest of each seed counts)" if self.duplicates else ""
        )


@dataclass
class TaskResult:
    """Every arm of one task, and the pairwise probabilities of improvement."""

    env: str
    fitness_name: str
    seeds: list[int]
    arms: list[ArmResult]
    improvement: list[tuple[str, str, Interval]]  # (X, Y, P(X > Y))
    metric: str = "fitness"  # the parent-run metric compared
    curve_metric: str = "fitness"  # what the curves show: the evaluations, or TRAIN_RETURN when they are too few
    eval_points: int = 0  # evaluations per run behind the curves (the fewest over the task's finished runs)
