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
RENAMED = {"nonfinite": "invalid_value", "shape": "invalid_value", "dtype": "invalid_value",
           "output": "invalid_value", "crash": "crashed"}
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
    """Limits of the worker process that runs a candidate's programs.

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
    isolation holds on its own.
    """

    cpu_s: float = 10
    wall_s: float = 20
    memory_mb: int = 4096
    max_procs: int = 16
    call_timeout_s: float = 1.0
    max_output_chars: int = 10_000
    max_open_files: int = 64
    uid: int | None = None
    gid: int = 65534
    per_row_fallback: bool = True
    max_time_share: float = 0.5
    time_share_grace_s: float = 5.0
    tmp_mb: int = 64
    static_check: bool = True


#: keys of a run's ``sandbox:`` config node that are :class:`Limits` fields, with their types
_LIMIT_KEYS = {"cpu_s": float, "wall_s": float, "memory_mb": int, "call_timeout_s": float, "max_procs": int,
               "max_output_chars": int, "per_row_fallback": bool, "max_time_share": float,
               "time_share_grace_s": float, "static_check": bool}


def settings_from_config(node: Any) -> tuple[Limits, tuple[str, ...]]:
    """``(Limits, allowed_imports)`` from a run's ``sandbox:`` node (defaults for what it omits).

    Accepts the typed :class:`core.config.SandboxConfig`, a DictConfig or a dict.
    """
    if not node:
        return Limits(), tuple(DEFAULT_IMPORTS)
    if hasattr(node, "limits") and callable(node.limits):
        return node.limits(), tuple(node.imports)
    get = node.get if hasattr(node, "get") else lambda key: getattr(node, key, None)
    limits = Limits(**{k: kind(get(k)) for k, kind in _LIMIT_KEYS.items() if get(k) is not None})
    imports = get("allowed_imports")
    return limits, tuple(str(m) for m in imports) if imports is not None else tuple(DEFAULT_IMPORTS)
