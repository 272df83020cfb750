"""Compile, check, probe and run LLM-written code without letting it reach the host.

Layers, outermost first (see ``docs/sandbox.md`` for the threat model):

1. :func:`check_source` parses the code and applies the AST policy of
   :mod:`core.sandbox.policy` (allowed imports, no I/O or introspection escapes).
2. :func:`compile_program` executes the checked code in a namespace whose
   ``__builtins__`` holds only safe functions and an import hook that allows only
   the configured modules.
3. :func:`run_isolated` runs a program once in a child process
   (:mod:`core.sandbox.worker`) that sets CPU, memory, process, file-size and
   open-file limits and drops root privileges before the code runs; the parent
   enforces a wall clock and kills the child's process group.
4. :func:`prepare_reward` / :func:`prepare_state` probe a program on real states of
   the task in that child, validate the output (finite, float, right shape), and only
   then compile it in-process into a :class:`RewardFunction` / :class:`StateFunction`
   whose per-step calls are guarded by a timer and the same output checks.

Every failure is a :class:`SandboxReport` with a ``kind`` and a short ``message``
that a plugin can hand back to the LLM; :class:`SandboxError` carries one.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import json
import linecache
import os
import pickle
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from core.codegen import signature_error
from core.records import Program, RewardProgram, StateProgram
from core.sandbox.policy import SAFE_BUILTIN_NAMES, find_violation, module_allowed

if TYPE_CHECKING:  # pragma: no cover
    from core.envs.task import Task

DEFAULT_IMPORTS = ("math", "numpy", "torch")
#: Report kinds, in the order a program meets them.
KINDS = (
    "ok", "no_code", "syntax", "forbidden", "signature", "exception", "timeout",
    "memory", "nonfinite", "shape", "dtype", "output", "crash",
)  # fmt: skip
REWARD_ARGS = ("state", "action", "next_state")
STATE_ARGS = ("state",)
_MESSAGE_CHARS = 1500  # feedback text is trimmed to this many characters


@dataclass
class SandboxReport:
    """The outcome of checking or running a program.

    ``kind`` is one of :data:`KINDS`; ``message`` is short feedback for the LLM (with
    the last lines of the traceback for exceptions); ``detail`` is longer text for
    logs; ``data`` holds what a successful probe learned (``extra_dim``, component
    names).
    """

    ok: bool
    kind: str
    message: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class SandboxError(Exception):
    """A program failed a check or a call; ``report`` says how."""

    def __init__(self, report: SandboxReport) -> None:
        super().__init__(f"[{report.kind}] {report.message}")
        self.report = report


@dataclass
class Limits:
    """Resource limits of one isolated run (and the per-call timer in-process).

    ``cpu_s``/``wall_s`` bound the whole child (including ~1.5 s of interpreter and
    torch start-up); ``call_timeout_s`` bounds one call of the program;
    ``memory_mb`` is the child's address space; ``max_procs`` the processes and
    threads of the unprivileged ``uid``; ``max_output_chars`` what ``print`` may write.
    ``per_row_fallback`` lets the probe accept a program written for one state rather
    than a batch (it then runs once per row: :func:`call_per_row`).
    """

    cpu_s: float = 10
    wall_s: float = 20
    memory_mb: int = 4096
    max_procs: int = 16
    call_timeout_s: float = 1.0
    max_output_chars: int = 10_000
    max_open_files: int = 64
    uid: int = 65534  # the child runs as this user (nobody) when started as root
    gid: int = 65534
    per_row_fallback: bool = True


#: keys of a run's ``sandbox:`` config node that are :class:`Limits` fields, with their types
_LIMIT_KEYS = {"cpu_s": float, "wall_s": float, "memory_mb": int, "call_timeout_s": float, "per_row_fallback": bool}


def settings_from_config(node: Any) -> tuple[Limits, tuple[str, ...]]:
    """``(Limits, allowed_imports)`` from a run's ``sandbox:`` node (defaults for what it omits)."""
    if not node:
        return Limits(), tuple(DEFAULT_IMPORTS)
    limits = Limits(**{k: kind(node.get(k)) for k, kind in _LIMIT_KEYS.items() if node.get(k) is not None})
    imports = node.get("allowed_imports")
    return limits, tuple(str(m) for m in imports) if imports is not None else tuple(DEFAULT_IMPORTS)


# -------------------------------------------------------------------------------------
# Exceptions raised into running programs. BaseException, so `except Exception:` in
# LLM code cannot swallow them (bare `except:` and `finally` are refused statically).
# -------------------------------------------------------------------------------------


class CallTimeout(BaseException):
    """One call ran longer than its wall-clock budget."""


class OutputLimit(BaseException):
    """The program printed more than it may."""


class _BoundedPrint:
    """``print`` for programs: keeps output in memory and stops a flood."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[str] = []
        self.size = 0

    def reset(self) -> None:
        self.chunks, self.size = [], 0

    def __call__(self, *args: Any, sep: str = " ", end: str = "\n", **_: Any) -> None:
        text = str(sep).join(str(a) for a in args) + str(end)
        self.size += len(text)
        if self.size > self.limit:
            raise OutputLimit(f"printed more than {self.limit} characters")
        self.chunks.append(text)

    @property
    def text(self) -> str:
        return "".join(self.chunks)


# -------------------------------------------------------------------------------------
# Static check and compilation
# -------------------------------------------------------------------------------------


def _fail(kind: str, message: str, detail: str = "") -> SandboxReport:
    return SandboxReport(False, kind, message[:_MESSAGE_CHARS], detail)


def check_source(
    source: str,
    entry: str,
    *,
    arg_names: list[str] | tuple[str, ...] | None = None,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
) -> SandboxReport:
    """Parse ``source`` and apply the AST policy; nothing is executed.

    :return: ``kind`` ``ok``, ``no_code``, ``syntax``, ``forbidden`` or ``signature``.
    """
    if not (source or "").strip():
        return _fail("no_code", f"No code was given: write `def {entry}(...)`.")
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        line = f"\n    {e.text.strip()}" if e.text else ""
        return _fail("syntax", f"SyntaxError on line {e.lineno}: {e.msg}{line}")
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        return _fail("syntax", f"The code cannot be parsed: {type(e).__name__}: {e}")
    try:
        problem = find_violation(tree, allowed_imports)
    except RecursionError:
        problem = "the code is nested too deeply"
    if problem:
        return _fail("forbidden", f"Forbidden construct: {problem} Use only {', '.join(allowed_imports)} and plain Python.")
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry]
    if not defs:
        return _fail("signature", f"No top-level function named `{entry}` is defined.")
    if len(defs) > 1:
        return _fail("signature", f"`{entry}` is defined {len(defs)} times; define it once.")
    if arg_names is not None:
        err = signature_error(defs[0], entry, list(arg_names))
        if err:
            return _fail("signature", err)
    return SandboxReport(True, "ok", "")


def _restricted_import(allowed: tuple[str, ...]) -> Callable[..., Any]:
    def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level != 0 or not module_allowed(name, allowed):
            raise ImportError(f"import of {name!r} is not allowed")
        return builtins.__import__(name, globals, locals, fromlist, level)

    return _import


def _namespace(allowed_imports: tuple[str, ...], printer: _BoundedPrint, filename: str) -> dict[str, Any]:
    safe = {name: getattr(builtins, name) for name in SAFE_BUILTIN_NAMES}
    safe["print"] = printer
    safe["__import__"] = _restricted_import(tuple(allowed_imports))
    return {"__builtins__": safe, "__name__": filename}


@contextlib.contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`CallTimeout` in the block after ``seconds`` of wall clock.

    Uses ``SIGALRM``, so it only works on the main thread; elsewhere it does nothing
    (the isolated probe has already shown that the program returns in time).
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _on_alarm(signum: int, frame: Any) -> None:
        raise CallTimeout(f"a call took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class CompiledProgram:
    """A checked program's entry function with its bounded ``print``.

    Calling it runs the entry under :func:`call_deadline` (once per row of the batch
    with ``per_row=True``: :func:`call_per_row`); exceptions propagate.
    """

    def __init__(self, fn: Callable[..., Any], program: Program, printer: _BoundedPrint, filename: str) -> None:
        self.fn = fn
        self.program = program
        self.printer = printer
        self.filename = filename

    def __call__(self, *args: Any, timeout_s: float = 0.0, per_row: bool = False) -> Any:
        if per_row:
            return call_per_row(self, args, timeout_s)
        self.printer.reset()
        with call_deadline(timeout_s):
            return self.fn(*args)


def compile_program(
    program: Program,
    *,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
    arg_names: list[str] | tuple[str, ...] | None = None,
    max_output_chars: int = Limits.max_output_chars,
    timeout_s: float = Limits.call_timeout_s,
    _skip_check: bool = False,
) -> CompiledProgram:
    """Check ``program`` and execute its module body in a restricted namespace.

    ``_skip_check`` is for tests of the isolation layer only: it skips the AST check
    and exposes the real builtins.

    :return: a callable running ``program.entry``.
    :raises SandboxError: on any failed check or an error in the module body.
    """
    if not _skip_check:
        report = check_source(program.source, program.entry, arg_names=arg_names, allowed_imports=allowed_imports)
        if not report.ok:
            raise SandboxError(report)
    filename = f"<{program.entry}>"
    # Register the source so tracebacks show the offending lines.
    linecache.cache[filename] = (len(program.source), None, program.source.splitlines(True), filename)
    printer = _BoundedPrint(max_output_chars)
    namespace = _namespace(allowed_imports, printer, filename)
    if _skip_check:
        namespace["__builtins__"] = builtins
    try:
        code = compile(program.source, filename, "exec")
        with call_deadline(timeout_s):
            exec(code, namespace)  # noqa: S102 - the point of this module
    except SyntaxError as e:
        raise SandboxError(_fail("syntax", f"SyntaxError on line {e.lineno}: {e.msg}")) from None
    except BaseException as e:  # noqa: BLE001 - anything the module body does is data
        if isinstance(e, KeyboardInterrupt):
            raise
        raise SandboxError(report_exception(e, filename)) from None
    fn = namespace.get(program.entry)
    if not callable(fn):
        raise SandboxError(_fail("signature", f"`{program.entry}` is not a function after running the code."))
    return CompiledProgram(fn, program, printer, filename)


def report_exception(exc: BaseException, filename: str) -> SandboxReport:
    """Classify an exception raised by program code and format Eureka-style feedback."""
    if isinstance(exc, CallTimeout):
        return _fail("timeout", f"Timeout: {exc}. Make the function faster (vectorise over the batch, no long loops).")
    if isinstance(exc, OutputLimit):
        return _fail("output", f"Too much output: {exc}. Remove print calls.")
    text = str(exc)
    if isinstance(exc, MemoryError) or "can't allocate memory" in text or "DefaultCPUAllocator" in text:
        return _fail("memory", f"Out of memory: {type(exc).__name__}: {text[:300]}. Allocate less.")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    lines = ["Traceback (most recent call last):"]
    for f in frames[-4:]:
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.line:
            lines.append(f"    {f.line.strip()}")
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    lines.append(last[:500])
    full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _fail("exception", "\n".join(lines), detail=full[-4000:])


# -------------------------------------------------------------------------------------
# Output validation (used in the child on the probe, and in-process on every call)
# -------------------------------------------------------------------------------------


class _Invalid(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _as_float_batch(value: Any, batch: int, what: str, *, allow_scalar: bool = False, ndim: int = 1) -> torch.Tensor:
    """``value`` as a float32 tensor ``[B]`` (``ndim=1``) or ``[B, k]`` (``ndim=2``)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    elif allow_scalar and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise _Invalid("dtype", f"{what} must be a torch tensor, got {type(value).__name__}.")
    if not (value.is_floating_point()):
        raise _Invalid("dtype", f"{what} must have a float dtype, got {value.dtype} (use .float()).")
    value = value.detach()
    if allow_scalar and value.dim() == 0:
        value = value.expand(batch)
    if ndim == 2 and value.dim() == 1 and value.shape[0] == batch:
        value = value.unsqueeze(-1)  # one feature
    expected = f"[{batch}]" if ndim == 1 else f"[{batch}, k]"
    if value.dim() != ndim or value.shape[0] != batch:
        raise _Invalid("shape", f"{what} must have shape {expected} (one value per env of the batch), got {list(value.shape)}.")
    value = value.to(torch.float32)
    if not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise _Invalid("nonfinite", f"{what} has {bad} NaN or infinite value(s); guard divisions, logs and exps.")
    return value


def _batch_size(args: tuple[Any, ...]) -> int:
    for arg in args:
        if isinstance(arg, dict):
            for v in arg.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    return int(v.shape[0])
        elif isinstance(arg, torch.Tensor) and arg.dim() > 0:
            return int(arg.shape[0])
    raise ValueError("cannot tell the batch size of the arguments")


def _row(arg: Any, i: int) -> Any:
    """Row ``i`` of a batched argument (a tensor, or a dict of tensors)."""
    if isinstance(arg, dict):
        return {k: (v[i] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in arg.items()}
    if isinstance(arg, torch.Tensor) and arg.dim() > 0:
        return arg[i]
    return arg


def _stack_rows(values: list[Any], what: str) -> torch.Tensor:
    """One value per row (a number, or a ``[k]`` vector) -> ``[B]`` or ``[B, k]``."""
    rows = []
    for v in values:
        t = torch.as_tensor(v.detach() if isinstance(v, torch.Tensor) else v)
        if t.numel() == 1:
            t = t.reshape(())
        if t.dim() > 1:
            raise _Invalid("shape", f"{what} for one state must be a number or a flat vector, got shape {list(t.shape)}.")
        rows.append(t.to(torch.float32) if t.dtype == torch.bool or not t.is_floating_point() else t)
    try:
        return torch.stack(rows)
    except RuntimeError as e:
        raise _Invalid("shape", f"{what} changed shape from one state to the next: {e}") from None


def call_per_row(compiled: "CompiledProgram", args: tuple[Any, ...], timeout_s: float) -> Any:
    """Call a program once per row of the batch and stack the results.

    For programs written for one state (scalar fields, ``[n]`` vector fields; ``if``
    on a value) instead of a batch: their per-row results are stacked into what the
    batched call should have returned (``reward`` or ``(reward, components)``, or
    features). The whole batch runs under one deadline.
    """
    batch = _batch_size(args)
    compiled.printer.reset()
    with call_deadline(timeout_s):
        outs = [compiled.fn(*(_row(a, i) for a in args)) for i in range(batch)]
    if outs and all(isinstance(o, tuple) and len(o) == 2 and isinstance(o[1], dict) for o in outs):
        names = list(outs[0][1])
        comps = {n: _stack_rows([o[1].get(n, 0.0) for o in outs], f"component {n!r}") for n in names}
        return _stack_rows([o[0] for o in outs], "the reward"), comps
    return _stack_rows(outs, "the value")


#: failures of a batched call that a per-row call may not have (not limits: time, memory, output)
PER_ROW_RETRY_KINDS = ("exception", "shape", "dtype")


def normalize_reward(value: Any, batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Check a reward program's return value: ``reward`` or ``(reward, components)``."""
    components: dict[str, torch.Tensor] = {}
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], dict):
            raise _Invalid("dtype", "compute_reward must return `reward` or `(reward, components_dict)`.")
        value, raw = value
        for name, comp in raw.items():
            components[str(name)] = _as_float_batch(comp, batch, f"component {name!r}", allow_scalar=True)
    return _as_float_batch(value, batch, "the reward"), components


def normalize_state(value: Any, batch: int) -> torch.Tensor:
    """Check a state program's return value: features ``[B, k]`` (``[B]`` means k=1)."""
    return _as_float_batch(value, batch, "the features", ndim=2)


def validate_reward(result: Any, args: tuple[Any, ...]) -> SandboxReport:
    """Probe validator for reward programs (runs in the child)."""
    try:
        _, comps = normalize_reward(result, _batch_size(args))
    except _Invalid as e:
        return _fail(e.kind, str(e))
    return SandboxReport(True, "ok", "", data={"components": sorted(comps)})


def validate_state(result: Any, args: tuple[Any, ...]) -> SandboxReport:
    """Probe validator for state programs (runs in the child)."""
    try:
        feats = normalize_state(result, _batch_size(args))
    except _Invalid as e:
        return _fail(e.kind, str(e))
    if feats.shape[1] == 0:
        return _fail("shape", "the features are empty ([B, 0]); return at least one feature.")
    return SandboxReport(True, "ok", "", data={"extra_dim": int(feats.shape[1])})


# -------------------------------------------------------------------------------------
# Isolated run in a child process
# -------------------------------------------------------------------------------------

_MAX_RESULT_BYTES = 1 << 20
#: Imported by the child before its limits are set (lazy imports would need file handles).
ALLOWED_SUBMODULES_TO_PRELOAD = ("math", "numpy", "numpy.linalg", "numpy.random", "numpy.fft", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft", "torch.distributions")


def _child_env() -> dict[str, str]:
    """A minimal environment: no API keys or tokens of the parent reach the child."""
    root = str(Path(__file__).resolve().parent.parent)
    return {
        "PATH": os.defpath,
        "PYTHONPATH": root,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "HOME": "/nonexistent",
    }


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)


def run_isolated(
    program: Program,
    args: tuple[Any, ...],
    *,
    limits: Limits,
    validate: Callable[[Any, tuple[Any, ...]], SandboxReport] | None = None,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
    per_row_retry: bool = False,
    _skip_check: bool = False,
) -> SandboxReport:
    """Run ``program.entry(*args)`` once in a limited child process and report.

    With ``per_row_retry``, a batched call that raises or returns the wrong shape or
    dtype is tried again row by row (:func:`call_per_row`); if that passes, the report
    is ok with ``data["per_row"] = True``.

    The child (:mod:`core.sandbox.worker`) imports torch and numpy, sets its resource
    limits, drops root privileges, then compiles and calls the program with
    ``limits.call_timeout_s``; ``validate(result, args)`` (a picklable function) runs
    in the child too. Only a small JSON report comes back, so nothing the program
    produced is ever unpickled by the caller. The parent enforces ``limits.wall_s``
    and kills the child's process group in every case.

    ``_skip_check`` disables the AST check and the restricted builtins: it exists only
    so tests can show that the process limits hold on their own.
    """
    if not _skip_check:
        report = check_source(program.source, program.entry, allowed_imports=allowed_imports)
        if not report.ok:
            return report
    request = pickle.dumps(
        {
            "program": program,
            "args": args,
            "limits": limits,
            "validate": validate,
            "allowed_imports": tuple(allowed_imports),
            "skip_check": _skip_check,
            "per_row_retry": per_row_retry,
        }
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-B", "-m", "core.sandbox.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, killed as a whole
        env=_child_env(),
        cwd="/",
        close_fds=True,
    )
    out = bytearray()
    timed_out = False
    try:
        threading.Thread(target=_feed, args=(proc, request), daemon=True).start()
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = limits.wall_s - (time.monotonic() - start)
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(timeout=min(left, 0.5)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
                # One JSON line is the whole answer; processes the program forked may
                # hold the pipe open, so do not wait for EOF.
                if b"\n" in out or len(out) > _MAX_RESULT_BYTES:
                    break
        if not timed_out:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, limits.wall_s - (time.monotonic() - start)))
    finally:
        _kill_group(proc)
        if proc.stdout:
            proc.stdout.close()
    if timed_out:
        return _fail("timeout", f"Timeout: the program did not finish within {limits.wall_s:g} s of wall clock.")
    return _parse_child(bytes(out), proc.returncode, limits)


def _feed(proc: subprocess.Popen[bytes], request: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.write(request)
        proc.stdin.close()


def _parse_child(out: bytes, returncode: int | None, limits: Limits) -> SandboxReport:
    """Turn the child's JSON line (or its death) into a report. Never trusts the bytes."""
    try:
        raw = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1]) if out.strip() else None
    except (ValueError, IndexError):
        raw = None
    if isinstance(raw, dict) and raw.get("kind") in KINDS:
        data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
        return SandboxReport(
            bool(raw.get("ok")) and raw.get("kind") == "ok",
            str(raw["kind"]),
            str(raw.get("message", ""))[:_MESSAGE_CHARS],
            str(raw.get("detail", ""))[:8000],
            data,
        )
    if returncode is not None and returncode < 0:
        sig = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else str(-returncode)
        if -returncode == signal.SIGXCPU:
            return _fail("timeout", f"The program used more than {limits.cpu_s:g} s of CPU time and was killed ({sig}).")
        if -returncode == signal.SIGKILL:
            return _fail("crash", "The program was killed (SIGKILL), most likely by a CPU-time or memory limit.")
        if -returncode == signal.SIGXFSZ:
            return _fail("forbidden", "The program tried to write a file and was killed (SIGXFSZ).")
        return _fail("crash", f"The program crashed the interpreter ({sig}).")
    return _fail("crash", f"The sandbox process exited with status {returncode} without a report.")


def report_to_json(report: SandboxReport) -> str:
    """One line of JSON for the child-to-parent channel."""
    return json.dumps(asdict(report), default=str)


# -------------------------------------------------------------------------------------
# Probe states and the in-process callables
# -------------------------------------------------------------------------------------


def probe_batch(task: Task, *, num_envs: int = 4, steps: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Real transitions of ``task`` under random actions: ``(obs, action, next_obs)``.

    Batched as ``[num_envs * steps, ...]``; ``next_obs`` is the true last observation
    when an episode ended (not the auto-reset one).
    """
    env = task.make_env(num_envs, seed=seed)
    try:
        obs, _ = env.reset(seed=seed)
        env.action_space.seed(seed)
        obs_l, act_l, next_l = [], [], []
        for _ in range(steps):
            action = env.action_space.sample()
            nxt, _, _, _, info = env.step(action)
            true_next = np.array(nxt, dtype=np.float32, copy=True)
            mask = info.get("_final_obs") if isinstance(info, dict) else None
            if mask is not None:
                for i in np.flatnonzero(mask):
                    true_next[i] = info["final_obs"][i]
            obs_l.append(np.asarray(obs, dtype=np.float32))
            act_l.append(np.asarray(action))
            next_l.append(true_next)
            obs = nxt
    finally:
        env.close()
    return (
        torch.as_tensor(np.concatenate(obs_l)),
        torch.as_tensor(np.concatenate(act_l)),
        torch.as_tensor(np.concatenate(next_l)),
    )


def _clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # A fresh dict of copies: in-place edits by the program cannot touch the trainer's tensors.
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


class RewardFunction:
    """A probed reward program: ``(state, action, next_state) -> (reward [B], components)``.

    Each call runs in-process on the batch under a wall-clock timer; the result is
    checked (float, ``[B]``, finite) and returned as float32. Failures raise
    :class:`SandboxError`. Pickles as its program (recompiled on load).
    """

    def __init__(self, compiled: CompiledProgram, *, call_timeout_s: float, components: tuple[str, ...] = (), allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS, per_row: bool = False) -> None:
        self.compiled = compiled
        self.program = compiled.program
        self.call_timeout_s = call_timeout_s
        self.component_names = tuple(components)
        self.allowed_imports = tuple(allowed_imports)
        self.per_row = per_row  # the probe found it written for one state: map it over the batch

    def __call__(self, state: dict[str, torch.Tensor], action: torch.Tensor, next_state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args = (_clone_state(state), action.clone(), _clone_state(next_state))
        try:
            value = self.compiled(*args, timeout_s=self.call_timeout_s, per_row=self.per_row)
            return normalize_reward(value, _batch_size(args))
        except _Invalid as e:
            raise SandboxError(_fail(e.kind, str(e))) from None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001
            raise SandboxError(report_exception(e, self.compiled.filename)) from None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (RewardFunction, self.program, self.call_timeout_s, self.allowed_imports,
                           {"components": self.component_names, "per_row": self.per_row}))


class StateFunction:
    """A probed state program: ``state -> features [B, extra_dim]`` (float32)."""

    def __init__(self, compiled: CompiledProgram, *, call_timeout_s: float, extra_dim: int, allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS, per_row: bool = False) -> None:
        self.compiled = compiled
        self.program = compiled.program
        self.call_timeout_s = call_timeout_s
        self.extra_dim = int(extra_dim)
        self.allowed_imports = tuple(allowed_imports)
        self.per_row = per_row

    def __call__(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        args = (_clone_state(state),)
        try:
            value = self.compiled(*args, timeout_s=self.call_timeout_s, per_row=self.per_row)
            feats = normalize_state(value, _batch_size(args))
        except _Invalid as e:
            raise SandboxError(_fail(e.kind, str(e))) from None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001
            raise SandboxError(report_exception(e, self.compiled.filename)) from None
        if feats.shape[1] != self.extra_dim:
            raise SandboxError(_fail("shape", f"the features changed width from {self.extra_dim} to {feats.shape[1]}."))
        return feats

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (StateFunction, self.program, self.call_timeout_s, self.allowed_imports,
                           {"extra_dim": self.extra_dim, "per_row": self.per_row}))


def _rebuild(cls: type, program: Program, call_timeout_s: float, allowed_imports: tuple[str, ...], extra: dict[str, Any]) -> Any:
    compiled = compile_program(program, allowed_imports=allowed_imports)
    return cls(compiled, call_timeout_s=call_timeout_s, allowed_imports=allowed_imports, **extra)


def _probe_and_compile(program: Program, args: tuple[Any, ...], arg_names: tuple[str, ...], validate: Callable[..., SandboxReport], limits: Limits, allowed_imports: tuple[str, ...]) -> tuple[CompiledProgram, SandboxReport]:
    report = check_source(program.source, program.entry, arg_names=arg_names, allowed_imports=allowed_imports)
    if not report.ok:
        raise SandboxError(report)
    report = run_isolated(program, args, limits=limits, validate=validate, allowed_imports=allowed_imports,
                          per_row_retry=limits.per_row_fallback)
    if not report.ok:
        raise SandboxError(report)
    if report.data.get("per_row"):
        program.meta["per_row"] = True  # for the caller; trainings log sandbox/<role>_per_row
    compiled = compile_program(program, allowed_imports=allowed_imports, arg_names=arg_names, max_output_chars=limits.max_output_chars, timeout_s=limits.call_timeout_s)
    return compiled, report


@contextlib.contextmanager
def _name_fields_on_key_error(task: Task) -> Iterator[None]:
    """A KeyError on the state is usually a made-up field name: list the real ones."""
    try:
        yield
    except SandboxError as e:
        if "KeyError" in e.report.message:
            names = ", ".join(f.name for f in task.state_fields)
            e.report.message += f"\nThe state has exactly these fields: {names}."
        raise


def prepare_reward(program: RewardProgram, task: Task, *, limits: Limits | None = None, allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS, probe_envs: int = 4, probe_steps: int = 4) -> RewardFunction:
    """Check, probe on real states of ``task`` in the isolated child, then compile.

    With ``limits.per_row_fallback``, a program written for one state rather than a
    batch is accepted and runs once per row (:func:`call_per_row`): slower, but correct.

    :raises SandboxError: with the report of the first failure.
    """
    limits = limits or Limits()
    obs, action, next_obs = probe_batch(task, num_envs=probe_envs, steps=probe_steps)
    args = (task.split_state(obs), action, task.split_state(next_obs))
    with _name_fields_on_key_error(task):
        compiled, report = _probe_and_compile(program, args, REWARD_ARGS, validate_reward, limits, allowed_imports)
    return RewardFunction(compiled, call_timeout_s=limits.call_timeout_s, components=tuple(report.data.get("components", ())),
                          allowed_imports=allowed_imports, per_row=bool(report.data.get("per_row")))


def prepare_state(program: StateProgram, task: Task, *, limits: Limits | None = None, allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS, probe_envs: int = 4, probe_steps: int = 4) -> StateFunction:
    """Like :func:`prepare_reward` for ``revise_state(state) -> [B, k]``; sets ``program.extra_dim``."""
    limits = limits or Limits()
    obs, _, _ = probe_batch(task, num_envs=probe_envs, steps=probe_steps)
    with _name_fields_on_key_error(task):
        compiled, report = _probe_and_compile(program, (task.split_state(obs),), STATE_ARGS, validate_state, limits, allowed_imports)
    extra_dim = int(report.data["extra_dim"])
    program.extra_dim = extra_dim
    return StateFunction(compiled, call_timeout_s=limits.call_timeout_s, extra_dim=extra_dim, allowed_imports=allowed_imports,
                         per_row=bool(report.data.get("per_row")))
