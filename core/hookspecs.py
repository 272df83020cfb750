"""Hook specifications: every point where a plugin can take part in a run.

A plugin is a module (or object) with functions decorated ``@core.hookimpl`` whose
names match the specs below. Implementations may accept any subset of a spec's
arguments, so specs can grow without breaking plugins.

The roles follow the LLM-for-RL taxonomy: reward function, state representation,
action (code-as-policy), skills planning, environment generation, preference labels.
Each run goes through these stages::

    on_run_start
    for iteration in range(run.iterations):
        on_iteration_start
        plan / propose_rewards / propose_state_reprs / propose_actions / generate_envs
            -> the loop combines the proposals into candidates
        train_candidates (a population method trains them jointly), or
        for each candidate (through the executor):
            on_train_start
            per step, as TorchRL transforms: compute_reward, represent_state
            on_rollout (each collected batch)     on_evaluation (each periodic eval)
            on_train_end
        reflect (each plugin turns the iteration's results into its next context)
        on_iteration_end
    on_run_end

Context objects: ``run`` is a :class:`core.loop.Run` (config, task, LLM client,
sandbox, tracker, iteration history); ``train`` is a :class:`core.context.TrainContext`
(the candidate, the task, frames done and budget, the plugin configs, a metrics logger).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from core.envs.task import Task
    from core.records import (
        Candidate,
        EnvConfig,
        IterationResult,
        MacroAction,
        RewardProgram,
        StateProgram,
        TrainResult,
    )
    from core.context import RunContext, StepBatch, TrainContext

PROJECT = "llm4rl"
hookspec = pluggy.HookspecMarker(PROJECT)


# -------------------------------------------------------------------------------------
# Registration
# -------------------------------------------------------------------------------------


@hookspec
def register_tasks() -> dict[str, type[Task]] | None:
    """Contribute tasks (environments) beyond the built-in ones.

    Called once when the task named by ``env.name`` is looked up.

    :return: a mapping of task name to a :class:`core.envs.task.Task` subclass whose
        constructor takes the ``env`` config's keys as keyword arguments; or None.
    """


# -------------------------------------------------------------------------------------
# Run lifecycle (observers: every implementation is called, results are ignored)
# -------------------------------------------------------------------------------------


@hookspec
def on_run_start(run: RunContext) -> None:
    """Called once before the first iteration, after the task and LLM client exist.

    Plugins read their config from ``run.plugin_config(name)`` and may set up state
    (e.g. a few-shot library, a case base) here.

    :param run: the run context.
    """


@hookspec
def on_iteration_start(run: RunContext, iteration: int) -> None:
    """Called at the start of every outer iteration (0-based)."""


@hookspec
def on_iteration_end(run: RunContext, result: IterationResult) -> None:
    """Called after every candidate of an iteration is trained, scored and reflected on."""


@hookspec
def on_run_end(run: RunContext, best: tuple[Candidate, TrainResult] | None) -> None:
    """Called once after the last iteration (and the final multi-seed retrain, if any).

    :param best: the best candidate over all iterations and its result, or None when
        every candidate failed.
    """


# -------------------------------------------------------------------------------------
# Proposal hooks: one per LLM role. Called once per outer iteration, in the main
# process. Each returns a list of alternatives (or None to abstain); the loop forms
# candidates as the cartesian product of the roles that proposed something.
# ``feedback`` is this plugin's own reflection text from the previous iteration.
# -------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def plan(run: RunContext, iteration: int) -> str | None:
    """Skills planning: decompose the task into sub-goals (RL-GPT's slow agent, ELLM).

    Called before the other proposal hooks; the plan is stored in ``run.plan`` so that
    they can condition on it, and attached to every candidate of the iteration.

    :return: the plan as text, or None. Stops at first non-None result.
    """


@hookspec
def propose_rewards(run: RunContext, iteration: int) -> list[RewardProgram] | None:
    """Reward role: write reward functions as code (Eureka, Text2Reward, LaRes).

    Each :class:`core.records.RewardProgram` is compiled and probed by the sandbox
    before training; a program that fails becomes a failed candidate whose error text
    reaches this plugin's :func:`reflect`.

    :return: the programs to try this iteration, or None to abstain.
    """


@hookspec
def propose_state_reprs(run: RunContext, iteration: int) -> list[StateProgram] | None:
    """State-representation role: write feature code appended to the observation (LESR).

    :return: the programs to try this iteration, or None.
    """


@hookspec
def propose_actions(run: RunContext, iteration: int) -> list[list[MacroAction]] | None:
    """Action role: write coded skills added to the action space (RL-GPT's fast agent).

    :return: alternatives, each a list of macro-actions trained together; or None.
    """


@hookspec
def generate_envs(run: RunContext, iteration: int) -> list[list[EnvConfig]] | None:
    """Environment-generation role: write training-environment configs (EnvGen).

    Each config sets values for the task's controllable ``params``; the trainer splits
    its vectorised envs among the configs of a set by weight, and the original env keeps
    the share ``train.original_env_share`` when the plugin asks for a mix.

    :return: alternatives, each a set of env configs trained together; or None.
    """


@hookspec(firstresult=True)
def train_candidates(run: RunContext, candidates: list[Candidate], seed: int) -> list[TrainResult] | None:
    """Train an iteration's candidates jointly instead of one by one (population methods).

    Called in the main process with the candidates not yet trained. Population-based
    methods (LaRes: a population of reward functions with one policy each, a shared
    replay buffer, and LLM updates during training) take over training here and return
    one :class:`core.records.TrainResult` per candidate, in order.

    The contract: an implementation trains each candidate as the executor would. It
    honours every part of the candidate (reward program, state program, macro-actions,
    env configs), builds each member's env with the core's machinery
    (:class:`core.train.common.CandidateEnv`) so that the per-step hooks
    (``compute_reward``, ``represent_state``) fire with a :class:`TrainContext` per
    member, and calls ``on_train_start`` / ``on_rollout`` / ``on_evaluation`` /
    ``on_train_end`` for each. A candidate it cannot honour gets a failed result
    (``ok=False``, ``error_kind="unsupported"``, an error naming the part), never a
    silent drop. Failures are results with ``ok=False``, never exceptions.

    :return: the results, or None to let the executor train each candidate on its own
        (an implementation returns None for candidates it did not propose). Stops at
        first non-None result.
    """


# -------------------------------------------------------------------------------------
# Training hooks: called inside the process that trains a candidate (the main process
# for the in-process executor, a worker otherwise). Plugin state set up here lives in
# that process.
# -------------------------------------------------------------------------------------


@hookspec
def on_train_start(train: TrainContext) -> None:
    """Called before a candidate's training starts (after envs and policy exist)."""


@hookspec
def compute_reward(train: TrainContext, batch: StepBatch) -> torch.Tensor | None:
    """Per-step reward role for online judges (progress reward, preference reward models).

    Called on every collected step of every env, batched. ``batch.reward`` holds the
    reward so far (the candidate's reward program if any, else the env's own);
    ``batch.env_reward`` the env's own. Must be fast: never block on an LLM (queue the
    work and use what is ready).

    :return: a ``[B]`` float tensor ADDED to the reward (return ``new - batch.reward``
        to replace it), or None.
    """


@hookspec
def represent_state(train: TrainContext, obs: torch.Tensor) -> torch.Tensor | None:
    """Per-step state-representation role for learned or online encoders.

    :param obs: the observation ``[B, D]`` (after the candidate's state program).
    :return: extra features ``[B, k]`` appended to the observation (``k`` must not
        change during training), or None.
    """


@hookspec
def on_rollout(train: TrainContext, batch: Any) -> None:
    """Called with each collected batch (a TensorDict ``[envs, steps]``) before the update.

    Judges collect segments or states here (RLAIF preference pairs, progress states).
    """


@hookspec
def on_evaluation(train: TrainContext, frames: int, fitness: float, episodes: list[Any]) -> None:
    """Called after each periodic evaluation during training."""


@hookspec
def on_train_end(train: TrainContext, result: TrainResult) -> None:
    """Called after a candidate's training and final evaluation; may add to ``result.metrics``."""


# -------------------------------------------------------------------------------------
# Preference role
# -------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def label_preferences(run: Any, goal: str, pairs: list[tuple[str, str]]) -> list[float | None] | None:
    """Preference role: which of two described trajectory segments better achieves ``goal``.

    :param pairs: text renderings ``(a, b)`` of segment pairs.
    :return: one label per pair: the probability that a is better, 1.0 (a better),
        0.0 (b better), 0.5 (tie) or anything between (a soft label, e.g. read from the
        judge's token probabilities), None (cannot tell); or None to abstain. Stops at
        first non-None result.
    """


# -------------------------------------------------------------------------------------
# Reflection
# -------------------------------------------------------------------------------------


@hookspec
def reflect(run: RunContext, result: IterationResult) -> str | None:
    """Turn an iteration's results into this plugin's context for the next proposals.

    Called once per iteration in the main process after every candidate is scored.
    A plugin reads the results of the candidates holding its own parts (``origin``),
    keeps what it needs for its next prompt, and returns the feedback text, which the
    loop logs as an artifact.

    :return: feedback text, or None.
    """
