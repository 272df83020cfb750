"""Rich progress bars for iterations, candidates and training frames."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class InfoColumn(ProgressColumn):
    """Shows a task's optional ``info`` field (fps, last return, ...)."""

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("info", "")))


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
        TimeRemainingColumn(),
        transient=not sys.stderr.isatty(),
    )
    with progress:
        yield progress
