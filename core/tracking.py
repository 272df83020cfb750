"""MLflow tracking: one parent run per experiment run, one nested run per candidate.

Only the main process talks to MLflow: workers return :class:`TrainResult` records and
the tracker writes them, so a sqlite backend never sees concurrent writers.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from core import run_page
from core.records import Candidate, RewardProgram, StateProgram, TrainResult

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

#: the experiment tag MLflow 3 reads for an experiment's kind: model training, not GenAI. MLflow
#: 3.17's global GenAI / Model training switch still wins over it, so links carry
#: ``workflowType=machine_learning`` too (:data:`core.run_page.ML_VIEW`)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
#: a saved runs-table view (experiment tag ``mlflow.sharedViewState.<key>``), opened by the URL
#: ``#/experiments/<id>?viewStateShareKey=<key>`` and listed in the UI's view menu
VIEW_KEY = "llm4rl-candidates"
#: the metrics that view shows as columns, in order (MLflow shows no metric column by default)
VIEW_METRICS = ("fitness", "eval/return", "charts/episodic_return", "seconds", "frames")
#: candidate metrics that are one value per training, never a series: logged once, at step 0
SUMMARY_ONLY = ("reward/env_correlation",)
#: why a summary metric can be undefined (NaN), written as the run's ``note.<metric>`` tag
UNDEFINED = {"reward/env_correlation": "undefined: the env reward or the candidate's reward was constant "
                                       "over training (e.g. CartPole's 1 per step), so no correlation exists"}


@contextmanager
def _first_contact_lock(uri: str) -> Iterator[None]:
    """Serialise creating a sqlite store and its experiment across processes.

    Jobs that a parallel launcher (``hydra/launcher=ray`` or ``joblib``) starts at once
    would otherwise race to create the same tables and experiment.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    path = Path(uri[len("sqlite:///"):]).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=300):
        yield


def saved_view(created_ms: int = 0) -> str:
    """The runs-table view this project saves on its experiments (MLflow 3's saved-view envelope).

    It shows :data:`VIEW_METRICS` and the winner tag as columns and sorts by ``fitness``,
    best first. MLflow keeps no per-experiment default columns: a view is opened by its URL
    (:meth:`Tracker.ui_hint`) or chosen from the view menu above the runs table.
    """
    columns = [f"metrics.`{m}`" for m in VIEW_METRICS] + ["tags.`llm4rl.winner`", "tags.`candidate`"]
    state = {"orderByKey": "metrics.`fitness`", "orderByAsc": False, "selectedColumns": columns}
    return json.dumps({"name": "llm4rl: candidates by fitness", "createdAt": created_ms, "updatedAt": created_ms,
                       "state": json.dumps(state)})


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> ``{"a.b.c": value}`` (lists become JSON strings)."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = json.dumps(d) if isinstance(d, (list, tuple)) else d
    return out


class Tracker:
    """Writes runs, metrics and artifacts to MLflow."""

    def __init__(self, cfg: DictConfig | dict, experiment: str) -> None:
        import mlflow

        from core.quiet import quiet_third_party

        quiet_third_party()  # after the import: mlflow sets its own log level when imported
        self.mlflow = mlflow
        self.cfg = cfg
        mlflow.set_tracking_uri(cfg["uri"])
        with _first_contact_lock(cfg["uri"]):
            self.client = mlflow.MlflowClient()
            existing = self.client.get_experiment_by_name(experiment)
            if existing is None:
                location = cfg.get("artifact_location")
                uri = Path(location).resolve().as_uri() if location and "://" not in str(location) else location
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=uri)
            else:
                self.experiment_id = existing.experiment_id
            self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)
            self.client.set_experiment_tag(self.experiment_id, f"mlflow.sharedViewState.{VIEW_KEY}", saved_view())
        self.parent_id = ""
        self.parent_name = ""
        self.uri = cfg["uri"]

    # -- parent run -------------------------------------------------------------------
    @contextmanager
    def experiment_run(self, config: DictConfig, run_name: str, tags: dict[str, str]) -> Iterator[str]:
        """Start the parent run, log the resolved config; yields its run id."""
        run = self.mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name, tags=tags)
        self.parent_id, self.parent_name = run.info.run_id, run_name
        status = "FAILED"
        try:
            container = OmegaConf.to_container(config, resolve=True)
            params = {k: v for k, v in flatten(container).items() if not k.startswith("hydra.")}
            self._log_params(params)
            self.mlflow.log_text(OmegaConf.to_yaml(config, resolve=True), "config.yaml")
            yield self.parent_id
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self.mlflow.end_run(status=status)

    def _log_params(self, params: dict[str, Any], run_id: str | None = None) -> None:
        from mlflow.entities import Param

        # MLflow caps a param value at 6000 characters and a batch at 100 params
        items = [Param(k, str(v)[:5000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id or self.parent_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, run_id: str | None = None) -> None:
        self.log_points([(k, v, step or 0) for k, v in metrics.items()], run_id)

    def log_points(self, points: list[tuple[str, float, int]], run_id: str | None = None) -> None:
        """Many ``(key, value, step)`` metric points in few requests."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(step)) for k, v, step in points if _finite(v)]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(run_id or self.parent_id, metrics=metrics[i : i + 1000])

    def log_text(self, text: str, path: str, run_id: str | None = None) -> None:
        self.client.log_text(run_id or self.parent_id, text, path)

    def log_json(self, obj: Any, path: str, run_id: str | None = None) -> None:
        self.log_text(json.dumps(_jsonable(obj), indent=2), path, run_id)

    def log_figure(self, figure: Any, path: str, run_id: str | None = None) -> None:
        self.client.log_figure(run_id or self.parent_id, figure, path)

    def log_file(self, local: str | Path, folder: str | None = None, run_id: str | None = None) -> None:
        self.client.log_artifact(run_id or self.parent_id, str(local), folder)

    def set_tags(self, tags: dict[str, str], run_id: str | None = None) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id or self.parent_id, k, str(v))

    # -- candidates -------------------------------------------------------------------
    def log_candidate(self, candidate: Candidate, result: TrainResult, tags: dict[str, str],
                      ended: float | None = None) -> str:
        """A nested run with the candidate's parts, curve, metrics, fitness and description.

        The run is named after its parent (``eureka-s0/it1-c0``) and spans the training's own
        time: it ends at ``ended`` (epoch seconds when the result came back; now if None)
        and starts ``result.seconds`` before.

        Metrics, one name per meaning and one value per step: ``fitness`` and ``eval/return``
        at each evaluation (the last one is the final score), the trainer's series over
        frames (``charts/episodic_return`` is training episodes), reward ``components/*``,
        and per-training summaries (``frames``, ``seconds``, ``reward/env_correlation``,
        ``time/*``, ...) once at step 0; a summary that differs from its series' last point
        is ``summary/<name>``.
        """
        import time

        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        end_ms = int((ended if ended is not None else time.time()) * 1000)
        start_ms = end_ms - int(result.seconds * 1000)
        fitness_name = result.fitness.name if result.fitness is not None else "fitness"
        page = run_page.candidate_page(candidate=candidate, result=result, parent_name=self.parent_name,
                                       parent_id=self.parent_id, experiment_id=self.experiment_id,
                                       fitness_name=fitness_name)
        run = self.client.create_run(
            self.experiment_id,
            start_time=start_ms,
            run_name=run_page.candidate_run_name(self.parent_name, candidate.id),
            tags={MLFLOW_PARENT_RUN_ID: self.parent_id, "candidate": candidate.id, "ok": str(result.ok),
                  run_page.WINNER_TAG: "false", run_page.NOTE_TAG: page, **tags},
        )
        rid = run.info.run_id
        self._log_params({"iteration": candidate.iteration, "parts": ",".join(candidate.parts) or "baseline"}, rid)
        for role, part in candidate.parts.items():
            if isinstance(part, (RewardProgram, StateProgram)):
                self.log_text(part.source, f"{role}/{part.entry}.py", rid)
                if part.prompt:
                    self.log_text(part.prompt, f"{role}/prompt.txt", rid)
                if part.reply:
                    self.log_text(part.reply, f"{role}/reply.txt", rid)
            else:
                self.log_json(part, f"{role}.json", rid)
        points, summary = candidate_metrics(result)
        self.log_points(points, rid)
        self.log_metrics({k: v for k, v in summary.items() if _finite(v)}, step=0, run_id=rid)
        undefined = {k: v for k, v in summary.items() if not _finite(v) and isinstance(v, float) and v != v}
        if undefined:  # NaN says "undefined"; the note says why
            from mlflow.entities import Metric

            self.client.log_batch(rid, metrics=[Metric(k, float("nan"), end_ms, 0) for k in undefined])
            self.set_tags({f"note.{k}": UNDEFINED.get(k, "undefined") for k in undefined}, rid)
        for name, text in result.texts.items():
            self.log_text(text, f"texts/{name}", rid)
        if not result.ok:
            self.log_text(result.error, "error.txt", rid)
        if result.policy_path and Path(result.policy_path).exists():
            self.log_file(result.policy_path, "policy", rid)
            Path(result.policy_path).unlink(missing_ok=True)  # the artifact store keeps it now
        if self.cfg.get("log_plots", True) and result.curve:
            from core.plots import learning_curve

            fig = learning_curve({candidate.id: result.curve}, title=f"{candidate.id}: {fitness_name}")
            self.log_figure(fig, "learning_curve.png", rid)
        self.client.set_terminated(rid, status="FINISHED" if result.ok else "FAILED", end_time=end_ms)
        result.run_id = rid
        return rid

    def describe_run(self, *, task: str, fitness_name: str, history: list[Any], best: tuple[Candidate, TrainResult] | None,
                     llm: dict[str, float], seconds: float, final: list[float] | None = None) -> str:
        """Write the parent run's description (:func:`core.run_page.parent_page`) and mark the winner.

        The winning candidate's run gets the tag ``llm4rl.winner=true`` and a description
        that says it won and by which rule; the parent gets ``llm4rl.winner_run``. Returns
        the parent's description.
        """
        text = run_page.parent_page(name=self.parent_name, task=task, fitness_name=fitness_name,
                                    experiment_id=self.experiment_id, history=history, best=best, llm=llm,
                                    seconds=seconds, final=final)
        self.set_tags({run_page.NOTE_TAG: text})
        if best is not None and best[1].run_id:
            candidate, result = best
            page = run_page.candidate_page(candidate=candidate, result=result, parent_name=self.parent_name,
                                           parent_id=self.parent_id, experiment_id=self.experiment_id,
                                           fitness_name=fitness_name, winner=run_page.winner_rule(fitness_name))
            self.set_tags({run_page.WINNER_TAG: "true", run_page.NOTE_TAG: page}, result.run_id)
            self.set_tags({"llm4rl.winner_run": result.run_id})
        return text

    def ui_hint(self) -> str:
        """How to open these results."""
        uri = self.uri
        page = f"#/experiments/{self.experiment_id}/runs?viewStateShareKey={VIEW_KEY}&{run_page.ML_VIEW}"
        if uri.startswith("sqlite:///"):
            return f"mlflow ui --backend-store-uri {uri}, then open http://127.0.0.1:5000/{page}"
        return f"open {uri.rstrip('/')}/{page}"


def format_llm_call(record: Any) -> str:
    """One LLM call (a ``core.llm.CallRecord``) as Markdown: the messages, then each reply.

    Each text sits in a fence longer than any backtick run inside it
    (:func:`core.run_page.fence`), so a code block in a prompt or reply cannot swallow
    the headings after it, and every line keeps its break.
    """
    sections = [f"## {m['role']}\n\n{run_page.fence(str(m['content']), 'text')}" for m in record.messages]
    for i, reply in enumerate(record.replies):
        sections.append(f"## reply {i}{' (cached)' if reply.cached else ''}\n\n{run_page.fence(reply.text, 'text')}")
    return "\n\n".join(sections) + "\n"


def candidate_metrics(result: TrainResult) -> tuple[list[tuple[str, float, int]], dict[str, float]]:
    """A training's metric points ``(key, value, frames)`` and its summaries ``{key: value}``.

    See :meth:`Tracker.log_candidate` for the names. The headline metrics come first.
    """
    points: list[tuple[str, float, int]] = []
    for point in result.curve:
        points += [("fitness", point.fitness, point.frames), ("eval/return", point.episode_return, point.frames)]
    last_eval = result.curve[-1] if result.curve else None
    if result.fitness is not None and not (last_eval and last_eval.frames == result.frames
                                           and last_eval.fitness == result.fitness.value):
        points.append(("fitness", result.fitness.value, result.frames))  # a final score no evaluation logged
    series = {k: v for k, v in result.series.items() if k not in SUMMARY_ONLY}
    for prefix, table in (("components/", result.components), ("", series)):
        points += [(f"{prefix}{name}", value, frames) for name, values in table.items() for frames, value in values]
    last = {name: values[-1][1] for name, values in series.items() if values}
    summary: dict[str, float] = {"frames": float(result.frames), "seconds": float(result.seconds)}
    for key, value in result.metrics.items():
        if key in last and float(value) == last[key]:
            continue  # the series' last point already says it
        summary[f"summary/{key}" if key in last else key] = float(value)
    if result.fitness is not None:
        summary.update({f"fitness/{k}": float(v) for k, v in result.fitness.details.items()})
    return points, summary


def _finite(v: Any) -> bool:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return False
    return f == f and f not in (float("inf"), float("-inf"))


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)

