"""A study's runs kept beside its report, so a report can count cells that ran in earlier sessions.

A study may run task by task across sessions on machines that do not keep its MLflow
store. :func:`write_runs` writes the runs a report counted to ``<report folder>/runs.jsonl.gz``
(``docs/results/runs.jsonl.gz`` beside ``docs/results.md``, with its figures and replies),
a file committed with the report; :func:`read_runs` reads them back as
:class:`~core.report.data.StudyRun` records, which :func:`core.report.results.study_runs`
merges with the store's.

The file is gzipped JSON lines: a header ``{"format": "llm4rl.study-runs", "version": 1,
"study": <name>}``, then one record per run with the fields of ``StudyRun`` that the report
reads: the run's identity, status and MLflow status, fitness (as scored), final metrics of
the run and of its best candidate's training (exact), its tags (MLflow's own ``mlflow.*``
left out), and its curves, values rounded to :data:`CURVE_DIGITS` significant digits and
the training-return curve thinned to :data:`TRAIN_POINTS` points (they are drawn, never
tabulated). Config params and artifacts are not kept. Non-finite numbers are written as
Python's ``json`` writes them (``NaN``).
"""

from __future__ import annotations

import gzip
import io
import json
import math
from pathlib import Path
from typing import Any

from core.errors import UserError
from core.report.data import StudyRun

ARCHIVE_NAME = "runs.jsonl.gz"
FORMAT = "llm4rl.study-runs"
VERSION = 1
#: significant digits of a curve's values: enough for a figure
CURVE_DIGITS = 4
#: most points kept of a training-return curve (one point per update: thousands on a long training)
TRAIN_POINTS = 100


def archive_path(out: Path) -> Path:
    """The archive beside the report ``out``, in the folder of its figures: ``docs/results.md`` -> ``docs/results/``."""
    return Path(out).with_suffix("") / ARCHIVE_NAME


def _curve(points: list[tuple[int, float]], most: int | None = None) -> list[list[float]]:
    if most is not None and len(points) > most:  # evenly spaced, the first and the last kept
        step = (len(points) - 1) / (most - 1)
        points = [points[round(i * step)] for i in range(most)]
    return [[int(f), _round(v)] for f, v in points]


def _round(value: float) -> float:
    return float(f"{value:.{CURVE_DIGITS}g}") if math.isfinite(value) else value


def to_record(run: StudyRun) -> dict[str, Any]:
    """The JSON record of a run (see the module's docstring for what is kept)."""
    return {
        "run_id": run.run_id,
        "name": run.name,
        "env": run.env,
        "arm": run.arm,
        "plugins": run.plugins,
        "seed": run.seed,
        "status": run.status,
        "mlflow_status": run.mlflow_status,
        "note": run.note,
        "fitness": run.fitness,
        "fitness_name": run.fitness_name,
        "start_time": run.start_time,
        "metrics": dict(sorted(run.metrics.items())),
        "training_metrics": dict(sorted(run.training_metrics.items())),
        "tags": {k: v for k, v in sorted(run.tags.items()) if not k.startswith("mlflow.")},
        "curve": _curve(run.curve),
        "train_curve": _curve(run.train_curve, TRAIN_POINTS),
    }


def from_record(record: dict[str, Any]) -> StudyRun:
    """The run of a :func:`to_record` record."""
    fitness = record.get("fitness")
    return StudyRun(
        run_id=str(record["run_id"]),
        name=str(record["name"]),
        env=str(record["env"]),
        plugins=str(record["plugins"]),
        seed=int(record["seed"]),
        status=str(record["status"]),
        fitness=None if fitness is None else float(fitness),
        fitness_name=str(record.get("fitness_name", "fitness")),
        metrics={k: float(v) for k, v in record.get("metrics", {}).items()},
        tags={k: str(v) for k, v in record.get("tags", {}).items()},
        curve=[(int(f), float(v)) for f, v in record.get("curve", [])],
        train_curve=[(int(f), float(v)) for f, v in record.get("train_curve", [])],
        training_metrics={k: float(v) for k, v in record.get("training_metrics", {}).items()},
        start_time=int(record.get("start_time", 0)),
        arm=str(record.get("arm", "")),
        note=str(record.get("note", "")),
        mlflow_status=str(record.get("mlflow_status", "")),
    )


def write_runs(path: Path, study: str, runs: list[StudyRun]) -> int:
    """Write ``runs`` of ``study`` to ``path`` (replacing it); how many.

    The same runs give the same bytes (no time stamp in the gzip header), so a report
    rewritten from the same cells leaves the committed file unchanged.
    """
    lines = [json.dumps({"format": FORMAT, "version": VERSION, "study": study})]
    lines += [json.dumps(to_record(r), ensure_ascii=False) for r in runs]
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as f:
        f.write(("\n".join(lines) + "\n").encode("utf-8"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return len(runs)


def read_runs(path: Path, study: str) -> list[StudyRun]:
    """The runs of ``study`` in the archive ``path`` ([] if there is none)."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        header, records = (rows[0], rows[1:]) if rows else ({}, [])
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} file of version {VERSION}")
        if header.get("study") != study:
            raise UserError(
                f"The archive {path} holds runs of the study '{header.get('study')}', not '{study}': "
                "give the report another --out, or leave the archive out with --no-archive."
            )
        return [from_record(r) for r in records]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"Cannot read the study's archive {path}: {err}. Leave it out with --no-archive.") from None


def finished(runs: list[StudyRun], where: str) -> dict[str, str]:
    """Cell key -> ``'<run id> in <where>'`` of the archived runs that finished (as the store's finished cells)."""
    return {
        r.tags["study.cell"]: f"{r.run_id} in {where}"
        for r in runs
        if r.mlflow_status == "FINISHED" and "study.cell" in r.tags
    }


__all__ = ["ARCHIVE_NAME", "archive_path", "finished", "from_record", "read_runs", "to_record", "write_runs"]
