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

from core.records import Candidate, RewardProgram, StateProgram, TrainResult

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


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
        self.parent_id = ""
        self.uri = cfg["uri"]

    # -- parent run -------------------------------------------------------------------
    @contextmanager
    def experiment_run(self, config: DictConfig, run_name: str, tags: dict[str, str]) -> Iterator[str]:
        """Start the parent run, log the resolved config; yields its run id."""
        run = self.mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name, tags=tags)
        self.parent_id = run.info.run_id
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
    def log_candidate(self, candidate: Candidate, result: TrainResult, tags: dict[str, str]) -> str:
        """A nested run with the candidate's parts, curve, metrics and fitness."""
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        run = self.client.create_run(
            self.experiment_id,
            run_name=candidate.id,
            tags={MLFLOW_PARENT_RUN_ID: self.parent_id, "candidate": candidate.id, "ok": str(result.ok), **tags},
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
        points: list[tuple[str, float, int]] = []  # (key, value, step), written in batches
        for point in result.curve:
            points += [("fitness", point.fitness, point.frames), ("charts/episodic_return", point.episode_return, point.frames)]
        for prefix, table in (("components/", result.components), ("", result.series)):
            points += [(f"{prefix}{name}", value, frames) for name, series in table.items() for frames, value in series]
        self.log_points(points, rid)
        for name, text in result.texts.items():
            self.log_text(text, f"texts/{name}", rid)
        final = dict(result.metrics)
        final["frames"] = result.frames
        final["seconds"] = result.seconds
        if result.fitness is not None:
            final["fitness"] = result.fitness.value
            final.update({f"fitness/{k}": v for k, v in result.fitness.details.items()})
        self.log_metrics(final, step=result.frames, run_id=rid)
        if not result.ok:
            self.log_text(result.error, "error.txt", rid)
        if result.policy_path and Path(result.policy_path).exists():
            self.log_file(result.policy_path, "policy", rid)
            Path(result.policy_path).unlink(missing_ok=True)  # the artifact store keeps it now
        if self.cfg.get("log_plots", True) and result.curve:
            from core.plots import learning_curve

            fig = learning_curve({candidate.id: result.curve}, title=f"{candidate.id}: {result.fitness.name if result.fitness else 'fitness'}")
            self.log_figure(fig, "learning_curve.png", rid)
        self.client.set_terminated(rid, status="FINISHED" if result.ok else "FAILED")
        result.run_id = rid
        return rid

    def ui_hint(self) -> str:
        """How to open these results."""
        uri = self.uri
        if uri.startswith("sqlite:///"):
            return f"mlflow ui --backend-store-uri {uri}"
        return f"open {uri} (experiment id {self.experiment_id})"


def format_llm_call(record: Any) -> str:
    """One LLM call (a ``core.llm.CallRecord``) as Markdown: the messages, then each reply."""
    lines = [f"## {m['role']}\n{m['content']}" for m in record.messages]
    for i, reply in enumerate(record.replies):
        lines.append(f"## reply {i}{' (cached)' if reply.cached else ''}\n{reply.text}")
    return "\n\n".join(lines)


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

