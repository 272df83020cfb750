"""What the sandbox says about a program: reports, failure categories, limits.

Every outcome is a :class:`SandboxReport`. A program that is not yet a program (empty,
does not parse, the entry is missing or has the wrong arguments) gets ``no_code``,
``syntax`` or ``signature`` from reading the code; a program that fails the sandbox gets
one of :data:`CATEGORIES`. The ``message`` is short feedback meant for the next prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_IMPORTS = ("math", "numpy", "torch")

#: Why a program failed the sandbox, in the order a program meets them.
CATEGORIES = (
    "forbidden",  # the static check refused a construct (nothing ran)
    "timeout",  # one call (or the start-up) went past its deadline; the worker was killed
    "too_slow",  # the program took more than its share of the candidate's time
    "memory",  # the program ran out of its memory limit
    "exception",  # the program raised (including RecursionError and printing too much)
    "invalid_value",  # it returned something unusable: NaN/inf, complex, wrong shape or dtype
    "crashed",  # the worker died without an answer (a signal, an exit, a broken reply)
)
#: Every report kind: ``ok``, the four reading failures (``names``: an unknown field or
#: a name never assigned, :mod:`core.namecheck`), then the categories.
KINDS = ("ok", "no_code", "syntax", "signature", "names") + CATEGORIES
#: Older and finer kinds, mapped to their category (the finer kind stays in ``data["check"]``).
RENAMED = {
    "nonfinite": "invalid_value",
    "shape": "invalid_value",
    "dtype": "invalid_value",
    "output": "invalid_value",
    "crash": "crashed",
}
MESSAGE_CHARS = 1500  # feedback text is trimmed to this many characters


@dataclass
class SandboxReport:
    """The outcome of checking or running a program.

    ``kind`` is one of :data:`KINDS` (a finer or older kind given here is mapped to its
    category, and kept in ``data["check"]``); ``message`` is short feedback for the LLM
    (with the last lines of the traceback for exceptions); ``detail`` is longer text for
    logs; ``data`` holds what a successful probe learned (``extra_dim``, component
    names, ``per_row``).
    """

    ok: bool
    kind: str
    message: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind in RENAMED:
            self.data.setdefault("check", self.kind)
            self.kind = RENAMED[self.kind]


class SandboxError(Exception):
    """A program failed a check or a call; ``report`` says how."""

    def __init__(self, report: SandboxReport) -> None:
        super().__init__(f"[{report.kind}] {report.message}")
        self.report = report


def fail(kind: str, message: str, detail: str = "") -> SandboxReport:
    """A failed report with the message trimmed to :data:`MESSAGE_CHARS`."""
    return SandboxReport(False, kind, message[:MESSAGE_CHARS], detail)


@dataclass
class Limits:
    """Limits of the worker process that runs a candidate's programs: the run's ``sandbox:``
    config (``conf/config.yaml``; :class:`core.config.SandboxConfig` is this class).

    Start-up and probing: ``wall_s`` bounds starting a worker and loading a program;
    ``cpu_s`` is the CPU time a worker may use beyond the time its calls took. Every call (the
    module body, a probe, a training step) has ``call_timeout_s`` of wall clock, enforced
    from outside: past it, the worker is killed. Over a candidate, time spent in programs
    may not exceed ``max_time_share`` of the wall time once it passes
    ``time_share_grace_s`` (``too_slow``). ``memory_mb`` is each worker process's address
    space; ``max_procs`` the processes and threads of its user; ``max_open_files`` its
    file descriptors; ``tmp_mb`` the size of its private temporary folder (and of any
    file it writes). When started as root the worker runs as ``uid`` (None: a fresh uid
    per worker, :data:`core.sandbox.host.UID_BASE` plus a process id) and ``gid``.
    ``per_row_fallback`` lets the probe accept a program written for one state rather
    than a batch. ``static_check`` turns the AST check off: only for tests that show the
    isolation holds on its own. ``allowed_imports`` travel beside the limits (the
    functions that run programs take them as ``allowed_imports``; :attr:`imports`).
    """

    allowed_imports: list[str] = field(default_factory=lambda: list(DEFAULT_IMPORTS))  # modules programs may import
    # CPU seconds a candidate's worker may use beyond the time its calls took (start-up and probes included)
    cpu_s: float = 10.0
    wall_s: float = 20.0  # wall-clock seconds to start a worker and probe a program
    memory_mb: int = 4096  # address space the worker may map beyond what its imports mapped (RLIMIT_AS)
    # wall-clock limit of one call (module body, probe, training step); past it the worker is killed
    call_timeout_s: float = 1.0
    max_procs: int = 16  # processes/threads the worker's unprivileged user may have
    max_output_chars: int = 10_000  # what print() in LLM code may write before it is cut off
    per_row_fallback: bool = True  # accept code written for one state, not a batch (runs once per row)
    max_time_share: float = 0.5  # most of a candidate's training wall time its programs may take (too_slow beyond)
    time_share_grace_s: float = 5.0  # program seconds per candidate before max_time_share applies
    static_check: bool = True  # the AST check before anything runs; false only to test the worker's isolation alone
    max_open_files: int = 64  # file descriptors the worker may hold (RLIMIT_NOFILE)
    tmp_mb: int = 64  # size of the worker's private temporary folder, and of any file it writes
    uid: int | None = None  # user the worker runs as when started as root; None: a fresh one per worker
    gid: int = 65534  # group the worker runs as when started as root (nogroup)

    def check(self) -> None:
        """Refuse limits that cannot work (``ValueError``); :func:`core.config.validate` calls it."""
        for name in (
            "cpu_s",
            "wall_s",
            "call_timeout_s",
            "max_time_share",
            "memory_mb",
            "max_procs",
            "max_output_chars",
            "max_open_files",
            "tmp_mb",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.time_share_grace_s < 0:
            raise ValueError(f"time_share_grace_s must be >= 0, got {self.time_share_grace_s}")

    @property
    def imports(self) -> tuple[str, ...]:
        """The modules programs may import, as the sandbox's functions take them."""
        return tuple(self.allowed_imports)

    def limits(self) -> Limits:
        """These limits (callers written for a config apart from its limits pass ``limits()``)."""
        return self
