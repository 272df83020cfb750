"""What hooks receive: the run context, the training context and one batched step.

Both contexts share :class:`Context`: the run's validated :class:`core.config.Settings`
(``config`` is the composed config, ``plugin_config(name)`` one plugin's typed config,
``sandbox`` the typed sandbox limits), the task, the seed, the LLM client (created on
first use; each call is recorded), logging, and the plugins: ``hook`` calls a hook on
every plugin, ``pluginmanager`` is the run's :class:`pluggy.PluginManager` (setting it
sets ``hook`` too). :class:`RunContext` adds what the outer loop knows
(iteration history, the plan); :class:`TrainContext` adds the candidate being trained
and the frames done.

Plugin state does not live here: a plugin that keeps state is a class, instantiated
once per run (``docs/writing-a-plugin.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from core.config import PluginConfig, SandboxConfig, Settings

if TYPE_CHECKING:  # pragma: no cover
    import pluggy
    from omegaconf import DictConfig

    from core.envs.task import Task
    from core.records import Candidate, IterationResult, Plan, TrainResult


@dataclass
class Context:
    """The part both contexts share."""

    settings: Settings
    task: Task
    seed: int
    llm_factory: Callable[[], Any] | None = field(default=None, repr=False)
    hook: Any = field(default=None, repr=False)  # the plugin manager's hooks: a call reaches every plugin
    # the run's plugin manager: the core calls each plugin on its own through it (core.registry.call_each)
    pluginmanager: pluggy.PluginManager | None = field(default=None, repr=False)
    _llm: Any = field(default=None, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "pluginmanager" and value is not None:  # the hooks are the manager's: set one, both agree
            super().__setattr__("hook", value.hook)

    @property
    def config(self) -> DictConfig:
        """The composed run config (read-only OmegaConf ``DictConfig``)."""
        return self.settings.config

    @property
    def sandbox(self) -> SandboxConfig:
        """The typed ``sandbox:`` settings (``.limits()``, ``.imports``)."""
        return self.settings.sandbox

    def plugin_config(self, name: str) -> PluginConfig | None:
        """An enabled plugin's validated config (its ``Config`` dataclass), or None."""
        return self.settings.plugins.get(name)

    @property
    def llm(self) -> Any:
        """The LLM client of this process (:class:`core.llm.LLMClient`), created on first use."""
        if self._llm is None and self.llm_factory is not None:
            self._llm = self.llm_factory()
        return self._llm

    def llm_metrics(self) -> dict[str, float]:
        """What this context's LLM client did (``llm/calls``, ``llm/latency_s``, ...); empty if it was never made."""
        return self._llm.stats.as_metrics() if self._llm is not None else {}


@dataclass
class RunContext(Context):
    """What run-level hooks receive (``run``).

    - ``iterations``: the outer iteration count; ``history``: every finished
      :class:`core.records.IterationResult`; ``best``: the best (candidate, result) so far.
    - ``plan``: this iteration's :class:`core.records.Plan` from the ``plan`` hook, or None.
    - ``log_text(path, text)`` / ``log_metrics(dict, step)``: record on the run's MLflow run.
    """

    iterations: int = 1
    history: list[IterationResult] = field(default_factory=list)
    plan: Plan | None = None
    tracker: Any = field(default=None, repr=False)

    def log_text(self, path: str, text: str) -> None:
        if self.tracker is not None:
            self.tracker.log_text(text, path)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step)

    @property
    def best(self) -> tuple[Candidate, TrainResult] | None:
        """The best candidate over all finished iterations, among the policies that no later
        training continued (one continued goes on training in its successor)."""
        pairs = [(c, r) for it in self.history for c, r in zip(it.candidates, it.results) if r.ok]
        continued = {c.start.source for c, _ in pairs if c.start is not None}
        pairs = [(c, r) for c, r in pairs if c.id not in continued]
        return max(pairs, key=lambda cr: cr[1].score) if pairs else None


@dataclass
class TrainContext(Context):
    """What training hooks receive (``train``): one candidate's training.

    ``frames`` advances as training goes; ``total_frames`` is the budget; ``progress``
    their ratio. ``log_metric`` records a metric over frames on the candidate's MLflow
    run and ``log_text`` a text artifact; both travel back with the result.

    ``plan`` is the candidate's plan (the steps training follows), or None.

    ``state`` holds plugins' per-training objects, keyed by plugin name (a judge, a
    reward model): made in ``on_train_start``, gone with the training. A population
    method trains several candidates at once in one process, each with its own
    context, so per-training state belongs here, never on the plugin object.
    """

    candidate: Candidate | None = None
    total_frames: int = 0
    frames: int = 0
    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def plan(self) -> Plan | None:
        """The candidate's plan (the ``plan`` hook's :class:`core.records.Plan`), or None.

        Follow it with :class:`core.plan.PlanFollower` (``core/plan.py``)."""
        return self.candidate.plan if self.candidate is not None else None

    @property
    def progress(self) -> float:
        """Fraction of the training budget done, in [0, 1]."""
        return min(1.0, self.frames / max(1, self.total_frames))

    def log_metric(self, key: str, value: float) -> None:
        self.metrics.setdefault(key, []).append((self.frames, float(value)))

    def log_text(self, name: str, text: str) -> None:
        """Append to a text artifact (``name`` is its file name), e.g. an evaluator's reasons."""
        self.texts[name] = self.texts.get(name, "") + text


@dataclass
class StepBatch:
    """One collected step of every env, batched over ``B`` envs (``compute_reward``).

    - ``obs`` / ``next_obs``: the task's observations ``[B, D]`` before any feature a
      state program or ``represent_state`` appends; ``next_obs`` of a step that ended an
      episode is that episode's final observation, not the reset one.
    - ``state`` / ``next_state``: the same as ``{field: [B, ...]}`` (``Task.split_state``).
    - ``action``: the actions taken, ``[B]`` for discrete tasks, ``[B, A]`` for continuous.
    - ``env_reward``: the env's own reward ``[B]``; ``reward``: the reward so far ``[B]``
      (the candidate's reward program if any, plus earlier hooks' terms).
    - ``done``: ``[B]`` bool, the step ended an episode (terminated or truncated).
    - ``task``: the :class:`core.envs.task.Task`.

    The tensors are the trainer's own: read them, never change them in place.
    """

    obs: torch.Tensor
    action: torch.Tensor
    next_obs: torch.Tensor
    env_reward: torch.Tensor
    reward: torch.Tensor
    done: torch.Tensor
    task: Task

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.task.split_state(self.obs)

    @property
    def next_state(self) -> dict[str, torch.Tensor]:
        return self.task.split_state(self.next_obs)


@dataclass
class ActionPrior:
    """A per-step action prior the trainer combines with its policy (``action_prior`` hook).

    Fill the half that fits the task's action space, over the ``B`` observations the hook
    was given:

    - discrete (``n`` actions, macros included): ``log_probs [B, n]``, finite
      log-probabilities (rule an action out with a large negative number such as -30,
      never ``-inf``), combined as ``logits <- logits + weight * log_probs`` (a product of
      experts ``pi(a|s) * p(a|s)^weight``, renormalised). PPO samples from the combined
      distribution and computes its loss on it, so training stays on-policy.
    - continuous (``A`` action dims): ``mean [B, A]`` (within the action bounds) and
      ``std`` (``[B, A]`` or a float; 0 acts the mean), taken in place of the policy's
      action with probability ``prob`` per row (a behaviour policy: the transitions go
      to SAC's replay buffer like any other). ``imitation > 0`` adds a behaviour-cloning
      step, ``imitation * |actor(s) - a|^2`` on the replayed transitions the prior acted.

    ``mask [B]`` (bool) says which rows the prior covers (None: all); rows outside it
    keep the policy's own distribution or action.
    """

    log_probs: torch.Tensor | None = None  # [B, n] discrete log-probabilities
    weight: float = 1.0  # exponent of the discrete prior in the product with the policy
    mean: torch.Tensor | None = None  # [B, A] continuous behaviour action
    std: torch.Tensor | float = 0.0  # [B, A] or scalar noise around ``mean``
    prob: float = 0.0  # per-row probability that the continuous prior acts instead of the policy
    imitation: float = 0.0  # weight of the behaviour-cloning step on the prior's transitions (SAC)
    mask: torch.Tensor | None = None  # [B] bool rows the prior covers; None: every row
