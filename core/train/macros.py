"""Macro-actions: coded skills added to a discrete action space (RL-GPT's code-as-policy).

RL-GPT (Liu et al., 2024, "RL-GPT: Integrating Reinforcement Learning and Code-as-policy")
lets an LLM write some skills as code and has the RL agent choose among them and the
primitive actions. Here a candidate's :class:`~core.records.MacroAction` list extends a
``Discrete(n)`` action space to ``Discrete(n + len(macros))``: action ``n + j`` runs macro
``j``, a program ``entry(state) -> primitive action``, step after step, until it has run
``max_steps`` steps, ``done_entry(state)`` is true on the new state, or the episode ends.
The agent sees one transition whose reward is the sum of the primitive rewards (a
semi-MDP option; the discount is not adjusted for the option's length).

Calling convention: ``state`` maps the task's field names (its derived fields included,
:attr:`core.envs.task.Task.program_fields`) to tensors of ONE env, batched as ``[1, ...]``
(the same layout as reward programs see, with a batch of one): the worker names the
columns of ``task.program_obs(obs)``; a field is read as ``state.name`` or ``state["name"]``;
``entry`` returns an int, or a tensor/array holding one integer in ``[0, n)``;
``done_entry`` returns a bool or a one-element tensor. Macros run per env because a
vector env cannot hold some envs still while others run a macro.

Programs are checked by the sandbox (AST policy), loaded into the candidate's worker
process (:class:`core.sandbox.ProgramWorker`) and probed there on a real state of the
task; every call crosses to the worker within ``call_timeout_s`` and its value is
checked here. Failures raise :class:`core.sandbox.SandboxError`, which the trainer turns
into a failed candidate with the report as feedback.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from core.envs.task import Task
from core.records import MacroAction, Program

STATE_ARGS = ("state",)


def _as_action(value: Any, n_actions: int, name: str) -> int:
    """A macro's return value as a primitive action index; ValueError with feedback if not."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if (value.size if isinstance(value, np.ndarray) else value.numel()) != 1:
            shape = list(value.shape)
            raise ValueError(f"macro {name!r} must return one action (an int), got shape {shape}.")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"macro {name!r} must return an int action, got {type(value).__name__}.")
    if float(value) != int(value) or not 0 <= int(value) < n_actions:
        raise ValueError(f"macro {name!r} returned {value!r}; actions are the integers 0..{n_actions - 1}.")
    return int(value)


def _as_flag(value: Any, name: str) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if (value.size if isinstance(value, np.ndarray) else value.numel()) != 1:
            raise ValueError(f"done function of macro {name!r} must return one bool, got shape {list(value.shape)}.")
        value = value.item()
    if not isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        raise ValueError(f"done function of macro {name!r} must return a bool, got {type(value).__name__}.")
    return bool(value)


def validate_action(result: Any, args: tuple[Any, ...], *, n_actions: int, name: str) -> Any:
    """Probe validator (in the host, on the value that crossed back): one valid primitive action."""
    from core.sandbox import SandboxReport

    try:
        _as_action(result, n_actions, name)
    except ValueError as e:
        return SandboxReport(False, "invalid_value", str(e))
    return SandboxReport(True, "ok", "")


def validate_flag(result: Any, args: tuple[Any, ...], *, name: str) -> Any:
    """Probe validator for ``done_entry``: one bool."""
    from core.sandbox import SandboxReport

    try:
        _as_flag(result, name)
    except ValueError as e:
        return SandboxReport(False, "invalid_value", str(e))
    return SandboxReport(True, "ok", "")


@dataclass
class CompiledMacro:
    """A checked macro: handles of its entry (and done) functions in the worker."""

    name: str
    act: int  # handle of state -> action in the worker
    done: int | None  # handle of state -> bool, or None
    max_steps: int


class MacroSet:
    """The candidate's macros, loaded in a worker; wraps vector envs and counts calls.

    ``calls[name]`` counts how often the policy picked each macro (training and
    evaluation alike) and ``env_steps`` the primitive steps they ran. A set that
    started its own worker (none was given to :meth:`prepare`) ends it on :meth:`close`
    or when it is collected.
    """

    def __init__(self, macros: list[CompiledMacro], task: Task, worker: Any, *, owns_worker: bool = False) -> None:
        from core.sandbox import task_fields

        self.macros, self.task, self.worker, self.owns_worker = macros, task, worker, owns_worker
        self.fields = task_fields(task)
        self.calls = {m.name: 0 for m in macros}
        self.env_steps = 0

    @classmethod
    def prepare(
        cls,
        macros: list[MacroAction],
        task: Task,
        *,
        limits: Any = None,
        allowed_imports: tuple[str, ...] | None = None,
        probe: bool = True,
        worker: Any = None,
    ) -> MacroSet:
        """Check every macro, load it into ``worker`` (a new one if None) and probe it on a real state.

        :raises core.sandbox.SandboxError: with the first failing program's report.
        """
        from core import sandbox

        limits = limits or sandbox.Limits()
        imports = tuple(allowed_imports or sandbox.DEFAULT_IMPORTS)
        names = [m.name for m in macros]
        if len(set(names)) != len(names):
            raise ValueError(f"macro names must be unique, got {names}")
        for macro in macros:
            if int(macro.max_steps) < 1:
                raise ValueError(f"macro {macro.name!r}: max_steps must be >= 1")
        n_actions = _discrete_actions(task)
        obs, _, _ = sandbox.probe_batch(task, num_envs=1, steps=1)
        obs = program_obs(task, obs)
        owns = worker is None
        worker = worker if worker is not None else sandbox.ProgramWorker(limits, imports)
        try:
            compiled = [cls._load(m, worker, obs[:1], n_actions, limits, imports, probe, task) for m in macros]
        except BaseException:
            if owns:
                worker.close()
            raise
        return cls(compiled, task, worker, owns_worker=owns)

    @staticmethod
    def _load(
        macro: MacroAction,
        worker: Any,
        obs: torch.Tensor,
        n_actions: int,
        limits: Any,
        imports: tuple[str, ...],
        probe: bool,
        task: Task,
    ) -> CompiledMacro:
        from core import sandbox

        checks = [(macro.program, functools.partial(validate_action, n_actions=n_actions, name=macro.name))]
        if macro.done_entry:
            checks.append(
                (replace(macro.program, entry=macro.done_entry), functools.partial(validate_flag, name=macro.name))
            )
        handles = []
        for program, validate in checks:
            program = (
                Program(program.source, program.entry) if type(program) is not Program else program
            )  # a value, not a reward
            try:
                if limits.static_check:
                    from core.sandbox.functions import fields_line, task_field_names

                    report = sandbox.check_source(
                        program.source,
                        program.entry,
                        arg_names=STATE_ARGS,
                        allowed_imports=imports,
                        fields=task_field_names(task),
                    )
                    if not report.ok:
                        if report.kind == "names":
                            report.message += "\n" + fields_line(task)
                        raise sandbox.SandboxError(report)
                if probe:
                    handle, _ = sandbox.probe(
                        worker,
                        program,
                        (obs,),
                        arg_names=STATE_ARGS,
                        validate=validate,
                        per_row_fallback=False,
                        fields=sandbox.task_fields(task),
                        split=(0,),
                    )
                else:
                    handle = worker.load(program, role="value", arg_names=STATE_ARGS, fields=sandbox.task_fields(task))
            except sandbox.SandboxError as e:
                e.report.message = f"macro {macro.name!r} ({program.entry}): {e.report.message}"
                raise sandbox.SandboxError(e.report) from None
            handles.append(handle)
        return CompiledMacro(macro.name, handles[0], handles[1] if len(handles) > 1 else None, int(macro.max_steps))

    def close(self) -> None:
        """End the worker if this set started it."""
        if self.owns_worker:
            self.worker.close()

    # -- running ----------------------------------------------------------------------
    def _call(self, handle: int, obs: np.ndarray, name: str) -> Any:
        from core import sandbox

        row = program_obs(self.task, torch.as_tensor(np.asarray(obs, dtype=np.float32)).reshape(1, -1))
        try:
            return self.worker.call(handle, (row,), role="value", split=(0,))
        except sandbox.SandboxError as e:
            e.report.message = f"macro {name!r}: {e.report.message}"
            raise sandbox.SandboxError(e.report) from None

    def action(self, j: int, obs: np.ndarray, n_actions: int) -> int:
        macro = self.macros[j]
        return self._checked(lambda: _as_action(self._call(macro.act, obs, macro.name), n_actions, macro.name))

    def finished(self, j: int, obs: np.ndarray) -> bool:
        macro = self.macros[j]
        if macro.done is None:
            return False
        return self._checked(lambda: _as_flag(self._call(macro.done, obs, macro.name), macro.name))

    @staticmethod
    def _checked(get: Any) -> Any:
        from core import sandbox

        try:
            return get()
        except ValueError as e:
            raise sandbox.SandboxError(sandbox.SandboxReport(False, "invalid_value", str(e))) from None

    # -- envs -------------------------------------------------------------------------
    def wrap(self, vec: gym.vector.VectorEnv) -> gym.vector.VectorEnv:
        """Give every sub-env of a vector env the macro actions (in place); returns it.

        Works with any vector env that steps a list of gymnasium envs in ``.envs``
        (``SyncVectorEnv``, Crafter's vector env).
        """
        envs = getattr(vec, "envs", None)
        if not isinstance(envs, list) or not envs:
            raise ValueError(
                f"macro-actions need a vector env that steps a list of envs (.envs), got {type(vec).__name__}"
            )
        vec.envs = [MacroEnv(e, self) for e in envs]  # type: ignore[attr-defined]
        vec.single_action_space = vec.envs[0].action_space  # type: ignore[attr-defined]
        vec.action_space = gym.vector.utils.batch_space(vec.single_action_space, vec.num_envs)
        return vec

    def metrics(self) -> dict[str, float]:
        out = {f"macros/{name}_calls": float(n) for name, n in self.calls.items()}
        out["macros/env_steps"] = float(self.env_steps)
        return out


def program_obs(task: Task, obs: torch.Tensor) -> torch.Tensor:
    """``obs[..., :obs_dim]`` widened by the task's derived fields: the columns ``task_fields(task)`` index."""
    widen = getattr(task, "program_obs", None)
    return widen(obs) if widen is not None else obs[..., : task.obs_dim]


def _discrete_actions(task: Task) -> int:
    env = task.make_env(1, 0, None)
    try:
        space = env.single_action_space
    finally:
        env.close()
    if not isinstance(space, gym.spaces.Discrete):
        raise ValueError(f"macro-actions need a discrete action space; {task.name} has {space}")
    return int(space.n)


class MacroEnv(gym.Wrapper):
    """One env with ``Discrete(n + k)`` actions: ``n + j`` runs macro ``j`` to its end.

    Every step's info has ``env_steps``: the primitive steps it took.
    """

    def __init__(self, env: gym.Env, macros: MacroSet) -> None:
        super().__init__(env)
        self.n = int(env.action_space.n)  # type: ignore[attr-defined]
        self.macros = macros
        self.action_space = gym.spaces.Discrete(self.n + len(macros.macros))
        self._obs: Any = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        action = int(action)
        if action < self.n:
            obs, reward, term, trunc, info = self.env.step(action)
            self._obs = obs
            info["env_steps"] = 1
            return obs, reward, term, trunc, info  # type: ignore[return-value]
        j = action - self.n
        macro = self.macros.macros[j]
        self.macros.calls[macro.name] += 1
        total, steps = 0.0, 0
        while True:
            primitive = self.macros.action(j, self._obs, self.n)
            obs, reward, term, trunc, info = self.env.step(primitive)
            self._obs = obs
            total += float(reward)
            steps += 1
            if term or trunc or steps >= macro.max_steps or self.macros.finished(j, obs):
                break
        self.macros.env_steps += steps
        info["env_steps"] = steps
        return obs, total, term, trunc, info
