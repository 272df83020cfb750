"""Reward and state programs as callables for the trainer, backed by a worker process.

:func:`prepare_reward` / :func:`prepare_state` check a program (AST policy), load it
into a :class:`~core.sandbox.host.ProgramWorker`, probe it on real states of the task
and return a :class:`RewardFunction` / :class:`StateFunction`. Every call crosses to
the worker and back; the result is checked again in the host (finite, real, float32,
one row per state). :func:`run_isolated` is the one-shot form: a fresh worker, one
call, a report.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from core.envs.task import task_steps
from core.records import Program, RewardProgram, StateProgram
from core.sandbox.host import ProgramWorker
from core.sandbox.programs import (
    REWARD_ARGS,
    STATE_ARGS,
    Invalid,
    batch_size,
    check_source,
    task_fields,
    validate_reward,
    validate_state,
)
from core.sandbox.reports import DEFAULT_IMPORTS, Limits, SandboxError, SandboxReport

if TYPE_CHECKING:  # pragma: no cover
    from core.envs.task import Task

Validator = Callable[[Any, tuple[Any, ...]], SandboxReport]


def role_of(program: Program) -> str:
    """How a program's value is shaped: ``reward``, ``state`` or ``value`` (anything else)."""
    return "reward" if isinstance(program, RewardProgram) else "state" if isinstance(program, StateProgram) else "value"


def _retry_per_row(report: SandboxReport) -> bool:
    """Failures of a batched call that a program written for one state would have."""
    return report.kind == "exception" or (
        report.kind == "invalid_value" and report.data.get("check") in ("shape", "dtype")
    )


def probe(
    worker: ProgramWorker,
    program: Program,
    args: tuple[Any, ...],
    *,
    arg_names: tuple[str, ...] | None,
    validate: Validator | None,
    per_row_fallback: bool,
    fields: list[Any] | None = None,
    split: tuple[int, ...] = (),
) -> tuple[int, SandboxReport]:
    """Load ``program`` and call it once on ``args``; ``(handle, report)`` (a passed report).

    With ``per_row_fallback``, a batched call that raises or returns the wrong shape or
    dtype is tried again row by row; if that passes, ``report.data["per_row"]`` is True.
    ``validate(result, args)`` runs here, in the host, on the checked copy of the result.
    ``fields`` and ``split`` pass observations for the worker to name (:meth:`ProgramWorker.call`).

    :raises SandboxError: with the report of the first failure.
    """
    role = role_of(program)
    handle = worker.load(program, role=role, arg_names=arg_names, fields=fields)
    batch = batch_size(args) if role != "value" else 0

    def attempt(per_row: bool) -> Any:
        return worker.call(
            handle, args, role=role, batch=batch, per_row=per_row, count=False, printed=True, split=split
        )

    note = ""
    try:
        result, per_row = attempt(False), False
    except SandboxError as batched:
        if not (per_row_fallback and worker.alive and _retry_per_row(batched.report)):
            raise
        try:
            result, per_row = attempt(True), True
        except SandboxError:
            raise batched from None
        note = (
            f"the batched call failed ({batched.report.message.splitlines()[-1][:200]}); "
            "called once per state instead\n"
        )
    report = validate(result, args) if validate is not None else SandboxReport(True, "ok", "")
    if not report.ok:
        raise SandboxError(report)
    if per_row:
        report.data["per_row"] = True
    printed = f"[stdout]\n{worker.last_printed}" if worker.last_printed else ""
    report.detail = (note + report.detail + "\n" + printed).strip()
    return handle, report


def run_isolated(
    program: Program,
    args: tuple[Any, ...],
    *,
    limits: Limits | None = None,
    validate: Validator | None = None,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
    per_row_retry: bool = False,
    _skip_check: bool = False,
) -> SandboxReport:
    """Run ``program.entry(*args)`` once in a fresh worker and report; the worker is gone after.

    The value is shaped by the program's type (:func:`role_of`) and ``validate(result,
    args)`` judges it in the host. ``_skip_check`` (tests only) turns the static check
    off, like ``Limits(static_check=False)``.
    """
    limits = limits or Limits()
    if _skip_check:
        limits = replace(limits, static_check=False)
    if limits.static_check:
        report = check_source(program.source, program.entry, allowed_imports=allowed_imports)
        if not report.ok:
            return report
    try:
        with ProgramWorker(limits, allowed_imports) as worker:
            _, report = probe(worker, program, args, arg_names=None, validate=validate, per_row_fallback=per_row_retry)
    except SandboxError as e:
        return e.report
    return report


# -- probe states -------------------------------------------------------------------------------------


def probe_batch(
    task: Task, *, num_envs: int = 4, steps: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Real transitions of ``task`` under random actions: ``(obs, action, next_obs)``.

    Batched as ``[num_envs * steps, ...]``; ``next_obs`` is the true last observation
    when an episode ended (not the auto-reset one). The steps are
    :func:`core.envs.task.task_steps`'s; observations as float32.
    """
    batch = list(task_steps(task, num_envs, steps, seed))
    return (
        torch.as_tensor(np.concatenate([np.asarray(s.obs, np.float32) for s in batch])),
        torch.as_tensor(np.concatenate([s.action for s in batch])),
        torch.as_tensor(np.concatenate([np.asarray(s.next_obs, np.float32) for s in batch])),
    )


# -- the callables --------------------------------------------------------------------------------------


class _WorkerFunction:
    """A program loaded in a worker; pickles as its program and reloads lazily (no probe)."""

    role = "value"

    def __init__(
        self,
        worker: ProgramWorker | None,
        handle: int | None,
        program: Program,
        *,
        limits: Limits,
        allowed_imports: tuple[str, ...],
        owns_worker: bool,
        per_row: bool = False,
        fields: list[Any] | None = None,
        widen: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.worker, self.handle, self.program = worker, handle, program
        self.widen = widen  # the task's program_obs: appends its derived fields' columns (None: nothing to add)
        self.limits, self.allowed_imports = limits, tuple(allowed_imports)
        self.owns_worker = owns_worker
        self.per_row = per_row  # the probe found it written for one state: map it over the batch
        self.fields = fields  # the task's state fields, for calls on whole observations
        self.call_timeout_s = limits.call_timeout_s

    def _call(self, args: tuple[Any, ...], batch: int, split: tuple[int, ...] = ()) -> Any:
        if self.worker is None or self.handle is None:  # unpickled: a worker of its own
            self.worker = ProgramWorker(self.limits, self.allowed_imports)
            self.owns_worker = True
            self.handle = self.worker.load(self.program, role=self.role, fields=self.fields)
        return self.worker.call(self.handle, args, role=self.role, batch=batch, per_row=self.per_row, split=split)

    def close(self) -> None:
        """End the worker if this function started it (a shared worker is closed by its owner)."""
        if self.owns_worker and self.worker is not None:
            self.worker.close()

    def metrics(self) -> dict[str, float]:
        return self.worker.metrics() if self.worker is not None else {}

    def _extra(self) -> dict[str, Any]:
        return {"per_row": self.per_row, "fields": self.fields, "widen": self.widen}

    def _obs(self, obs: torch.Tensor) -> torch.Tensor:
        return self.widen(obs) if self.widen is not None else obs

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.program, self.limits, self.allowed_imports, self._extra()))


def _rebuild(
    cls: type, program: Program, limits: Limits, allowed_imports: tuple[str, ...], extra: dict[str, Any]
) -> Any:
    return cls(None, None, program, limits=limits, allowed_imports=allowed_imports, owns_worker=True, **extra)


class RewardFunction(_WorkerFunction):
    """A probed reward program: ``(state, action, next_state) -> (reward [B], components)``.

    Each call runs in the worker on a copy of the batch, within ``call_timeout_s``; the
    result is checked in the host (float32, ``[B]``, finite). Failures raise
    :class:`SandboxError`.
    """

    role = "reward"

    def __init__(
        self,
        worker: ProgramWorker | None,
        handle: int | None,
        program: Program,
        *,
        limits: Limits,
        allowed_imports: tuple[str, ...],
        owns_worker: bool,
        per_row: bool = False,
        fields: list[Any] | None = None,
        widen: Callable[[torch.Tensor], torch.Tensor] | None = None,
        components: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            worker,
            handle,
            program,
            limits=limits,
            allowed_imports=allowed_imports,
            owns_worker=owns_worker,
            per_row=per_row,
            fields=fields,
            widen=widen,
        )
        self.component_names = tuple(components)

    def __call__(
        self, state: dict[str, torch.Tensor], action: torch.Tensor, next_state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args = (state, action, next_state)
        return self._call(args, batch_size(args))

    def from_obs(
        self, obs: torch.Tensor, action: torch.Tensor, next_obs: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The same on whole observations ``[B, obs_dim]``, named in the worker (fewer tensors cross)."""
        if self.fields is None:
            raise ValueError("this reward function was prepared without the task's fields")
        return self._call((self._obs(obs), action, self._obs(next_obs)), int(obs.shape[0]), split=(0, 2))

    def _extra(self) -> dict[str, Any]:
        return {**super()._extra(), "components": self.component_names}


class StateFunction(_WorkerFunction):
    """A probed state program: ``state -> features [B, extra_dim]`` (float32, finite)."""

    role = "state"

    def __init__(
        self,
        worker: ProgramWorker | None,
        handle: int | None,
        program: Program,
        *,
        limits: Limits,
        allowed_imports: tuple[str, ...],
        owns_worker: bool,
        per_row: bool = False,
        fields: list[Any] | None = None,
        widen: Callable[[torch.Tensor], torch.Tensor] | None = None,
        extra_dim: int = 0,
    ) -> None:
        super().__init__(
            worker,
            handle,
            program,
            limits=limits,
            allowed_imports=allowed_imports,
            owns_worker=owns_worker,
            per_row=per_row,
            fields=fields,
            widen=widen,
        )
        self.extra_dim = int(extra_dim)

    def __call__(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        args = (state,)
        return self._checked(self._call(args, batch_size(args)))

    def from_obs(self, obs: torch.Tensor) -> torch.Tensor:
        """The same on whole observations ``[B, obs_dim]``, named in the worker."""
        if self.fields is None:
            raise ValueError("this state function was prepared without the task's fields")
        return self._checked(self._call((self._obs(obs),), int(obs.shape[0]), split=(0,)))

    def _checked(self, feats: torch.Tensor) -> torch.Tensor:
        if feats.shape[1] != self.extra_dim:
            raise SandboxError(
                Invalid("shape", f"the features changed width from {self.extra_dim} to {feats.shape[1]}.").report()
            )
        return feats

    def _extra(self) -> dict[str, Any]:
        return {**super()._extra(), "extra_dim": self.extra_dim}


@contextlib.contextmanager
def _with_fields(task: Task) -> Iterator[None]:
    """Any failure of a program on the task's states carries the fields it may read (feedback).

    The line goes first: the last line of a traceback says what went wrong, and run pages
    and reflections show that line."""
    try:
        yield
    except SandboxError as e:
        if e.report.kind in ("exception", "invalid_value", "signature"):
            e.report.message = fields_line(task) + "\n" + e.report.message
        raise


def fields_line(task: Task) -> str:
    """``The state has exactly these fields: a, b, c.`` (derived fields included)."""
    return f"The state has exactly these fields: {', '.join(task_field_names(task))}."


def _prepare(
    program: Program,
    args: tuple[Any, ...],
    split: tuple[int, ...],
    arg_names: tuple[str, ...],
    validate: Validator,
    task: Task,
    limits: Limits,
    allowed_imports: tuple[str, ...],
    worker: ProgramWorker | None,
) -> tuple[ProgramWorker, int, SandboxReport, bool]:
    if limits.static_check:
        report = check_source(
            program.source,
            program.entry,
            arg_names=arg_names,
            allowed_imports=allowed_imports,
            fields=task_field_names(task),
        )
        if not report.ok:
            if report.kind == "names":
                report.message += "\n" + fields_line(task)
            raise SandboxError(report)
    own = worker is None
    worker = worker if worker is not None else ProgramWorker(limits, allowed_imports)
    args = tuple(_widen(task)(a) if i in split else a for i, a in enumerate(args))
    try:
        with _with_fields(task):
            handle, report = probe(
                worker,
                program,
                args,
                arg_names=arg_names,
                validate=validate,
                per_row_fallback=limits.per_row_fallback,
                fields=task_fields(task),
                split=split,
            )
    except BaseException:
        if own:
            worker.close()
        raise
    if report.data.get("per_row"):
        program.meta["per_row"] = True  # for the caller; trainings log sandbox/<role>_per_row
    return worker, handle, report, own


def _widener(task: Task) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The task's ``program_obs`` when it has derived fields to append, else None."""
    return task.program_obs if getattr(task, "derived_fields", None) else None


def _widen(task: Task) -> Callable[[torch.Tensor], torch.Tensor]:
    return _widener(task) or (lambda obs: obs[..., : task.obs_dim])


def task_field_names(task: Task) -> list[str]:
    """The names LLM code may read from the task's states."""
    names = getattr(task, "field_names", None)
    return names() if names else [f.name for f in task.state_fields]


def prepare_reward(
    program: RewardProgram,
    task: Task,
    *,
    limits: Limits | None = None,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
    probe_envs: int = 4,
    probe_steps: int = 4,
    worker: ProgramWorker | None = None,
) -> RewardFunction:
    """Check, load into a worker and probe on real states of ``task``; the reward callable.

    ``worker`` is the candidate's worker (closed by its owner); without one the function
    starts its own, ended by :meth:`RewardFunction.close` or when it is collected. With
    ``limits.per_row_fallback``, a program written for one state rather than a batch is
    accepted and runs once per row: slower, but correct.

    :raises SandboxError: with the report of the first failure.
    """
    limits = limits or Limits()
    obs, action, next_obs = probe_batch(task, num_envs=probe_envs, steps=probe_steps)
    worker, handle, report, own = _prepare(
        program,
        (obs, action, next_obs),
        (0, 2),
        REWARD_ARGS,
        validate_reward,
        task,
        limits,
        tuple(allowed_imports),
        worker,
    )
    return RewardFunction(
        worker,
        handle,
        program,
        limits=limits,
        allowed_imports=tuple(allowed_imports),
        owns_worker=own,
        per_row=bool(report.data.get("per_row")),
        fields=task_fields(task),
        widen=_widener(task),
        components=tuple(report.data.get("components", ())),
    )


def prepare_state(
    program: StateProgram,
    task: Task,
    *,
    limits: Limits | None = None,
    allowed_imports: tuple[str, ...] = DEFAULT_IMPORTS,
    probe_envs: int = 4,
    probe_steps: int = 4,
    worker: ProgramWorker | None = None,
) -> StateFunction:
    """Like :func:`prepare_reward` for ``revise_state(state) -> [B, k]``; sets ``program.extra_dim``."""
    limits = limits or Limits()
    obs, _, _ = probe_batch(task, num_envs=probe_envs, steps=probe_steps)
    worker, handle, report, own = _prepare(
        program, (obs,), (0,), STATE_ARGS, validate_state, task, limits, tuple(allowed_imports), worker
    )
    extra_dim = int(report.data["extra_dim"])
    program.extra_dim = extra_dim
    return StateFunction(
        worker,
        handle,
        program,
        limits=limits,
        allowed_imports=tuple(allowed_imports),
        owns_worker=own,
        per_row=bool(report.data.get("per_row")),
        fields=task_fields(task),
        widen=_widener(task),
        extra_dim=extra_dim,
    )
