"""Records that cross module boundaries: candidates, programs, results, feedback.

Everything here is a plain dataclass so that it pickles (executors send candidates
to worker processes) and logs (tracking turns them into MLflow params/artifacts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Program:
    """Source code an LLM (or a person) wrote, and the function to call in it.

    The core never ``exec``s a program itself: ``core.sandbox`` compiles, checks and
    runs it. ``origin`` names the plugin that proposed it.
    """

    source: str
    entry: str
    origin: str = ""
    prompt: str = ""  # the prompt that produced it (logged as an artifact)
    reply: str = ""  # the raw LLM reply it was extracted from
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardProgram(Program):
    """``entry(state, action, next_state) -> reward`` or ``-> (reward, components)``.

    ``state``/``next_state`` map the task's state-field names to batched tensors of
    shape ``[B, ...]``; ``action`` is ``[B, ...]``. The reward is ``[B]``; components
    (optional) is a dict of named ``[B]`` tensors logged over training.
    ``mode`` says how it combines with the env's own reward: ``"replace"`` (Eureka,
    Text2Reward) or ``"add"`` (intrinsic bonus, LESR), with ``weight`` on the program.
    """

    entry: str = "compute_reward"
    mode: str = "replace"
    weight: float = 1.0


@dataclass
class StateProgram(Program):
    """``entry(state) -> features``: extra features ``[B, k]`` appended to the observation.

    ``state`` maps the task's state-field names to batched tensors (LESR's
    ``revise_state``). ``extra_dim`` is ``k``, found by the probe run.
    """

    entry: str = "revise_state"
    extra_dim: int = 0


@dataclass
class MacroAction:
    """A coded skill added to the policy's action space (RL-GPT's code-as-policy).

    ``entry(state) -> primitive action`` is called every step while the macro runs,
    for at most ``max_steps`` steps or until ``done_entry(state) -> bool`` says so.
    """

    name: str
    program: Program
    max_steps: int = 16
    done_entry: str | None = None


@dataclass
class EnvConfig:
    """One training-environment variant: values for the task's controllable params."""

    name: str
    params: dict[str, Any]
    purpose: str = ""
    weight: float = 1.0  # share of the training envs that use this config


@dataclass
class Candidate:
    """One thing to train and score: a combination of the parts plugins proposed.

    Empty parts mean "the task's default": no reward program trains on the env's own
    reward, no env configs train on the original env.
    """

    id: str
    iteration: int
    reward: RewardProgram | None = None
    state: StateProgram | None = None
    macros: list[MacroAction] = field(default_factory=list)
    envs: list[EnvConfig] = field(default_factory=list)
    plan: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def parts(self) -> dict[str, Any]:
        """The non-empty parts, keyed by role, for logging."""
        parts: dict[str, Any] = {}
        if self.reward is not None:
            parts["reward"] = self.reward
        if self.state is not None:
            parts["state"] = self.state
        if self.macros:
            parts["macros"] = self.macros
        if self.envs:
            parts["envs"] = self.envs
        if self.plan:
            parts["plan"] = self.plan
        return parts


@dataclass
class Episode:
    """One finished evaluation episode."""

    ret: float  # return under the env's own reward
    length: int
    success: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)  # task-specific (achievements, ...)


@dataclass
class Fitness:
    """The task's ground-truth score of a set of evaluation episodes."""

    name: str  # "return", "success_rate", "crafter_score", ...
    value: float
    details: dict[str, float] = field(default_factory=dict)  # per-achievement rates ...


@dataclass
class CurvePoint:
    """One periodic evaluation during training."""

    frames: int
    fitness: float
    episode_return: float
    components: dict[str, float] = field(default_factory=dict)  # reward components (means)


@dataclass
class TrainResult:
    """What training one candidate produced. Failures are data, not exceptions."""

    candidate_id: str
    ok: bool
    fitness: Fitness | None = None
    frames: int = 0
    seconds: float = 0.0
    curve: list[CurvePoint] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    # per reward component: list of (frames, mean value) sampled over training
    components: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # losses, fps, correlations
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # plugin metrics over frames
    texts: dict[str, str] = field(default_factory=dict)  # text artifacts (file name -> text), e.g. judge reasons
    error: str = ""  # feedback text when not ok (traceback, sandbox report)
    error_kind: str = ""  # sandbox category or exception class
    run_id: str = ""  # MLflow run of this candidate
    policy_path: str = ""  # saved policy weights, if any

    @property
    def score(self) -> float:
        """Fitness value, or -inf for a failed candidate (so it sorts last)."""
        return self.fitness.value if (self.ok and self.fitness is not None) else float("-inf")


@dataclass
class IterationResult:
    """All candidates of one outer iteration, and the best of them."""

    iteration: int
    candidates: list[Candidate]
    results: list[TrainResult]

    @property
    def best(self) -> tuple[Candidate, TrainResult] | None:
        pairs = [(c, r) for c, r in zip(self.candidates, self.results) if r.ok]
        if not pairs:
            return None
        return max(pairs, key=lambda cr: cr[1].score)
