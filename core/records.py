"""Records that cross module boundaries: candidates, programs, results, feedback.

Everything here is a plain dataclass so that it pickles (executors send candidates
to worker processes) and logs (tracking turns them into MLflow params/artifacts).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Program:
    """Source code an LLM (or a person) wrote, and the function to call in it.

    The core never ``exec``s a program itself: ``core.sandbox`` compiles, checks and
    runs it. ``origin`` names the plugin that proposed it.

    A reply that yields no usable program still becomes one, with ``rejected`` saying
    why (no code, no function of that name, a syntax error, the wrong signature): the
    loop records it as a candidate that did not train, so no reply is dropped silently,
    and a repair step can send ``reply`` and ``rejected`` back to the LLM. ``source``
    then holds the reply's best-guess code (possibly ``""``). ``meta["sample"]`` is the
    reply's index in its LLM call.
    """

    source: str
    entry: str
    origin: str = ""
    prompt: str = ""  # the prompt that produced it (logged as an artifact)
    reply: str = ""  # the raw LLM reply it was extracted from
    meta: dict[str, Any] = field(default_factory=dict)
    rejected: str = ""  # why the reply could not be used (feedback text for the LLM); set: recorded, never trained


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
class PlanStep:
    """One step of a :class:`Plan`: a sub-goal or skill, and how its completion is checked.

    ``kind`` says who carries it out: ``"skill"`` (a coded or learned basic skill, Plan4MC),
    ``"goal"`` (a sub-goal the policy is rewarded for reaching, ELLM) or ``"rl"`` (a
    sub-action left to RL to learn, RL-GPT). ``done`` names a goal the task can check
    (:func:`core.plan.goal_names`, e.g. a Crafter achievement ``"collect_wood"``); ``""``
    when nothing checks it (such a step never gates the ones after it).
    """

    name: str
    kind: str = "goal"  # "skill" | "goal" | "rl"
    goal_text: str = ""  # the step in words, as the LLM gave it
    done: str = ""  # the task goal whose achievement completes the step ("" = unchecked)


PLAN_KINDS = ("skill", "goal", "rl")


@dataclass
class Plan:
    """What the ``plan`` hook returns and training consumes: steps in order.

    Attached to every candidate of the iteration (``Candidate.plan``) and read in training
    as ``TrainContext.plan``; :class:`core.plan.PlanFollower` turns it into the active
    step of each env (the first checked step whose goal is not yet achieved), a reward for
    completing it and a one-hot of it for the policy. ``text`` is the readable form for
    logs and prompts (made from the steps when empty); ``origin`` the planning plugin.
    """

    steps: list[PlanStep] = field(default_factory=list)
    text: str = ""
    origin: str = ""
    target: str = ""  # the goal the plan leads to, if it has one (Plan4MC's target item)

    def __post_init__(self) -> None:
        for step in self.steps:
            if step.kind not in PLAN_KINDS:
                raise ValueError(f"plan step {step.name!r}: kind must be one of {PLAN_KINDS}, not {step.kind!r}")
        if not self.text and self.steps:
            self.text = "\n".join(
                f"{i + 1}. {s.name} [{s.kind}]"
                + (f": {s.goal_text}" if s.goal_text else "")
                + (f" (done when {s.done})" if s.done and s.done != s.name else "")
                for i, s in enumerate(self.steps)
            )

    def __str__(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        return bool(self.steps or self.text)

    @classmethod
    def of(cls, value: Plan | str | None, origin: str = "") -> Plan | None:
        """A plan from a hook's result: a :class:`Plan` as it is, text as a plan of no steps."""
        if value is None or isinstance(value, Plan):
            return value or None
        return cls(text=str(value), origin=origin) if str(value) else None


@dataclass
class EnvConfig:
    """One training-environment variant: values for the task's controllable params."""

    name: str
    params: dict[str, Any]
    purpose: str = ""
    weight: float = 1.0  # share of the training envs that use this config


@dataclass
class StartPolicy:
    """A trained policy that a candidate's training continues instead of a fresh one.

    Made from a finished training with :meth:`of` (its candidate had ``keep_policy``), so
    the weights travel inside the candidate to whichever process trains it: no file is
    shared between processes. ``sha256`` identifies the weights in the results store's
    key; ``frames`` counts every frame the policy has trained, over the whole chain.
    """

    source: str  # the id of the candidate whose training produced it
    state: bytes = field(repr=False)  # the trainer's state as TrainResult.final_policy holds it
    sha256: str = ""  # sha256 of ``state``
    frames: int = 0  # frames trained so far, by this policy and every policy it continued

    @classmethod
    def of(cls, candidate: Candidate, result: TrainResult) -> StartPolicy:
        """The policy ``result`` ended with, to continue from; ``ValueError`` when it kept none."""
        if not (result.ok and result.final_policy):
            raise ValueError(
                f"candidate {candidate.id} has no final policy to continue from "
                f"({'it kept none: set keep_policy' if result.ok else 'its training failed'})"
            )
        before = candidate.start.frames if candidate.start is not None else 0
        return cls(
            candidate.id, result.final_policy, hashlib.sha256(result.final_policy).hexdigest(), before + result.frames
        )


@dataclass
class Candidate:
    """One thing to train and score: a combination of the parts plugins proposed.

    Empty parts mean "the task's default": no reward program trains on the env's own
    reward, no env configs train on the original env.

    The training fields (``start``, ``frames``, ``original_after``, ``keep_policy``) are
    set by a ``prepare_candidates`` hook, not by the proposals: EnvGen trains one agent
    across its cycles (each cycle's candidate continues the previous one's policy in the
    generated envs, then in the original env), at the frames of one plain training.
    """

    id: str
    iteration: int
    reward: RewardProgram | None = None
    state: StateProgram | None = None
    macros: list[MacroAction] = field(default_factory=list)
    envs: list[EnvConfig] = field(default_factory=list)
    plan: Plan | None = None  # the iteration's plan (``plan`` hook); training reads it as ``TrainContext.plan``
    meta: dict[str, Any] = field(default_factory=dict)
    start: StartPolicy | None = None  # continue training this policy (actor, critic, optimizer) instead of a fresh one
    frames: int = 0  # this candidate's training frames (0: trainer.frames)
    original_after: float = 0.0  # share of the frames trained last on the original env, after ``envs``
    keep_policy: bool = False  # return the trained state in TrainResult.final_policy (for a later start)

    @property
    def programs(self) -> list[tuple[str, Program]]:
        """Every program of the candidate with its role (``reward``, ``state``, ``macros``)."""
        out: list[tuple[str, Program]] = []
        if self.reward is not None:
            out.append(("reward", self.reward))
        if self.state is not None:
            out.append(("state", self.state))
        out += [("macros", m.program) for m in self.macros]
        return out

    @property
    def rejected(self) -> str:
        """Why the candidate cannot train: its rejected programs' reasons (``""`` when it can)."""
        return "\n".join(p.rejected for _, p in self.programs if p.rejected)

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
    final_policy: bytes = field(
        default=b"", repr=False
    )  # the trained state when the candidate kept it (StartPolicy.of)

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
