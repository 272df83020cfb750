"""MLflow tracking: one parent run per experiment run, one nested run per candidate.

Only the main process talks to MLflow: workers return :class:`TrainResult` records and
the tracker writes them, so a sqlite backend never sees concurrent writers.

Names MLflow refuses (a reward component called ``angle (rad)`` or ``upright/``, a name
longer than MLflow's limit) are logged under valid names (:func:`safe_key`); the run's
``metric_names.json`` maps each such name back to the original. Recording a candidate
never raises: a failure while writing it ends the candidate's run FAILED with the reason
and makes the candidate's result a failure of kind ``tracking`` (:meth:`Tracker.log_candidate`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import posixpath
import re
import traceback
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlparse

from omegaconf import DictConfig, OmegaConf

from core import run_page
from core.records import Candidate, RewardProgram, StateProgram, TrainResult

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

log = logging.getLogger("core.tracking")

#: the experiment tag MLflow 3 reads for an experiment's kind: model training, not GenAI. MLflow
#: 3.17's global GenAI / Model training switch still wins over it, so links carry
#: ``workflowType=machine_learning`` too (:data:`core.run_page.ML_VIEW`)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
#: the run tag that tells the runs apart: ``parent`` (one per command), ``candidate`` (one per
#: training); a report's run has none (it carries ``llm4rl.report``), so neither view lists it
KIND_TAG = "llm4rl.kind"
#: the parent-run tag holding the run's result in one line (:func:`core.run_page.outcome_line`)
RESULT_TAG = "llm4rl.result"
#: a saved runs-table view (experiment tag ``mlflow.sharedViewState.<key>``), opened by the URL
#: ``#/experiments/<id>?viewStateShareKey=<key>`` and listed in the UI's view menu
VIEW_KEY = "llm4rl-candidates"
#: the saved view of the parent runs alone (one row per command, its result in a column)
RUNS_VIEW_KEY = "llm4rl-runs"
#: the metrics the candidates view shows as columns, in order (MLflow shows no metric column by default)
VIEW_METRICS = ("fitness", "charts/episodic_return", "seconds")
#: the filter of each view (MLflow's search syntax; documented in docs/mlflow.md)
CANDIDATES_FILTER = f"tags.`{KIND_TAG}` = 'candidate'"
RUNS_FILTER = f"tags.`{KIND_TAG}` = 'parent'"
#: how many decimals a metric is logged with, by name (MLflow's table shows every digit it is given)
DECIMALS = {
    "seconds": 1,
    "charts/episodic_return": 2,
    "summary/charts/episodic_return": 2,
    "eval/return": 2,
    "charts/fps": 0,
}
#: candidate metrics that are one value per training, never a series: logged once, at step 0
SUMMARY_ONLY = ("reward/env_correlation",)
#: why a summary metric can be undefined (NaN), written as the run's ``note.<metric>`` tag
UNDEFINED = {
    "reward/env_correlation": "undefined: the env reward or the candidate's reward was constant "
    "over training (e.g. CartPole's 1 per step), so no correlation exists"
}

#: the characters MLflow allows in metric, param and tag names (its
#: ``mlflow.utils.validation.validate_param_and_metric_name`` outside Windows), matched to the
#: end: MLflow's own pattern ends in ``$``, which lets one trailing newline through
_KEY = re.compile(r"[/\w.\- :]*")
_NOT_KEY = re.compile(r"[^/\w.\- :]")
#: MLflow's length limit on a metric, param or tag name (``mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH``)
MAX_KEY_CHARS = 250
#: the artifact of a run whose metric names were changed for MLflow: ``{logged name: original}``
NAMES_ARTIFACT = "metric_names.json"
#: the tag that says how many metric names of a run were changed (the originals in :data:`NAMES_ARTIFACT`)
RENAMED_TAG = "llm4rl.renamed_metrics"


def valid_key(name: Any) -> bool:
    """Whether MLflow takes ``name`` as a metric, param or tag name as it is.

    Its rule, mirrored: a non-empty string of at most :data:`MAX_KEY_CHARS` alphanumerics,
    ``_ - . space / :``, that stays the same as a path (no empty, ``.`` or ``..`` part, no
    leading or trailing ``/``). MLflow's own check runs too where it can be imported, so a
    stricter MLflow is obeyed.
    """
    return isinstance(name, str) and _valid(name)


@functools.lru_cache(maxsize=4096)
def _valid(name: str) -> bool:
    if not name or len(name) > MAX_KEY_CHARS or _KEY.fullmatch(name) is None:
        return False
    norm = posixpath.normpath(name)
    if norm != name or norm.startswith(("..", "/")):
        return False
    try:
        from mlflow.utils.validation import _validate_metric_name
    except ImportError:  # an MLflow without it: the mirrored rule alone
        return True
    try:
        _validate_metric_name(name)
    except Exception:  # MlflowException, or whatever a later MLflow raises
        return False
    return True


def safe_key(name: Any) -> str:
    """``name`` itself where MLflow takes it (:func:`valid_key`), else a valid name close to it.

    Each refused character becomes ``_``, empty path parts are dropped and ``.`` / ``..``
    parts become underscores (``components/upright/`` -> ``components/upright``,
    ``components/angle (rad)`` -> ``components/angle _rad_``); a name still too long is cut
    and ends in a digest of the original, so two long names stay apart.
    """
    text = name if isinstance(name, str) else str(name)
    if valid_key(text):
        return text
    digest = _digest(text)
    parts = [p if p not in (".", "..") else "_" * len(p) for p in _NOT_KEY.sub("_", text).split("/") if p]
    out = "/".join(parts) or "_"
    if out.startswith(".."):
        out = "_" + out[1:]
    if len(out) > MAX_KEY_CHARS:
        out = out[: MAX_KEY_CHARS - 11].rstrip("/") + "-" + digest
    return out if valid_key(out) else f"metric-{digest}"


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]


def tracking_failure(result: TrainResult, exc: BaseException) -> None:
    """Make ``result`` the failure of a candidate that could not be recorded (in place).

    A result that was ok fails as ``tracking``; one that had failed already keeps its own
    kind, and the reason is added to its error.
    """
    reason = f"Recording the candidate in MLflow failed: {type(exc).__name__}: {str(exc)[:1500]}"
    if result.ok or not result.error_kind:
        result.error_kind = "tracking"
    result.error = f"{result.error}\n\n{reason}" if result.error else reason
    result.ok = False


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

    path = Path(uri[len("sqlite:///") :]).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=300):
        yield


def saved_view(created_ms: int = 0) -> str:
    """The candidates view this project saves on its experiments (MLflow 3's saved-view envelope).

    It lists the candidate runs alone (:data:`CANDIDATES_FILTER`: no parent, no report),
    shows :data:`VIEW_METRICS`, why a candidate failed (``error_kind``, ``error``) and the
    winner tag as columns (few enough to fit a 1400-pixel window) and sorts by ``fitness``,
    best first. MLflow keeps no
    per-experiment default columns: a view is opened by its URL (:meth:`Tracker.ui_hint`)
    or chosen from the view menu above the runs table.
    """
    columns = [f"metrics.`{m}`" for m in VIEW_METRICS] + ["tags.`error_kind`", "tags.`error`", "tags.`llm4rl.winner`"]
    state = {
        "orderByKey": "metrics.`fitness`",
        "orderByAsc": False,
        "selectedColumns": columns,
        "searchFilter": CANDIDATES_FILTER,
    }
    return json.dumps(
        {
            "name": "llm4rl: candidates by fitness",
            "createdAt": created_ms,
            "updatedAt": created_ms,
            "state": json.dumps(state),
        }
    )


def runs_view(created_ms: int = 0) -> str:
    """The parent runs' view: one row per command (:data:`RUNS_FILTER`), newest first, with its
    result in one line (:data:`RESULT_TAG`), its plugins, env, seed and totals."""
    columns = [f"metrics.`{m}`" for m in ("fitness", "seconds")] + [
        f"tags.`{t}`" for t in (RESULT_TAG, "plugins", "env", "seed")
    ]
    state = {
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "selectedColumns": columns,
        "searchFilter": RUNS_FILTER,
    }
    return json.dumps(
        {
            "name": "llm4rl: runs (one per command)",
            "createdAt": created_ms,
            "updatedAt": created_ms,
            "state": json.dumps(state),
        }
    )


def rounded(name: str, value: float) -> float:
    """``value`` with the decimals :data:`DECIMALS` gives ``name`` (as it is), so that tables read
    ``12.3`` where they read ``12.345678901``."""
    digits = DECIMALS.get(name)
    if digits is None or not _finite(value):
        return value
    return float(round(float(value), digits))


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
        self.experiment_name = experiment
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
            self.client.set_experiment_tag(self.experiment_id, f"mlflow.sharedViewState.{RUNS_VIEW_KEY}", runs_view())
        self.parent_id = ""
        self.parent_name = ""
        self.uri = cfg["uri"]
        self._renamed: dict[str, dict[str, str]] = {}  # per run: {logged metric name: original}, when they differ

    # -- parent run -------------------------------------------------------------------
    def local_paths(self) -> list[str]:
        """The store's files on this machine: the sqlite file and the experiment's artifact folder (where local)."""
        found = []
        if str(self.uri).startswith("sqlite:///"):
            found.append(str(Path(str(self.uri)[len("sqlite:///") :]).expanduser()))
        with contextlib.suppress(Exception):
            location = str(self.client.get_experiment(self.experiment_id).artifact_location or "")
            if location.startswith("file://"):
                found.append(unquote(urlparse(location).path))
            elif location and "://" not in location:
                found.append(location)
        return found

    @contextmanager
    def experiment_run(self, config: DictConfig, run_name: str, tags: dict[str, str]) -> Iterator[str]:
        """Start the parent run, log the resolved config; yields its run id."""
        run = self.mlflow.start_run(
            experiment_id=self.experiment_id, run_name=run_name, tags={KIND_TAG: "parent", **tags}
        )
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

    def log_points(
        self, points: list[tuple[str, float, int]], run_id: str | None = None, keep_nan: bool = False
    ) -> None:
        """Many ``(key, value, step)`` metric points in few requests; non-finite values are left
        out (NaN kept with ``keep_nan``). Names MLflow refuses are logged under :func:`safe_key`
        names (:meth:`metric_names`); values are :func:`rounded` by name (``seconds``, returns)."""
        import time

        from mlflow.entities import Metric

        rid = run_id or self.parent_id
        now = int(time.time() * 1000)
        kept = [(k, v, step) for k, v, step in points if _finite(v) or (keep_nan and isinstance(v, float) and v != v)]
        names = self.metric_names([k for k, _, _ in kept], rid)
        metrics = [Metric(names[k], rounded(k, float(v)), now, int(step)) for k, v, step in kept]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(rid, metrics=metrics[i : i + 1000])

    def metric_names(self, keys: list[str], run_id: str | None = None) -> dict[str, str]:
        """The name each metric key is logged under in a run: itself where MLflow takes it,
        else :func:`safe_key`'s (with a digest where two would meet). A run that got a
        changed name has :data:`NAMES_ARTIFACT` (``{logged name: original}``) and the
        :data:`RENAMED_TAG` tag."""
        rid = run_id or self.parent_id
        renamed = self._renamed.setdefault(rid, {})
        back = {original: logged for logged, original in renamed.items()}
        keys = list(dict.fromkeys(keys))
        taken = {k for k in keys if valid_key(k)} | set(renamed)
        out: dict[str, str] = {}
        new = False
        for key in keys:
            if key in taken and key not in renamed:
                out[key] = key
            elif key in back:
                out[key] = back[key]
            else:
                logged = safe_key(key)
                if logged in taken:  # another name is logged under it already: this one gets its digest
                    logged = safe_key(f"{logged[: MAX_KEY_CHARS - 11]}-{_digest(str(key))}")
                renamed[logged], back[key], out[key] = str(key), logged, logged
                taken.add(logged)
                new = True
        if new:
            self.log_json(renamed, NAMES_ARTIFACT, rid)
            self.client.set_tag(rid, RENAMED_TAG, str(len(renamed)))
        return out

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
            self.client.set_tag(run_id or self.parent_id, safe_key(k), str(v))

    # -- candidates -------------------------------------------------------------------
    def log_candidate(
        self, candidate: Candidate, result: TrainResult, tags: dict[str, str], ended: float | None = None
    ) -> str:
        """A nested run with the candidate's parts, curve, metrics, fitness and description.

        The run is named after its parent (``eureka-s0/it1-c0``) and spans the training's own
        time: it ends at ``ended`` (epoch seconds when the result came back; now if None)
        and starts ``result.seconds`` before.

        Metrics, one name per meaning and one value per step: ``fitness`` and ``eval/return``
        at each evaluation (the last one is the final score), the trainer's series over
        frames (``charts/episodic_return`` is training episodes), reward ``components/*``,
        and per-training summaries (``frames``, ``seconds``, ``reward/env_correlation``,
        ``time/*``, ...) once at step 0; a summary that differs from its series' last point
        is ``summary/<name>``. Names MLflow refuses are logged under valid ones
        (:meth:`metric_names`).

        Never raises: where writing the run fails (the backend, an artifact, a value MLflow
        refuses), ``result`` becomes a failure of kind ``tracking`` (:func:`tracking_failure`)
        and the run ends FAILED with the reason (:meth:`fail_candidate`). ``result.run_id``
        is the new run's id from the moment it exists.
        """
        import time

        end_ms = int((ended if ended is not None else time.time()) * 1000)
        rid = ""
        try:
            rid = self._create_candidate_run(candidate, result, tags, end_ms)
            result.run_id = rid
            self._fill_candidate_run(rid, candidate, result, end_ms)
            self.client.set_terminated(rid, status="FINISHED" if result.ok else "FAILED", end_time=end_ms)
        except Exception as exc:  # a candidate that cannot be recorded fails alone
            log.warning(
                "candidate %s could not be recorded in MLflow (%s: %s); the run goes on",
                candidate.id,
                type(exc).__name__,
                str(exc)[:300],
            )
            tracking_failure(result, exc)
            rid = self.fail_candidate(
                candidate, result, run_id=rid, end_ms=end_ms, detail="".join(traceback.format_exception(exc))[-4000:]
            )
            result.run_id = rid
        return rid

    def _create_candidate_run(
        self, candidate: Candidate, result: TrainResult, tags: dict[str, str], end_ms: int
    ) -> str:
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        fitness_name = result.fitness.name if result.fitness is not None else "fitness"
        page = run_page.candidate_page(
            candidate=candidate,
            result=result,
            parent_name=self.parent_name,
            parent_id=self.parent_id,
            experiment_id=self.experiment_id,
            fitness_name=fitness_name,
        )
        run = self.client.create_run(
            self.experiment_id,
            start_time=end_ms - int(result.seconds * 1000),
            run_name=run_page.candidate_run_name(self.parent_name, candidate.id),
            tags={
                MLFLOW_PARENT_RUN_ID: self.parent_id,
                KIND_TAG: "candidate",
                "candidate": candidate.id,
                "ok": str(result.ok),
                run_page.WINNER_TAG: "false",
                run_page.NOTE_TAG: page,
                **failure_tags(result),
                **{safe_key(k): v for k, v in tags.items()},
            },
        )
        return run.info.run_id

    def _fill_candidate_run(self, rid: str, candidate: Candidate, result: TrainResult, end_ms: int) -> None:
        fitness_name = result.fitness.name if result.fitness is not None else "fitness"
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
            self.log_points([(k, float("nan"), 0) for k in undefined], rid, keep_nan=True)
            names = self.metric_names(list(undefined), rid)
            self.set_tags({f"note.{names[k]}": UNDEFINED.get(k, "undefined") for k in undefined}, rid)
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

    def fail_candidate(
        self, candidate: Candidate, result: TrainResult, run_id: str = "", end_ms: int | None = None, detail: str = ""
    ) -> str:
        """Record a candidate whose recording failed (``result`` says why: :func:`tracking_failure`)
        and end its run FAILED; its run id ("" when MLflow takes nothing). Best effort, never raises.

        ``run_id``: the candidate's run, if it was created; else a small run of its own is made
        (the parent, the candidate, ``ok=False``, the kind). The reason is the ``error`` tag
        (the error's last line, the recording's own) and ``error.txt`` (with ``detail``, the traceback).
        """
        import time

        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        end_ms = end_ms if end_ms is not None else int(time.time() * 1000)
        first = (result.error.strip().splitlines() or ["recording failed"])[-1][:250]
        tags = {"ok": "False", "error_kind": result.error_kind or "tracking", "error": first}
        if not run_id:
            with contextlib.suppress(Exception):
                run_id = self.client.create_run(
                    self.experiment_id,
                    start_time=end_ms - int(max(result.seconds, 0.0) * 1000),
                    run_name=run_page.candidate_run_name(self.parent_name, candidate.id),
                    tags={
                        MLFLOW_PARENT_RUN_ID: self.parent_id,
                        KIND_TAG: "candidate",
                        "candidate": candidate.id,
                        run_page.WINNER_TAG: "false",
                        **tags,
                    },
                ).info.run_id
        if not run_id:
            return ""
        for key, value in tags.items():
            with contextlib.suppress(Exception):
                self.client.set_tag(run_id, key, value)
        with contextlib.suppress(Exception):  # the description says it failed, and why
            page = run_page.candidate_page(
                candidate=candidate,
                result=result,
                parent_name=self.parent_name,
                parent_id=self.parent_id,
                experiment_id=self.experiment_id,
                fitness_name=result.fitness.name if result.fitness is not None else "fitness",
            )
            self.client.set_tag(run_id, run_page.NOTE_TAG, page)
        with contextlib.suppress(Exception):
            self.log_text(result.error + (f"\n\n{detail}" if detail else ""), "error.txt", run_id)
        with contextlib.suppress(Exception):
            self.client.set_terminated(run_id, status="FAILED", end_time=end_ms)
        return run_id

    def describe_run(
        self,
        *,
        task: str,
        fitness_name: str,
        history: list[Any],
        best: tuple[Candidate, TrainResult] | None,
        llm: dict[str, float],
        seconds: float,
        final: list[float] | None = None,
    ) -> str:
        """Write the parent run's description (:func:`core.run_page.parent_page`) and mark the winner.

        The winning candidate's run gets the tag ``llm4rl.winner=true`` and a description
        that says it won and by which rule; the parent gets ``llm4rl.winner_run``. Returns
        the parent's description.
        """
        text = run_page.parent_page(
            name=self.parent_name,
            task=task,
            fitness_name=fitness_name,
            experiment_id=self.experiment_id,
            history=history,
            best=best,
            llm=llm,
            seconds=seconds,
            final=final,
        )
        self.set_tags(
            {
                run_page.NOTE_TAG: text,
                RESULT_TAG: run_page.outcome_line(task=task, fitness_name=fitness_name, history=history, best=best)[
                    :5000
                ],
            }
        )
        if best is not None and best[1].run_id:
            candidate, result = best
            page = run_page.candidate_page(
                candidate=candidate,
                result=result,
                parent_name=self.parent_name,
                parent_id=self.parent_id,
                experiment_id=self.experiment_id,
                fitness_name=fitness_name,
                winner=run_page.winner_rule(fitness_name),
            )
            self.set_tags({run_page.WINNER_TAG: "true", run_page.NOTE_TAG: page}, result.run_id)
            self.set_tags({"llm4rl.winner_run": result.run_id})
        return text

    def ui_hint(self) -> str:
        """How to open these results."""
        uri = self.uri
        page = f"#/experiments/{self.experiment_id}/runs?viewStateShareKey={VIEW_KEY}&{run_page.ML_VIEW}"
        if uri.startswith("sqlite:///"):
            return f"python -m core.ui --uri {uri} --experiment {self.experiment_name}"
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
    if result.fitness is not None and not (
        last_eval and last_eval.frames == result.frames and last_eval.fitness == result.fitness.value
    ):
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


def failure_tags(result: TrainResult) -> dict[str, str]:
    """A failed candidate's ``error_kind`` and ``error`` (why, in one line: :func:`core.run_page.reason`),
    columns of the candidates view; none for a candidate that trained."""
    if result.ok:
        return {}
    return {"error_kind": run_page.status_of(result), "error": run_page.reason(result) or "no error text"}


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
