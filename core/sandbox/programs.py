"""Reading, compiling and checking programs; what their values must look like.

- :func:`check_source` parses the code and applies the AST policy of
  :mod:`core.sandbox.policy`. It executes nothing and is the only part of this module
  the trainer and the driver use on LLM code.
- :func:`compile_program` executes a program's module body in a namespace whose
  ``__builtins__`` holds only safe functions and an import hook that allows only the
  configured modules. It runs only in a sandbox worker (:mod:`core.sandbox.worker`);
  elsewhere it refuses.
- :func:`normalize_reward`, :func:`normalize_state` and :func:`shape_result` turn what a
  program returned into checked float tensors (finite, real, one row per state) in the
  worker, with clear feedback; :func:`checked_result` checks the copies that cross back
  again in the host.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import traceback
from typing import Any, Callable

import numpy as np
import torch

from core.codegen import signature_error
from core.namecheck import check_names, state_arguments
from core.records import Program
from core.sandbox.policy import SAFE_BUILTIN_NAMES, annotation_import, find_violation, module_allowed
from core.sandbox.reports import DEFAULT_IMPORTS, Limits, SandboxError, SandboxReport, fail

REWARD_ARGS = ("state", "action", "next_state")
STATE_ARGS = ("state",)
#: failures of a batched call that a per-row call may not have (not limits: time, memory)
PER_ROW_RETRY_KINDS = ("exception", "invalid_value")
#: what a program's result must not exceed, per value (components of a reward, features)
MAX_COMPONENTS = 32
MAX_NAME_CHARS = 64


class OutputLimit(BaseException):
    """The program printed more than it may (BaseException: ``except Exception`` cannot swallow it)."""


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


def check_source(
    source: str,
    entry: str,
    *,
    arg_names: list[str] | tuple[str, ...] | None = None,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
    fields: list[str] | None = None,
) -> SandboxReport:
    """Parse ``source`` and apply the AST policy; nothing is executed.

    With ``fields`` (the task's field names), every field the code reads from its state
    arguments and every free name it uses is checked too (:func:`core.namecheck.check_names`,
    without fixing: fixes are made when a reply is read).

    :return: ``kind`` ``ok``, ``no_code``, ``syntax``, ``forbidden``, ``signature`` or ``names``.
    """
    if not (source or "").strip():
        return fail("no_code", f"No code was given: write `def {entry}(...)`.")
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        line = f"\n    {e.text.strip()}" if e.text else ""
        return fail("syntax", f"SyntaxError on line {e.lineno}: {e.msg}{line}")
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        return fail("syntax", f"The code cannot be parsed: {type(e).__name__}: {e}")
    try:
        problem = find_violation(tree, allowed_imports)
    except RecursionError:
        problem = "the code is nested too deeply"
    if problem:
        return fail(
            "forbidden", f"Forbidden construct: {problem} Use only {', '.join(allowed_imports)} and plain Python."
        )
    report = check_entry(tree, entry, arg_names)
    if report.ok and fields is not None:
        names = check_names(
            source,
            list(fields),
            available=SAFE_BUILTIN_NAMES,
            fix=False,
            state_args=state_arguments(source, entry, arg_names),
        )
        if not names.ok:
            return fail(
                "names", "The code reads names that do not exist:\n" + "\n".join(f"- {e}" for e in names.errors)
            )
    return report


def check_entry(tree: ast.Module, entry: str, arg_names: list[str] | tuple[str, ...] | None) -> SandboxReport:
    """The entry is defined once at the top level, with the expected arguments."""
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry]
    if not defs:
        return fail("signature", f"No top-level function named `{entry}` is defined.")
    if len(defs) > 1:
        return fail("signature", f"`{entry}` is defined {len(defs)} times; define it once.")
    if arg_names is not None:
        err = signature_error(defs[0], entry, list(arg_names))
        if err:
            return fail("signature", err)
    return SandboxReport(True, "ok", "")


def _restricted_import(allowed: tuple[str, ...]) -> Callable[..., Any]:
    def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level != 0 or not (module_allowed(name, allowed) or annotation_import(name, fromlist, allowed)):
            raise ImportError(f"import of {name!r} is not allowed")
        return builtins.__import__(name, globals, locals, fromlist, level)

    return _import


def _namespace(allowed_imports: tuple[str, ...], printer: _BoundedPrint, filename: str) -> dict[str, Any]:
    safe = {name: getattr(builtins, name) for name in SAFE_BUILTIN_NAMES}
    safe["print"] = printer
    safe["__import__"] = _restricted_import(tuple(allowed_imports))
    return {"__builtins__": safe, "__name__": filename}


class CompiledProgram:
    """A checked program's entry function with its bounded ``print`` (in a worker).

    Calling it runs the entry on the arguments (once per row of the batch with
    ``per_row=True``: :func:`call_per_row`); exceptions propagate.
    """

    def __init__(self, fn: Callable[..., Any], program: Program, printer: _BoundedPrint, filename: str) -> None:
        self.fn = fn
        self.program = program
        self.printer = printer
        self.filename = filename

    def __call__(self, *args: Any, per_row: bool = False) -> Any:
        self.printer.reset()
        if per_row:
            return call_per_row(self, args)
        return self.fn(*args)


class _WorkerFlag:
    """Whether this process is a sandbox worker (set once by :mod:`core.sandbox.worker`)."""

    runs_programs = False


def compile_program(
    program: Program,
    *,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
    arg_names: list[str] | tuple[str, ...] | None = None,
    max_output_chars: int = Limits.max_output_chars,
    static_check: bool = True,
) -> CompiledProgram:
    """Check ``program`` and execute its module body in a restricted namespace.

    Only a sandbox worker may call this; in any other process it raises ``RuntimeError``.
    With ``static_check=False`` (tests of the isolation only) the AST check is skipped
    and the program gets the real builtins.

    :return: a callable running ``program.entry``.
    :raises SandboxError: on any failed check or an error in the module body.
    """
    if not _WorkerFlag.runs_programs:
        raise RuntimeError("LLM-written code runs only in a sandbox worker (core.sandbox.ProgramWorker)")
    if static_check:
        report = check_source(program.source, program.entry, arg_names=arg_names, allowed_imports=allowed_imports)
        if not report.ok:
            raise SandboxError(report)
    filename = f"<{program.entry}>"
    # Register the source so tracebacks show the offending lines.
    linecache.cache[filename] = (len(program.source), None, program.source.splitlines(True), filename)
    printer = _BoundedPrint(max_output_chars)
    namespace = _namespace(allowed_imports, printer, filename)
    if not static_check:
        namespace["__builtins__"] = builtins
    try:
        code = compile(program.source, filename, "exec")
        exec(code, namespace)  # the point of this module, in a worker
    except SyntaxError as e:
        raise SandboxError(fail("syntax", f"SyntaxError on line {e.lineno}: {e.msg}")) from None
    except BaseException as e:  # anything the module body does is data
        raise SandboxError(report_exception(e, filename)) from None
    fn = namespace.get(program.entry)
    if not callable(fn):
        raise SandboxError(fail("signature", f"`{program.entry}` is not a function after running the code."))
    return CompiledProgram(fn, program, printer, filename)


def report_exception(exc: BaseException, filename: str) -> SandboxReport:
    """Classify an exception raised by program code and format Eureka-style feedback."""
    if isinstance(exc, OutputLimit):
        return fail("exception", f"Too much output: {exc}. Remove print calls.")
    text = str(exc)
    if isinstance(exc, MemoryError) or "can't allocate memory" in text or "DefaultCPUAllocator" in text:
        return fail("memory", f"Out of memory: {type(exc).__name__}: {text[:300]}. Allocate less.")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    lines = ["Traceback (most recent call last):"]
    for f in frames[-4:]:
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.line:
            lines.append(f"    {f.line.strip()}")
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    lines.append(last[:500])
    full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return fail("exception", "\n".join(lines), detail=full[-4000:])


# -------------------------------------------------------------------------------------
# Values: what programs must return (checked in the worker and again in the host)
# -------------------------------------------------------------------------------------


class Invalid(Exception):
    """A program's value is unusable; ``check`` is the finer kind (``nonfinite``, ``shape``...)."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check

    kind = "invalid_value"

    def report(self) -> SandboxReport:
        return SandboxReport(False, self.kind, str(self), data={"check": self.check})


def _float_rows(
    value: Any, batch: int, what: str, *, allow_scalar: bool = False, ndim: int = 1, finite: bool = True
) -> np.ndarray:
    """``value`` as a float32 array ``[B]`` (``ndim=1``) or ``[B, k]`` (``ndim=2``), checked.

    The checks run on numpy arrays (a microsecond or two each): real float dtype, one row
    per state, and (with ``finite``) every value finite.
    """
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise Invalid("dtype", f"{what} is complex ({value.dtype}); it must be real.")
        if value.layout != torch.strided:
            raise Invalid("dtype", f"{what} is a {value.layout} tensor; return a dense one.")
        try:
            value = value.numpy()  # the common case: a plain CPU tensor
        except (RuntimeError, TypeError):
            try:
                value = value.detach().cpu()
                value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
            except (RuntimeError, TypeError, NotImplementedError) as e:
                raise Invalid("dtype", f"{what} cannot be read ({e}); return a plain CPU tensor.") from None
    elif allow_scalar and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = np.asarray(float(value))
    elif not isinstance(value, np.ndarray):
        raise Invalid("dtype", f"{what} must be a torch tensor, got {type(value).__name__}.")
    kind = value.dtype.kind
    if kind == "c":
        raise Invalid("dtype", f"{what} is complex ({value.dtype}); it must be real.")
    if kind != "f":
        raise Invalid("dtype", f"{what} must have a float dtype, got {value.dtype} (use .float()).")
    if allow_scalar and value.ndim == 0:
        value = np.full((batch,), value, dtype=np.float32)
    if ndim == 2 and value.ndim == 1 and value.shape[0] == batch:
        value = value[:, None]  # one feature
    if value.ndim != ndim or value.shape[0] != batch:
        expected = f"[{batch}]" if ndim == 1 else f"[{batch}, k]"
        raise Invalid(
            "shape", f"{what} must have shape {expected} (one value per env of the batch), got {list(value.shape)}."
        )
    out = value.astype(np.float32, copy=False)
    if finite:
        bad = out.size - int(np.isfinite(out).sum())
        if bad:
            raise Invalid("nonfinite", f"{what} has {bad} NaN or infinite value(s); guard divisions, logs and exps.")
    return out


def _as_float_batch(value: Any, batch: int, what: str, *, allow_scalar: bool = False, ndim: int = 1) -> torch.Tensor:
    """:func:`_float_rows` as a float32 tensor."""
    out = _float_rows(value, batch, what, allow_scalar=allow_scalar, ndim=ndim)
    return torch.from_numpy(out if out.flags.writeable else out.copy())


def batch_size(args: tuple[Any, ...]) -> int:
    """The batch size of a program's arguments: the first dimension of the first tensor."""
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
        return type(arg)({k: (v[i] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in arg.items()})
    if isinstance(arg, torch.Tensor) and arg.dim() > 0:
        return arg[i]
    return arg


def _stack_rows(values: list[Any], what: str) -> torch.Tensor:
    """One value per row (a number, or a ``[k]`` vector) -> ``[B]`` or ``[B, k]``."""
    rows = []
    for v in values:
        t = torch.as_tensor(v.detach() if isinstance(v, torch.Tensor) else v)
        if t.is_complex():
            raise Invalid("dtype", f"{what} for one state is complex ({v!r:.40}); it must be real.")
        if t.numel() == 1:
            t = t.reshape(())
        if t.dim() > 1:
            raise Invalid(
                "shape", f"{what} for one state must be a number or a flat vector, got shape {list(t.shape)}."
            )
        rows.append(t.to(torch.float32) if t.dtype == torch.bool or not t.is_floating_point() else t)
    try:
        return torch.stack(rows)
    except RuntimeError as e:
        raise Invalid("shape", f"{what} changed shape from one state to the next: {e}") from None


def call_per_row(compiled: CompiledProgram, args: tuple[Any, ...]) -> Any:
    """Call a program once per row of the batch and stack the results.

    For programs written for one state (scalar fields, ``[n]`` vector fields; ``if``
    on a value) instead of a batch: their per-row results are stacked into what the
    batched call should have returned (``reward`` or ``(reward, components)``, or
    features). The whole batch is one call for the deadline.
    """
    batch = batch_size(args)
    outs = [compiled.fn(*(_row(a, i) for a in args)) for i in range(batch)]
    if outs and all(isinstance(o, tuple) and len(o) == 2 and isinstance(o[1], dict) for o in outs):
        names = list(outs[0][1])
        comps = {n: _stack_rows([o[1].get(n, 0.0) for o in outs], f"component {n!r}") for n in names}
        return _stack_rows([o[0] for o in outs], "the reward"), comps
    return _stack_rows(outs, "the value")


def _component_name(name: Any) -> str:
    text = str(name)
    if not text or len(text) > MAX_NAME_CHARS or not text.isprintable():
        raise Invalid(
            "dtype", f"reward component names must be short printable strings, got {text[:MAX_NAME_CHARS]!r}."
        )
    return text


def normalize_reward(value: Any, batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Check a reward program's return value: ``reward`` or ``(reward, components)``."""
    components: dict[str, torch.Tensor] = {}
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], dict):
            raise Invalid("dtype", "compute_reward must return `reward` or `(reward, components_dict)`.")
        value, raw = value
        if len(raw) > MAX_COMPONENTS:
            raise Invalid("shape", f"at most {MAX_COMPONENTS} reward components, got {len(raw)}.")
        for name, comp in raw.items():
            components[_component_name(name)] = _as_float_batch(comp, batch, f"component {name!r}", allow_scalar=True)
    return _as_float_batch(value, batch, "the reward"), components


def normalize_state(value: Any, batch: int) -> torch.Tensor:
    """Check a state program's return value: features ``[B, k]`` (``[B]`` means k=1)."""
    return _as_float_batch(value, batch, "the features", ndim=2)


def normalize_value(value: Any) -> torch.Tensor:
    """Any other program's value (a macro's action or flag) as a small real tensor."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
    elif isinstance(value, np.ndarray) and value.dtype != object:
        t = torch.from_numpy(value)
    elif isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise Invalid("dtype", f"the value {value} is too large.")
        t = torch.tensor(value.item() if isinstance(value, np.generic) else value)
    else:
        raise Invalid("dtype", f"the function must return a number, a bool or a tensor, got {type(value).__name__}.")
    if t.is_complex():
        raise Invalid("dtype", f"the value is complex ({t.dtype}); it must be real.")
    if t.numel() > 1 << 16:
        raise Invalid("shape", f"the value has {t.numel()} elements; return one number.")
    return t


def shape_result(role: str, value: Any, batch: int) -> tuple[list[tuple[str, Any]], list[str]]:
    """A program's value, checked, as named arrays that can cross to the host (in the worker); with names.

    ``reward``: one float32 block ``[1 + C, B]`` (the reward, then each component) and
    the component names; ``state``: ``features`` ``[B, k]`` float32; ``value``: a small
    tensor. The messages for the LLM about types and shapes come from here; the host
    checks its copy for what its safety needs (shape, finite), and says which part is
    not finite.
    """
    if role == "reward":
        comps: dict[str, np.ndarray] = {}
        if isinstance(value, tuple):
            if len(value) != 2 or not isinstance(value[1], dict):
                raise Invalid("dtype", "compute_reward must return `reward` or `(reward, components_dict)`.")
            value, raw = value
            if len(raw) > MAX_COMPONENTS:
                raise Invalid("shape", f"at most {MAX_COMPONENTS} reward components, got {len(raw)}.")
            comps = {
                _component_name(k): _float_rows(v, batch, f"component {k!r}", allow_scalar=True, finite=False)
                for k, v in raw.items()
            }
        reward = _float_rows(value, batch, "the reward", finite=False)
        return [("block", np.stack([reward, *comps.values()]))], list(comps)
    if role == "state":
        return [("features", _float_rows(value, batch, "the features", ndim=2, finite=False))], []
    return [("value", normalize_value(value))], []


class State(dict):
    """A task state as a program receives it: field name -> batched tensor.

    Read a field as ``state.pole_angle`` or ``state["pole_angle"]`` (``state.device`` is the
    tensors' device, the one attribute that is not a field); an unknown one raises
    with the fields the state has (``AttributeError`` / ``KeyError``), so that even a name
    the static check could not see comes back as feedback that says what to use.
    """

    __slots__ = ()

    @property
    def device(self) -> Any:
        """The device its tensors live on, as a tensor's ``.device`` (``torch.zeros(n, device=state.device)``)."""
        if "device" in self:  # a task's own field of that name wins
            return self["device"]
        found = next((v.device for v in self.values() if isinstance(v, torch.Tensor)), None)
        return found if found is not None else torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the state has no field {name!r}; its fields are: {', '.join(self)}") from None

    def __missing__(self, key: Any) -> Any:
        raise KeyError(f"{key!r} is not a field of the state; its fields are: {', '.join(self)}")


def split_fields(obs: Any, fields: list[tuple[str, int, int, tuple[int, ...]]], *, tensors: bool = False) -> State:
    """Name the fields of a batched observation (a tensor or an array), as ``Task.split_state`` does.

    With ``tensors``, numpy parts come out as torch tensors (sharing memory).
    """
    out = State()
    for name, start, stop, shape in fields:
        if stop - start == 1 and not shape:
            part = obs[..., start]
        else:
            part = obs[..., start:stop]
            if shape:
                part = part.reshape(*obs.shape[:-1], *shape)
        out[name] = torch.from_numpy(part) if tensors and isinstance(part, np.ndarray) else part
    return out


def task_fields(task: Any) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """A task's program fields (derived ones included) as plain tuples (for :func:`split_fields` in a worker).

    They index :meth:`core.envs.task.Task.program_obs`, not the raw observation.
    """
    fields = getattr(task, "program_fields", None) or task.state_fields
    return [(f.name, int(f.start), int(f.stop), tuple(int(d) for d in f.shape)) for f in fields]


def component_names(names: Any) -> list[str]:
    """Component names that crossed from a worker: a list of short printable strings (or Invalid)."""
    if not isinstance(names, list) or len(names) > MAX_COMPONENTS:
        raise Invalid("shape", f"at most {MAX_COMPONENTS} reward components.")
    return [_component_name(n) if isinstance(n, str) else _component_name(repr(n)) for n in names]


#: the largest magnitude a reward or feature may have: training sums rewards over thousands of steps and the
#: critic squares the sums, so float32 (at most 3.4e38) overflows to inf or NaN losses long before a value does
MAX_MAGNITUDE = 1e12


def _check_magnitude(values: np.ndarray, what: str) -> None:
    peak = float(np.abs(values).max()) if values.size else 0.0
    if peak > MAX_MAGNITUDE:
        raise Invalid(
            "magnitude",
            f"{what} reaches {peak:.3g} in magnitude; values beyond {MAX_MAGNITUDE:.0e} overflow "
            "float32 training (returns sum thousands of steps and the critic squares them). "
            "Scale it down: keep each term within about +-100.",
        )


def checked_result(role: str, named: list[tuple[str, np.ndarray]], names: list[str], batch: int) -> Any:
    """The host's check of what crossed back, on its own copy: the worker is not trusted.

    ``reward``: ``(reward [B], {name: [B]})`` from a float32 block ``[1 + C, B]``;
    ``state``: features ``[B, k]`` float32; both finite. ``value``: a small tensor.
    """
    if role == "reward":
        if len(named) != 1 or named[0][0] != "block":
            raise Invalid("dtype", "the worker returned no reward.")
        block = named[0][1]
        if block.dtype != np.float32 or block.shape != (1 + len(names), batch):
            raise Invalid(
                "shape", f"the reward and its components must be [{batch}] each, got a block of {list(block.shape)}."
            )
        finite = np.isfinite(block)
        if not finite.all():
            bad = block.shape[1] - finite.sum(axis=1)
            row = int(np.flatnonzero(bad)[0])
            what = "the reward" if row == 0 else f"component {names[row - 1]!r}"
            raise Invalid(
                "nonfinite", f"{what} has {int(bad[row])} NaN or infinite value(s); guard divisions, logs and exps."
            )
        _check_magnitude(block[0], "the reward")
        rows = torch.from_numpy(block).unbind(0)
        return rows[0], dict(zip(names, rows[1:]))
    if role == "state":
        if len(named) != 1 or named[0][0] != "features":
            raise Invalid("dtype", "the worker returned no features.")
        feats = named[0][1]
        if feats.dtype != np.float32 or feats.ndim != 2 or feats.shape[0] != batch:
            raise Invalid("shape", f"the features must be [{batch}, k], got {list(feats.shape)} of {feats.dtype}.")
        bad = feats.size - int(np.isfinite(feats).sum())
        if bad:
            raise Invalid(
                "nonfinite", f"the features have {bad} NaN or infinite value(s); guard divisions, logs and exps."
            )
        _check_magnitude(feats, "the features")
        return torch.from_numpy(feats)
    if len(named) != 1 or named[0][0] != "value":
        raise Invalid("dtype", "the worker returned no value.")
    return normalize_value(named[0][1])


def validate_reward(result: Any, args: tuple[Any, ...]) -> SandboxReport:
    """Probe validator for reward programs: ``reward [B]`` or ``(reward, components)``."""
    try:
        _, comps = normalize_reward(result, batch_size(args))
    except Invalid as e:
        return e.report()
    return SandboxReport(True, "ok", "", data={"components": sorted(comps)})


def validate_state(result: Any, args: tuple[Any, ...]) -> SandboxReport:
    """Probe validator for state programs: features ``[B, k]`` with ``k >= 1``."""
    try:
        feats = normalize_state(result, batch_size(args))
    except Invalid as e:
        return e.report()
    if feats.shape[1] == 0:
        return fail("invalid_value", "the features are empty ([B, 0]); return at least one feature.")
    return SandboxReport(True, "ok", "", data={"extra_dim": int(feats.shape[1])})
