"""Finished trainings, kept so that an interrupted or repeated run does not pay twice.

A training is identified by what determines its outcome: the candidate's parts (the
LLM-written programs included), how it trains (the hash of the policy it continues, its
frames), the task, trainer and plugin config, the seed, and the
code that runs it (a hash of the framework's training code and of every participating
plugin's source), so that edited code never replays an old result. Records are pickled
into a small sqlite file that lives beside the tracking store by default
(:func:`results_path`), so a fresh study folder starts fresh.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sqlite3
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from core.records import Candidate, TrainResult


def results_path(settings: Any) -> Path:
    """Where finished trainings are kept: ``results_store``, else beside the tracking store.

    A sqlite tracking URI ``sqlite:///dir/mlflow.db`` puts them in ``dir/llm4rl-results.sqlite``;
    any other URI (a server, a file store) in ``<cache_dir>/results.sqlite``.
    """
    if settings.run.results_store:
        return Path(settings.run.results_store).expanduser()
    uri = settings.tracking.uri if settings.tracking is not None else ""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :]).expanduser().resolve().parent / "llm4rl-results.sqlite"
    if uri and "://" not in uri:  # a plain folder: MLflow's file store
        return Path(uri).expanduser().resolve() / "llm4rl-results.sqlite"
    return Path(settings.run.cache_dir or ".").expanduser() / "results.sqlite"


def job_key(candidate: Candidate, config: dict[str, Any], seed: int, code: dict[str, str] | None = None) -> str:
    """A stable hash of everything that decides a training's result."""
    parts = {role: asdict(p) if hasattr(p, "__dataclass_fields__") else p for role, p in candidate.parts.items()}
    for part in parts.values():  # the prompt/reply that produced code do not change training
        if isinstance(part, dict):
            part.pop("prompt", None)
            part.pop("reply", None)
    payload = {
        "parts": parts,
        "macros": [asdict(m) for m in candidate.macros],
        # how it trains: the policy it continues (by the weights' hash, not where they came from),
        # its own budget, the original-env finish, and whether the result must hold the weights
        "start": candidate.start.sha256 if candidate.start is not None else None,
        "frames": candidate.frames,
        "original_after": candidate.original_after,
        "keep_policy": candidate.keep_policy,
        "env": config.get("env"),
        "trainer": config.get("trainer"),
        "plugins": config.get("plugins"),  # per-step plugins change training too
        "seed": seed,
        "code": code or {},  # framework and plugin source hashes
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


class ResultStore:
    """sqlite key -> pickled TrainResult; safe for several processes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute("CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, result BLOB)")

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def get(self, key: str) -> TrainResult | None:
        with self._connect() as db:
            row = db.execute("SELECT result FROM results WHERE key = ?", (key,)).fetchone()
        return _upgrade(pickle.loads(row[0])) if row else None

    def put(self, key: str, result: TrainResult) -> None:
        with self._connect() as db:
            db.execute("INSERT OR REPLACE INTO results VALUES (?, ?)", (key, pickle.dumps(result)))


def _upgrade(result: TrainResult) -> TrainResult:
    """Give a record stored by an older version the fields added since (their defaults)."""
    for f in fields(TrainResult):
        if f.name not in result.__dict__:
            value = f.default_factory() if f.default_factory is not MISSING else f.default
            setattr(result, f.name, value)
    return result
