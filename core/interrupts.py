"""Ctrl-C and SIGTERM that stop a run within a second or two, whatever it is doing.

Both signals become ``KeyboardInterrupt`` in the main thread, after telling the embedded
model to stop generating (its requests run in other threads, which a plain interrupt
would leave running, and a thread pool waits for them on its way out). The MLflow runs
the interrupted run opened are ended ``KILLED`` by :class:`core.tracking.Tracker`; the
entry points print one line on how to resume (:data:`RESUME_HINT`) and :func:`leave`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import NoReturn

#: what an interrupted run prints: finished trainings and LLM replies are kept
RESUME_HINT = (
    "interrupted: finished trainings and LLM replies are kept; run the same command again to resume "
    "(nothing already paid for is recomputed)"
)


def stop_generation() -> None:
    """Tell the embedded model, if this process loaded it, to stop every request in progress."""
    embedded = sys.modules.get("core.llm.embedded")
    if embedded is not None:
        embedded.cancel()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    stop_generation()
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install() -> None:
    """Make SIGINT and SIGTERM interrupt the main thread after stopping the embedded model.

    Only possible from the main thread (Python's rule for signal handlers); elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def leave(code: int = 130) -> NoReturn:
    """Exit after an interrupt (by the time an entry point calls this, its MLflow runs are ended).

    Python's own shutdown is skipped (``os._exit``): by then nothing is left to save, and its
    final garbage collection of torch's and MLflow's objects alone took 8 s at a load of 7
    (the target from Ctrl-C to exit is 2 s). What that shutdown would have done and matters
    is done here: a generation llama.cpp could not stop yet (it stops at its next token, not
    while it reads a prompt) gets a short wait, worker processes (a pool's trainings) are
    terminated rather than left training, log files and the console are flushed.
    """
    import logging
    import multiprocessing

    embedded = sys.modules.get("core.llm.embedded")
    if embedded is not None:
        embedded.settle(0.5)
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(1.0)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
