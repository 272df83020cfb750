"""Hook specifications: every point where a plugin can take part in a run.

A plugin is a module with a typed ``Config`` (a dataclass subclassing
:class:`core.PluginConfig`) and a class ``Plugin`` whose methods decorated
``@core.hookimpl`` are named after the specs below. The framework makes one
``Plugin(config)`` per run (and one per worker process for training hooks), so state
that lasts a run lives on the object, never at module level. Implementations may
accept any subset of a spec's arguments, so specs can grow without breaking plugins.
A misspelt hook or an argument a spec does not pass is refused before any work, with
the closest name. (A module of plain ``@hookimpl`` functions is registered as it is:
stateless plugins only.)

The roles follow the LLM-for-RL taxonomy: reward function, state representation,
action (code-as-policy), skills planning, environment generation, preference labels.
Each run goes through these stages::

    on_run_start
    for iteration in range(run.iterations):
        on_iteration_start
        plan / propose_rewards / propose_state_reprs / propose_actions / generate_envs
            -> the loop combines the proposals into candidates
        prepare_candidates (how they train: a continued policy, a budget of their own)
        train_candidates (a population method trains them jointly), or
        for each candidate (through the executor):
            on_train_start
            per step, as TorchRL transforms: compute_reward, represent_state
            per step, in the collection policy: action_prior
            on_rollout (each collected batch)     on_evaluation (each periodic eval)
            on_train_end
        reflect (each plugin turns the iteration's results into its next context)
        on_iteration_end
    on_run_end

A plugin's ``iterations`` (:class:`core.PluginConfig`) are the rounds it takes part in.
The run has as many as its largest plugin's; from iteration ``iterations`` on, the
loop no longer calls that plugin's ``plan``, proposal hooks or ``reflect``, so no
implementation compares ``iteration`` with its own config. Its other hooks (lifecycle,
``prepare_candidates``, ``train_candidates``, the training hooks) are called in every
iteration: a later candidate may still hold its parts.

Contexts (:mod:`core.context`, documented field by field in
``docs/writing-a-plugin.md``): ``run`` is a :class:`core.context.RunContext` (the
validated settings, ``plugin_config(name)`` as typed dataclasses, the typed ``sandbox``
limits, the task, the LLM client, the iteration history and best candidate, the plan,
MLflow logging); ``train`` is a :class:`core.context.TrainContext` (the same settings,
task and LLM client, plus the candidate, frames done and budget, metric and text logging,
and ``state``, a dict keyed by plugin name for per-training objects); ``batch`` is a
:class:`core.context.StepBatch` (one batched step: ``obs``, ``action``, ``next_obs``,
``env_reward``, ``reward``, ``done``, and ``state`` / ``next_state`` by field name).

Broadcast hooks whose results the core keeps (the proposal hooks, ``reflect``,
``action_prior``) are called through :func:`core.registry.call_each`: through pluggy
once per plugin, so each result is credited to the plugin that returned it and a
wrapper (``@hookimpl(wrapper=True)``) wraps each plugin's result.

The specs here are the framework's: hooks the core calls. A hook that one plugin calls
for itself (e.g. ``label_preferences``, asked by ``rlaif_preference`` for its labels) is
that plugin's: it declares the spec in a ``HOOKSPECS`` class of ``@hookspec`` functions
in its module, which the plugin manager adds before registering any plugin (pytest's
``pytest_addhooks``). Another plugin answers such a hook with
``@hookimpl(optionalhook=True)``, so it still loads in a run without the owner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterator

    import torch

    from core.context import ActionPrior, RunContext, StepBatch, TrainContext
    from core.envs.task import Task
    from core.records import (
        Candidate,
        EnvConfig,
        IterationResult,
        MacroAction,
        Plan,
        RewardProgram,
        StateProgram,
        TrainResult,
    )

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

    The plugin object is already new for this run and holds its typed config; set up
    what needs the run here (e.g. load a few-shot library from ``run.settings.run.cache_dir``),
    or refuse a task the method cannot handle with :class:`core.errors.UserError`.

    :param run: the run context.
    """


@hookspec
def on_iteration_start(run: RunContext, iteration: int) -> None:
    """Called at the start of every outer iteration.

    :param run: the run context.
    :param iteration: the iteration number, 0-based.
    """


@hookspec
def on_iteration_end(run: RunContext, result: IterationResult) -> None:
    """Called after every candidate of an iteration is trained, scored and reflected on.

    :param run: the run context (``run.history`` already holds ``result``).
    :param result: the iteration's candidates and their results, in order.
    """


@hookspec
def on_run_end(run: RunContext, best: tuple[Candidate, TrainResult] | None) -> None:
    """Called once after the last iteration (and the final multi-seed retrain, if any).

    :param run: the run context.
    :param best: the best candidate over all iterations and its result, or None when
        every candidate failed.
    """


# -------------------------------------------------------------------------------------
# Planning role: a plan of steps, made once per outer iteration in the main process and
# consumed by training (``Candidate.plan`` -> ``train.plan``; :mod:`core.plan`).
# -------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def plan(run: RunContext, iteration: int) -> Plan | str | None:
    """Skills planning: decompose the task into steps training follows (Plan4MC, RL-GPT).

    Called before the other proposal hooks. The plan is stored in ``run.plan`` (a
    :class:`core.records.Plan`) so that they can condition on it, attached to every
    candidate of the iteration (``Candidate.plan``) and read in training as
    ``train.plan``: its ``steps`` (:class:`core.records.PlanStep`: ``name``, ``kind``
    ``"skill"`` / ``"goal"`` / ``"rl"``, ``goal_text``, ``done``, the task goal whose
    achievement completes the step) say what to do in order. A training-side plugin
    follows them with :class:`core.plan.PlanFollower` (the active step of each env, a
    reward for completing it, the active step as policy input through
    ``compute_reward`` / ``represent_state``); ``plan.text`` is the form for logs and
    prompts. Check a plan with :func:`core.plan.check_plan` before returning it and send
    its errors (unknown skills, goals the task cannot check) back to the LLM; a plan
    that stays wrong is dropped by the planner, never raised.

    :param run: the run context.
    :param iteration: the iteration number, 0-based; below the plugin's ``iterations``
        (it is not asked after them).
    :return: a :class:`core.records.Plan` (plain text is kept as a plan of no steps), or
        None. Stops at first non-None result.
    """


# -------------------------------------------------------------------------------------
# Proposal hooks: one per LLM role. Called once per outer iteration, in the main
# process, while the iteration is below the plugin's ``iterations`` (never after: the
# loop skips the plugin). Each returns a list of alternatives (or None to abstain); the loop forms
# candidates as the cartesian product of the roles that proposed something.
# Each part a plugin returns gets ``origin=<plugin name>`` unless it set one, so the
# plugin's ``reflect`` can find the candidates holding its parts.
#
# Instead of a list, a hook may return an iterator of groups, each a list of
# alternatives, as they become ready (e.g. one group per LLM request as it lands:
# :meth:`core.llm.LLMClient.chat_groups`). Joined, the groups are the list the hook
# would have returned; the iterator should give at least one alternative in all. When
# its role is the only one proposing and no plugin implements ``prepare_candidates`` or
# ``train_candidates``, the loop checks and trains each group's candidates while the
# next group is made (:meth:`core.loop.Loop.train_each`); otherwise it reads the
# iterator to its end first. Either way the candidates, their names and the parts'
# order are the same. State the plugin sets while producing the groups is in place
# once the iterator ends, before ``reflect``.
# -------------------------------------------------------------------------------------


@hookspec
def propose_rewards(run: RunContext, iteration: int) -> list[RewardProgram] | Iterator[list[RewardProgram]] | None:
    """Reward role: write reward functions as code (Eureka, Text2Reward, LaRes).

    Each :class:`core.records.RewardProgram` is compiled and probed by the sandbox
    before training; a program that fails becomes a failed candidate whose error text
    reaches this plugin's :func:`reflect`.

    :param run: the run context.
    :param iteration: the iteration number, 0-based.
    :return: the programs to try this iteration (a list, or an iterator of groups of
        them as they are written; see the section above), or None to abstain.
    """


@hookspec
def propose_state_reprs(run: RunContext, iteration: int) -> list[StateProgram] | Iterator[list[StateProgram]] | None:
    """State-representation role: write feature code appended to the observation (LESR).

    Each :class:`core.records.StateProgram` computes ``[B, k]`` features from the task's
    named state fields; the trainer appends them to the policy's observation.

    :param run: the run context.
    :param iteration: the iteration number, 0-based.
    :return: the programs to try this iteration, or None.
    """


@hookspec
def propose_actions(run: RunContext, iteration: int) -> list[list[MacroAction]] | None:
    """Action role: write coded skills added to the action space (RL-GPT's fast agent).

    :param run: the run context (``run.plan`` holds this iteration's plan).
    :param iteration: the iteration number, 0-based.
    :return: alternatives, each a list of macro-actions trained together; or None.
    """


@hookspec
def generate_envs(run: RunContext, iteration: int) -> list[list[EnvConfig]] | None:
    """Environment-generation role: write training-environment configs (EnvGen).

    Each config sets values for the task's controllable ``params``; the trainer splits
    its vectorised envs among the configs of a set by weight, and the original env keeps
    the share ``train.original_env_share`` when the plugin asks for a mix.

    :param run: the run context.
    :param iteration: the iteration number, 0-based.
    :return: alternatives, each a set of env configs trained together; or None.
    """


@hookspec
def prepare_candidates(run: RunContext, candidates: list[Candidate]) -> None:
    """Set how this iteration's candidates train, before any of them does.

    Called in the main process once the proposals are combined, before the results
    store is asked for them. An implementation sets the training fields of the
    candidates its parts are in (never of others'): ``start`` (continue an earlier
    candidate's policy: :meth:`core.records.StartPolicy.of` its candidate and result,
    which exists when that candidate had ``keep_policy``), ``frames`` (a budget of its
    own instead of ``trainer.frames``), ``original_after`` (the share of the frames
    trained last on the original env) and ``keep_policy``. The loop's ``final_seeds``
    retrains a continued candidate's whole chain on each fresh seed. While any plugin
    implements this hook, the loop reads every proposal to its end before training.

    :param run: the run context (``run.history`` holds the earlier iterations).
    :param candidates: the iteration's candidates, to change in place.
    """


@hookspec(firstresult=True)
def train_candidates(run: RunContext, candidates: list[Candidate], seed: int) -> list[TrainResult | None] | None:
    """Train an iteration's candidates jointly instead of one by one (population methods).

    Called in the main process with the candidates not yet trained, before the
    executor. A method whose candidates learn together (a population sharing experience,
    updated by the LLM during training) takes over their training here and returns one
    :class:`core.records.TrainResult` per candidate, in order.

    The contract: an implementation trains each candidate as the executor would. It
    honours every part of the candidate (reward program, state program, macro-actions,
    env configs), so that the per-step hooks (``compute_reward``, ``represent_state``)
    fire with a :class:`TrainContext` per member, and calls ``on_train_start`` /
    ``on_rollout`` / ``on_evaluation`` / ``on_train_end`` for each. A candidate it
    cannot honour gets a failed result (``ok=False``, ``error_kind="unsupported"``, an
    error naming the part), never a silent drop. Failures are results with
    ``ok=False``, never exceptions. Per-member objects go in each member's
    ``TrainContext.state``, never on the plugin. :class:`core.plugin.Population` keeps
    this contract for off-policy agents over a shared replay (LaRes): the plugin gives
    it the method (which member acts, when a member's reward is rewritten) as a body.

    :param run: the run context.
    :param candidates: the candidates still to train (finished ones were reused).
    :param seed: the seed to train them under.
    :return: one result per candidate, in order, with None in place of each candidate
        left to the executor (one the implementation did not propose); or None to let
        the executor train every candidate on its own. Stops at first non-None result.
    """


# -------------------------------------------------------------------------------------
# Training hooks: called inside the process that trains a candidate (the main process
# for the in-process executor, a worker otherwise, which has its own plugin objects).
# Per-training objects go in ``train.state[<plugin name>]``: several trainings may run
# interleaved in one process, each with its own TrainContext.
# -------------------------------------------------------------------------------------


@hookspec
def on_train_start(train: TrainContext) -> None:
    """Called before a candidate's training starts (after envs and policy exist).

    Make per-training objects here (a judge, a reward model) and keep them in
    ``train.state[<plugin name>]``; the per-step hooks of the same training find them
    there. ``represent_state`` runs once before this hook (to size the observation), so
    objects it needs are made on first use.

    :param train: the training context of the candidate.
    """


@hookspec
def compute_reward(train: TrainContext, batch: StepBatch) -> torch.Tensor | None:
    """Per-step reward role for online judges (progress reward, preference reward models).

    Called on every collected step of every env, batched. ``batch.reward`` holds the
    reward so far (the candidate's reward program if any, else the env's own);
    ``batch.env_reward`` the env's own. Must be fast: never block on an LLM (queue the
    work and use what is ready).

    :param train: the training context.
    :param batch: one batched step: ``obs`` / ``next_obs`` ``[B, D]`` (the task's own
        observation; ``next_obs`` of a step that ended an episode is its final
        observation), ``action``, ``env_reward`` / ``reward`` ``[B]``, ``done`` ``[B]``,
        ``state`` / ``next_state`` by field name, ``task``.
    :return: a ``[B]`` float tensor ADDED to the reward (return ``new - batch.reward``
        to replace it), or None.
    """


@hookspec
def represent_state(train: TrainContext, obs: torch.Tensor) -> torch.Tensor | None:
    """Per-step state-representation role for learned or online encoders.

    Also called once with a reset observation when the trainer builds the envs, before
    ``on_train_start``, to learn the number of features.

    :param train: the training context.
    :param obs: the observation ``[B, D]`` (after the candidate's state program).
    :return: extra features ``[B, k]`` appended to the observation (``k`` must not
        change during training), or None.
    """


@hookspec
def on_rollout(train: TrainContext, batch: Any) -> None:
    """Called with each collected batch (a TensorDict ``[envs, steps]``) before the update.

    Judges collect segments or states here (RLAIF preference pairs, progress states).

    :param train: the training context (``train.frames`` counts the batch).
    :param batch: the collected TensorDict, read-only.
    """


@hookspec
def on_evaluation(train: TrainContext, frames: int, fitness: float, episodes: list[Any]) -> None:
    """Called after each periodic evaluation during training.

    :param train: the training context.
    :param frames: training frames done at this evaluation.
    :param fitness: the task's ground-truth fitness of the evaluation episodes.
    :param episodes: the evaluation episodes (:class:`core.records.Episode`).
    """


@hookspec
def on_train_end(train: TrainContext, result: TrainResult) -> None:
    """Called after a candidate's training and final evaluation (also when it failed).

    Release per-training objects (``train.state``) and record final numbers.

    :param train: the training context.
    :param result: the candidate's result; a plugin may add to ``result.metrics``.
    """


# -------------------------------------------------------------------------------------
# Action role, per step: a prior the policy is combined with (SayCan, RLingua). Called
# inside the training process like the other training hooks.
# -------------------------------------------------------------------------------------


@hookspec
def action_prior(train: TrainContext, obs: torch.Tensor) -> ActionPrior | None:
    """Per-step action role: a prior over actions that the trainer combines with its policy.

    Called on every collection step with the observations of all training envs (PPO also
    on its evaluation steps). Must be fast: never block on an LLM (score in the
    background, cache, and cover only the rows that are ready with ``mask``).

    Fill the half of :class:`core.context.ActionPrior` that fits the action space:
    discrete actions (PPO) ``log_probs [B, n]`` (finite; ``n`` counts macros), added to
    the policy's logits times ``weight``; continuous ones (SAC) ``mean [B, A]`` and
    ``std``, acted instead of the actor with probability ``prob`` per row (anneal it with
    ``train.progress``), and ``imitation`` to pull the actor towards the prior's actions.
    A prior of the wrong kind or shape fails the candidate with an error naming the
    plugin, which reaches its :func:`reflect`; a plugin running LLM-written code should
    check that code's output and log its failure (``train.log_text``) instead.
    :mod:`core.train.action_prior` says how each trainer combines priors.

    :param train: the training context (``train.progress`` for annealing; per-training
        objects in ``train.state[<plugin name>]``).
    :param obs: the task's observations ``[B, obs_dim]`` (before any feature a state
        program appends; ``train.task.split_state(obs)`` names the fields).
    :return: an :class:`core.context.ActionPrior` over these ``B`` rows, or None to abstain
        at this step.
    """


# -------------------------------------------------------------------------------------
# Reflection
# -------------------------------------------------------------------------------------


@hookspec
def reflect(run: RunContext, result: IterationResult) -> str | None:
    """Turn an iteration's results into this plugin's context for the next proposals.

    Called once per iteration in the main process after every candidate is scored,
    up to the plugin's last iteration (``iterations``; it is not asked after). A plugin
    reads the results of the candidates holding its own parts (``origin``),
    keeps what it needs for its next prompt (on the plugin object), and returns the
    feedback text, which the loop saves as ``reflection/it<k>-<plugin>.md`` under the
    plugin that returned it.

    :param run: the run context.
    :param result: the iteration's candidates and their results, in order.
    :return: feedback text, or None.
    """


# -------------------------------------------------------------------------------------
# Repair: a failing program goes back to the plugin that wrote it before a new sample
# -------------------------------------------------------------------------------------


@hookspec
def repair_program(run: RunContext, program: RewardProgram, error: str) -> RewardProgram | None:
    """Fix a program of this plugin's that failed before training (repair, not resample).

    Called in the main process by :mod:`core.preflight` on the plugin that proposed the
    program only (the one ``program.origin`` names), at most ``vetting.repair`` times
    per program, when it fails its static check, its probe on real states, or reward
    vetting on reference trajectories (:mod:`core.vetting`: it ranks failed episodes
    above successful ones, or pays for prolonging an episode the task wants ended). A
    typical implementation sends the conversation that produced the program, its reply
    and ``error`` back to the LLM and asks for the corrected function. The repaired
    program is checked again; one that passes trains in the original's place.

    :param run: the run context.
    :param program: the failing program (``program.reply`` holds the LLM reply it came from).
    :param error: why it failed, in words meant for the LLM.
    :return: the corrected program, or None to let it fail (its error then reaches
        :func:`reflect` like any failed candidate's).
    """
