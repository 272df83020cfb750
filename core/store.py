"""Finished trainings, kept so that an interrupted or repeated run does not pay twice.

A training is identified by what determines its outcome: the candidate's parts, the
task and trainer config, and the seed. Records are pickled into a small sqlite file.
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


def job_key(candidate: Candidate, config: dict[str, Any], seed: int) -> str:
    """A stable hash of everything that decides a training's result."""
    parts = {role: asdict(p) if hasattr(p, "__dataclass_fields__") else p for role, p in candidate.parts.items()}
    for part in parts.values():  # the prompt/reply that produced code do not change training
        if isinstance(part, dict):
            part.pop("prompt", None)
            part.pop("reply", None)
    payload = {
        "parts": parts,
        "macros": [asdict(m) for m in candidate.macros],
        "env": config.get("env"),
        "trainer": config.get("trainer"),
        "plugins": config.get("plugins"),  # per-step plugins change training too
        "seed": seed,
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
            value = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
            setattr(result, f.name, value)
    return result
