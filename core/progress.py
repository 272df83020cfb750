"""Rich progress for every long wait: iterations, candidates, training frames and LLM calls.

- :func:`make_progress`: the run's one ``Progress``; its ETA comes from the work done so
  far (:class:`EtaColumn`), so a bar that advances in fractions shows one before it ends.
- :class:`LLMCallView`: a live line per LLM call, completion tokens so far against what
  the call may produce (``n`` x ``max_tokens``) and tokens per second, fed by the client's
  ``on_progress`` (:class:`core.llm.client.CallProgress`).
- :class:`RemoteProgress` and :class:`ProgressRelay`: a training in a pool worker or a Ray
  task draws its frame bar through a queue; the driver applies it to its own ``Progress``.
  :func:`routed_output` sends the worker's ``print()`` the same way, printed above the bars.
"""

from __future__ import annotations

import itertools
import os
import queue as queue_module
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text


class InfoColumn(ProgressColumn):
    """Shows a task's optional ``info`` field (fps, last return, tokens/s, ...)."""

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("info", "")))


class EtaColumn(ProgressColumn):
    """Time left, from the elapsed time and the share done: ``elapsed * (total - done) / done``.

    Rich's own column waits for a measured speed, which a bar advanced once or twice (an
    iteration, a candidate) does not give until it ends; this one shows as soon as any
    work is done. ``-:--:--`` before that, nothing once finished. A bar with an ``eta_s``
    field shows that instead (an LLM call: the tokens left at its decoding rate).
    Between two steps the estimate counts down from the last one instead of growing; a
    step that outlasts it counts in its own time so far (never a ``0:00:00`` that stays).
    """

    def __init__(self) -> None:
        super().__init__()
        self._steps: dict[Any, tuple[float, float]] = {}  # task id -> (completed, elapsed) at its last step

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text("")
        if "eta_s" in task.fields:  # the bar knows better (an LLM call: its decoding rate)
            left = task.fields["eta_s"]
        else:  # the pace at the last step, less the time since: no growing estimate between steps
            seen = self._steps.get(task.id)
            if seen is None or seen[0] != task.completed:
                seen = self._steps[task.id] = (task.completed, task.elapsed or 0.0)
            left = eta_seconds(seen[1], task.completed, task.total)
            if left is not None:
                left -= (task.elapsed or 0.0) - seen[1]
                if left < 1.0:  # the step in progress outlasted the pace so far: count it in
                    left = eta_seconds(task.elapsed, task.completed, task.total)
        if left is None:
            return Text("-:--:--", style="progress.remaining")
        minutes, seconds = divmod(int(left + 0.5), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"{hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")


def eta_seconds(elapsed: float | None, completed: float, total: float | None) -> float | None:
    """Seconds left at the pace so far, or None before any work is done."""
    if not elapsed or not total or completed <= 0:
        return None
    return max(0.0, elapsed * (total - completed) / completed)


@contextmanager
def make_progress(enabled: bool = True) -> Iterator[Progress | None]:
    """A shared Progress for the run, or None when disabled.

    Bars are drawn live on a terminal and cleared at the end elsewhere (CI logs).
    Update a bar's text with ``progress.update(task_id, info="...")``.
    """
    if not enabled:
        yield None
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        InfoColumn(),
        TimeElapsedColumn(),
        EtaColumn(),
        transient=not sys.stderr.isatty(),
    )
    with progress:
        yield progress


# -- LLM calls ---------------------------------------------------------------------------


class LLMCallView:
    """One live line per LLM call on the attached ``Progress`` (none attached: nothing shown).

    Pass it as the client's ``on_progress``; it is called from the client's threads with a
    :class:`core.llm.client.CallProgress` when a call starts, as tokens arrive and when it ends.
    """

    def __init__(self) -> None:
        self.progress: Progress | None = None
        self._tasks: dict[int, Any] = {}
        self._lock = threading.Lock()

    def attach(self, progress: Progress | None) -> None:
        self.progress = progress

    def __call__(self, call: Any) -> None:
        progress = self.progress
        if progress is None:
            return
        with self._lock:
            key = id(call)
            if call.done:
                task = self._tasks.pop(key, None)
                if task is not None:
                    progress.remove_task(task)
                return
            total = max(1, call.samples * call.max_tokens)
            if key not in self._tasks:
                self._tasks[key] = progress.add_task(llm_description(call), total=total)
            rate = decoding_rate(call)
            left = (total - call.tokens) / rate if rate else None  # the prompt's time is behind it
            progress.update(self._tasks[key], completed=min(call.tokens, total), info=llm_info(call), eta_s=left)


def llm_description(call: Any) -> str:
    return f"LLM {call.tag or 'call'}" + (f" x{call.samples}" if call.samples > 1 else "")


#: decoding seconds before a call's token rate is shown (:func:`decoding_rate`)
RATE_AFTER_S = 0.5


def decoding_rate(call: Any) -> float | None:
    """Completion tokens per second after a call's first token, or None until it can be measured.

    The first token ends the prompt's computation and starts the clock, so it is not
    counted, and the rate waits for a second token and :data:`RATE_AFTER_S` of decoding:
    one token over a few microseconds read as ``18677.6 tok/s``.
    """
    first = getattr(call, "first_token", None)
    if first is None or call.tokens < 2:
        return None
    elapsed = time.perf_counter() - first
    return (call.tokens - 1) / elapsed if elapsed >= RATE_AFTER_S else None


def llm_info(call: Any) -> str:
    """``412 tok, 14.2 tok/s`` (the tokens of all the call's samples so far, per second after
    the first), ``1 tok`` before a rate can be measured, ``reading the prompt`` before the
    first token."""
    if not call.tokens:
        return "reading the prompt"
    rate = decoding_rate(call)
    return f"{call.tokens} tok" + (f", {rate:.1f} tok/s" if rate else "")


# -- training in other processes ---------------------------------------------------------


class RemoteProgress:
    """A ``Progress`` stand-in for a training in another process: what the trainer does to
    its bar (``add_task``, ``update``, ``advance``, ``remove_task``) is put on ``queue`` for
    the driver's :class:`ProgressRelay`. Updates are sent at most every ``every_s`` seconds
    per bar (the last one of a bar always). ``queue`` needs ``put_nowait`` (a
    multiprocessing queue, a Ray queue); a full or closed queue drops the message.
    """

    def __init__(self, queue: Any, every_s: float = 0.5) -> None:
        self.queue = queue
        self.every_s = every_s
        self._ids = itertools.count()
        self._sent: dict[int, float] = {}
        self._totals: dict[int, float | None] = {}
        self._origin = f"{os.getpid()}-{id(self)}"

    def _put(self, message: tuple) -> None:
        try:
            self.queue.put_nowait(message)
        except Exception:  # progress is never worth failing a training for
            pass

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        task = next(self._ids)
        self._put(("add", (self._origin, task), {"description": description, "total": total, **fields}))
        self._sent[task] = time.monotonic()
        self._totals[task] = total
        return task

    def update(self, task: int, **fields: Any) -> None:
        now = time.monotonic()
        total = self._totals.get(task)
        last = total is not None and fields.get("completed", 0) >= total
        if now - self._sent.get(task, 0.0) < self.every_s and not last:
            return
        self._sent[task] = now
        self._put(("update", (self._origin, task), fields))

    def advance(self, task: int, advance: float = 1) -> None:
        self._put(("advance", (self._origin, task), {"advance": advance}))

    def remove_task(self, task: int) -> None:
        self._sent.pop(task, None)
        self._totals.pop(task, None)
        self._put(("remove", (self._origin, task), {}))

    def close(self) -> None:
        """Remove every bar still shown (the job ended)."""
        for task in list(self._totals):
            self.remove_task(task)

    def print(self, text: str) -> None:
        """A line of the worker's output, printed by the driver above its bars."""
        self._put(("print", None, {"text": text}))


class _LineWriter:
    """A text stream that hands each finished line to ``send`` (what is left at ``flush``, too)."""

    def __init__(self, send: Callable[[str], None], stream: Any) -> None:
        self.send = send
        self.stream = stream  # the one it replaces: its encoding, fileno and isatty are kept
        self._buffer = ""

    def write(self, text: str) -> int:
        self._buffer += text
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            self.send(line)
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            line, self._buffer = self._buffer, ""
            self.send(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def routed_output(remote: RemoteProgress | None) -> Iterator[None]:
    """In a worker: ``print()`` (``sys.stdout``) and ``sys.stderr`` go to the driver through
    ``remote``, which prints them above its bars (written to the terminal, a worker's line
    landed on the bar's line). Without ``remote`` nothing changes."""
    if remote is None:
        yield
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _LineWriter(remote.print, sys.stdout), _LineWriter(remote.print, sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved


class ProgressRelay:
    """Applies :class:`RemoteProgress` messages to the driver's ``progress``.

    :meth:`apply` takes one message; :meth:`pump` reads a multiprocessing queue in a thread
    until :meth:`stop`; bars a worker left behind (it died) are removed at :meth:`stop`.
    """

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self._bars: dict[tuple, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def apply(self, message: tuple) -> None:
        if self.progress is None:
            return
        op, key, fields = message
        if op == "print":  # a worker's output, above the bars
            console = getattr(self.progress, "console", None)
            if console is not None:
                console.print(fields.get("text", ""), markup=False, highlight=False, soft_wrap=True)
            else:
                print(fields.get("text", ""))
        elif op == "add":
            self._bars[key] = self.progress.add_task(**fields)
        elif key in self._bars:
            if op == "update":
                self.progress.update(self._bars[key], **fields)
            elif op == "advance":
                self.progress.advance(self._bars[key], fields.get("advance", 1))
            elif op == "remove":
                self.progress.remove_task(self._bars.pop(key))

    def drain(self, get: Callable[[], Any]) -> None:
        """Apply every message ``get()`` returns until it raises (the queue is empty)."""
        while True:
            try:
                message = get()
            except Exception:
                return
            self.apply(message)

    def pump(self, queue: Any) -> None:
        """Apply ``queue``'s messages in a daemon thread until :meth:`stop`."""

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    message = queue.get(timeout=0.2)
                except queue_module.Empty:
                    continue
                except (EOFError, OSError, ValueError):  # the queue was closed
                    return
                self.apply(message)

        self._thread = threading.Thread(target=loop, name="progress-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.progress is not None:
            for bar in self._bars.values():
                self.progress.remove_task(bar)
        self._bars.clear()


# -- after a run -------------------------------------------------------------------------


def next_steps(tracking_uri: str, experiment: str) -> list[str]:
    """What to run after a run or study: the report command and the MLflow UI."""
    uri = tracking_uri or "sqlite:///mlflow.db"
    ui = (
        f"mlflow ui --backend-store-uri {uri}"
        if uri.startswith(("sqlite:", "file:", "postgresql:", "mysql:")) or "://" not in uri
        else None
    )
    lines = [f"report:    python -m core.report --experiment {experiment} --uri {uri}"]
    if ui:
        lines.append(
            f"MLflow UI: python -m core.ui --uri {uri} --experiment {experiment}   (prints the experiment's page)"
        )
    else:
        lines.append(f"MLflow UI: {uri}")
    return lines
