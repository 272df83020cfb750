"""Persistent response cache: one sqlite row per sampled reply.

The key covers everything that decides a reply: the model string, the messages, the
sampling parameters, the seed and the sample index. Re-running an experiment with the
same seed therefore asks the backend nothing and gets the same replies back. Rows are
stored per sample so that asking for ``n=8`` after ``n=4`` only generates the last four.

Several processes (an executor's workers, parallel sweeps) may share one file: sqlite
runs in WAL mode with a busy timeout, and every operation opens its own short-lived
connection so nothing is shared across threads or forks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Bump when the key layout or the stored value changes; old rows are then ignored.
CACHE_VERSION = 1


def user_cache_dir() -> Path:
    """``$LLM4RL_CACHE_DIR``, else ``$XDG_CACHE_HOME/llm4rl``, else ``~/.cache/llm4rl``."""
    explicit = os.environ.get("LLM4RL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llm4rl"


def default_cache_path() -> Path:
    """Where the response cache lives when ``llm.cache_path`` is not set."""
    return user_cache_dir() / "llm_cache.sqlite"


def cache_key(
    model: str,
    messages: list[dict[str, str]],
    params: Mapping[str, Any],
    seed: int,
    index: int,
) -> str:
    """A stable hex digest for one sample of one request.

    ``params`` holds the sampling parameters (temperature, max_tokens, stop, ...);
    keys with ``None`` values are dropped so that adding an optional parameter later
    does not invalidate existing rows.
    """
    payload = {
        "v": CACHE_VERSION,
        "model": model,
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "params": {k: v for k, v in sorted(params.items()) if v is not None},
        "seed": seed,
        "index": index,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """A key -> JSON-value store in one sqlite file, safe across processes."""

    def __init__(self, path: str | os.PathLike[str], timeout_s: float = 60.0) -> None:
        self.path = Path(path).expanduser()
        self.timeout_s = timeout_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        for attempt in itertools.count():
            con = self._connect()
            try:
                # WAL lets readers proceed while one process writes.
                con.execute("PRAGMA journal_mode=WAL")
                con.execute(
                    "CREATE TABLE IF NOT EXISTS replies ("
                    " key TEXT PRIMARY KEY, model TEXT, value TEXT NOT NULL, created REAL)"
                )
                break
            except sqlite3.OperationalError as exc:
                # Switching a new file to WAL takes an exclusive lock that sqlite's busy
                # handler does not wait for: several processes opening it at once retry.
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(min(0.01 * (attempt + 1), 0.2))
            finally:
                con.close()

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        con.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
        return con

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored value for ``key``, or ``None``."""
        con = self._connect()
        try:
            row = con.execute("SELECT value FROM replies WHERE key = ?", (key,)).fetchone()
        finally:
            con.close()
        return json.loads(row[0]) if row else None

    def put(self, key: str, value: Mapping[str, Any], model: str = "") -> None:
        """Store ``value`` under ``key`` (the first writer wins on a race)."""
        blob = json.dumps(dict(value), ensure_ascii=False)
        con = self._connect()
        try:
            con.execute(
                "INSERT OR IGNORE INTO replies (key, model, value, created) VALUES (?, ?, ?, ?)",
                (key, model, blob, time.time()),
            )
        finally:
            con.close()

    def __len__(self) -> int:
        con = self._connect()
        try:
            return int(con.execute("SELECT COUNT(*) FROM replies").fetchone()[0])
        finally:
            con.close()


def position_key(model: str, params: Mapping[str, Any], seed: int, scope: str, tag: str, call: int, index: int) -> str:
    """The key of a sample by its place in a run, not by its prompt.

    ``scope`` names the run (:func:`core.config.config_key`), ``call`` counts the calls
    with this ``tag`` the run made before this one. A prompt that carries what training
    measured (Eureka's reflection, a repair's traceback) differs wherever training does,
    on another CPU for one; a replay that misses the prompt's key still finds, under this
    one, the reply the recorded run got at the same place. Its row holds a reference
    (``{"position_of": <cache_key>}``), not a second copy of the reply.
    """
    payload = {
        "v": CACHE_VERSION,
        "position": [scope, tag, call, index],
        "model": model,
        "params": {k: v for k, v in sorted(params.items()) if v is not None},
        "seed": seed,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def dump_replies(cache: str | os.PathLike[str], out: str | os.PathLike[str]) -> int:
    """Write every row of the sqlite cache ``cache`` to ``out`` (gzipped JSON lines); how many replies.

    A study commits this file beside its report, so that a re-run with no LLM
    (:func:`load_replies`, then ``llm.replay_only=true``) gets the very replies it used.
    The replies ``out`` already holds are kept (the cache's win on the same key): a study
    resumed in a new store still reports the runs of earlier sessions, and their replies
    are only in this file. The rows of :func:`position_key` go with the replies they point
    to and are not counted.
    """
    import gzip

    con = sqlite3.connect(Path(cache))
    try:
        rows = {
            key: {"key": key, "model": model, "value": json.loads(value)}
            for key, model, value in con.execute("SELECT key, model, value FROM replies")
        }
    finally:
        con.close()
    if Path(out).exists():
        with gzip.open(out, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    rows.setdefault(row["key"], row)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for key in sorted(rows):
            f.write(json.dumps(rows[key], ensure_ascii=False) + "\n")
    return sum(1 for row in rows.values() if "position_of" not in row["value"])


def load_replies(path: str | os.PathLike[str], cache: ResponseCache) -> int:
    """Put the rows of a :func:`dump_replies` file into ``cache``; how many replies."""
    import gzip

    n = 0
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                cache.put(row["key"], row["value"], row.get("model", ""))
                n += "position_of" not in row["value"]
    return n
