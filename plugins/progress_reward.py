"""progress_reward: the LLM scores the agent's progress; a distilled evaluator blends it into every step's reward.

Method (design note "Progress Reward Model for Reinforcement Learning via Large Language
Models"):

1. Semantic channel: the task's text rendering of a state goes to the LLM with at most
   three sentences of background and a list of evaluation dimensions; the LLM rates the
   agent's progress on a 1-10 scale.
2. Scores as expected values (``score: expected``, the default): the reply is one digit
   0-9 (1-10 shifted down, so that one token decides: "10" would be two tokens), read
   from the first answer token's log-probabilities in one call as
   ``1 + sum_d p(d) * d / sum_d p(d)``. ``score: median`` keeps the note's
   consistency rule instead: ``samples`` sampled ``Score: N | Reason: ...`` replies, the
   median kept when they agree (``confidence``), otherwise a rule scores the state.
3. Where the calls go: a few hundred states are scored before training, blocking and in
   batches, chosen to cover the range (reference rollouts of the task, random and the
   task's controller where it has one: each level of their true progress in turn, spread
   over the episodes' time; near-duplicates skipped), and ``rounds.states`` of the agent's
   own states at a few fixed points of the budget (``rounds.at``), spread over the
   evaluator's current scores.
4. Distillation: after each scoring round a small MLP ensemble regresses the LLM's
   scores from the state; it scores every env's state at every step, so the LLM's
   judgement reaches nearly every step's reward (the note's distilled evaluator for
   deployment).
5. Mixed reward: ``w_env * r + w_llm * z(progress) + w_exp * bonus`` with stage weights
   (early / middle / late fractions of the budget), a running z-score (EMA 0.99) of the
   evaluator's score, and a count-based novelty bonus. With ``shaping`` the LLM term is
   the potential difference ``gamma * z(s') - z(s)``, which keeps the optimal policy.
6. Sparse-signal guard: when the LLM keeps scoring no progress, its weight moves to the
   exploration bonus until a better score comes (logged).

Before training the LLM's scores are checked against the true progress of the reference
states (Spearman rank correlation, ``judge/rank_correlation``): achievements unlocked so
far where the task counts them (Crafter), else the share of the way through the task's
controller's successful episodes, else the return so far of random episodes.

With every stage's LLM weight 0 (the study's ``progress_no_llm`` control) the plugin
makes no LLM call and the reward is the same blend without the LLM term.

Config: ``conf/plugins/progress_reward.yaml`` (schema: :class:`Config`). Each training's
judge lives in ``train.state["progress_reward"]``. Every LLM score (state, probabilities
or samples, true progress) goes to the text artifact ``progress_reward/reasons.md``.
"""

from __future__ import annotations

import math
import multiprocessing
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.plugin import (
    PluginConfig,
    StepBatch,
    Task,
    TrainContext,
    TrainResult,
    Trajectory,
    UserError,
    hookimpl,
    make_progress,
    warm_up,
)

NAME = "progress_reward"
SCORES = ("expected", "median")
DEDUPE = ("features", "caption", "none")


@dataclass
class Stages:
    """``stages``: the reward weights ``(env, llm, exploration)`` per training stage."""

    # stage starts as fractions of the training budget (middle, late)
    boundaries: list[float] = field(default_factory=lambda: [0.2, 0.6])
    early: list[float] = field(default_factory=lambda: [0.5, 0.4, 0.1])  # design: early training
    middle: list[float] = field(default_factory=lambda: [0.7, 0.25, 0.05])  # design: middle
    late: list[float] = field(default_factory=lambda: [0.9, 0.08, 0.02])  # design: late


@dataclass
class Sparse:
    """``sparse``: the sparse-signal guard."""

    window: int = 12  # consecutive LLM scores looked at
    max_score: float = 2.0  # all of them at or below this = "no progress": the LLM weight goes to exploration


@dataclass
class Reference:
    """``reference``: the states scored before training."""

    episodes: int = 16  # reference rollouts of each kind: random, and the task's controller where it has one
    max_steps: int = 500  # steps per reference rollout at most
    # rollout seed, the same for every training seed: the same states and prompts, so the LLM cache
    # answers them for every later seed and run
    seed: int = 0
    # states scored before training (each level of true progress in turn, spread over time;
    # near-duplicates skipped)
    states: int = 160


@dataclass
class Rounds:
    """``rounds``: the agent's own states scored during training."""

    at: list[float] = field(
        default_factory=lambda: [0.15, 0.35, 0.6]
    )  # budget fractions at which training stops to score
    states: int = 32  # agent states scored per round (spread over the evaluator's current scores)
    buffer: int = 2048  # agent states kept to choose from (a uniform sample of the training's states so far)


@dataclass
class Distill:
    """``distill``: the small ensemble that scores every step from the LLM's scores."""

    members: int = 3  # ensemble size (each fitted on a bootstrap of the scores; their mean is the score)
    hidden: int = 64  # hidden units of each member
    epochs: int = 300  # full-batch Adam steps per fit


@dataclass
class Config(PluginConfig):
    """``plugins.progress_reward``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`
    (this plugin proposes nothing: the defaults leave the run's loop as it is)."""

    background: str | None = None  # task background for the prompt (<= 3 sentences); None = the goal cut to 3 sentences
    dimensions: list[str] = field(
        default_factory=lambda: [  # evaluation dimensions listed in the prompt
            "closeness to the goal",
            "avoiding failure or danger",
            "useful intermediate steps achieved",
        ]
    )
    # expected: one call per state, a digit 0-9 whose first-token probabilities give the expected score;
    # median: the median of `samples` sampled "Score: N | Reason: ..." replies (the design note's 3 votes)
    score: str = "expected"
    top_logprobs: int = 20  # score=expected: first-token alternatives read (OpenAI-style backends give at most 20)
    min_mass: float = 0.5  # score=expected: a reply whose digits hold less of the first token's probability is rejected
    samples: int = 3  # score=median: sampled replies per state (design: 3)
    temperature: float = 0.7  # score=median: sampling temperature
    max_tokens: int = 40  # score=median: cap on each reply (a score and a short reason)
    agree_tol: float = 1.0  # score=median: a sample agrees with the median when within this many points
    # score=median: below this share of agreeing samples the fallback rule scores the state
    # (design: 0.7; 0.6 = two of three)
    confidence: float = 0.6
    batch: int = 8  # states asked together (llm.chat_many); the progress bar advances per batch
    # features: skip a state within dedupe_radius (scaled features) of one already scored; caption: skip a
    # state whose Task.caption was scored; none: score every chosen state
    dedupe: str = "features"
    dedupe_radius: float = 0.5  # dedupe=features: distance below which two states count as one
    eval_every: int = 1  # the distilled evaluator scores the envs' states every k steps (reused in between)
    novelty_cell: float = 0.5  # grid cell (scaled features) of the count-based exploration bonus 1/sqrt(n)
    ema: float = 0.99  # decay of the running mean and variance that z-score the evaluator's score
    shaping: bool = False  # true: the LLM term is gamma*z(s') - z(s) (potential-based; keeps the optimal policy)
    gamma: float = 0.99  # discount of the potential-based shaping
    max_reasons: int = 400  # scored states listed in the artifact progress_reward/reasons.md
    stages: Stages = field(default_factory=Stages)  # weights (env, llm, exploration) per training stage
    sparse: Sparse = field(default_factory=Sparse)  # sparse-signal guard
    reference: Reference = field(default_factory=Reference)  # the states scored before training
    rounds: Rounds = field(default_factory=Rounds)  # the agent's states scored during training
    distill: Distill = field(default_factory=Distill)  # the evaluator that scores every step

    def check(self) -> None:
        super().check()
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.dedupe not in DEDUPE:
            raise ValueError(f"dedupe must be one of {', '.join(DEDUPE)}, got {self.dedupe!r}")
        for name in ("samples", "max_tokens", "eval_every", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 1..20, got {self.top_logprobs}")
        if not 0.0 <= self.confidence <= 1.0 or not 0.0 <= self.min_mass <= 1.0:
            raise ValueError(f"confidence and min_mass must be in [0, 1], got {self.confidence} and {self.min_mass}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.dedupe_radius < 0 or self.novelty_cell <= 0:
            raise ValueError(
                f"dedupe_radius must be >= 0 and novelty_cell > 0, got {self.dedupe_radius} and {self.novelty_cell}"
            )
        if not self.dimensions:
            raise ValueError("dimensions must list at least one evaluation dimension")
        for stage in ("early", "middle", "late"):
            if len(getattr(self.stages, stage)) != 3:
                raise ValueError(
                    f"stages.{stage} must be three weights (env, llm, exploration), got {getattr(self.stages, stage)}"
                )
        if list(self.stages.boundaries) != sorted(self.stages.boundaries):
            raise ValueError(f"stages.boundaries must be increasing, got {self.stages.boundaries}")
        if self.sparse.window < 1:
            raise ValueError(f"sparse.window must be >= 1, got {self.sparse.window}")
        ref, rounds = self.reference, self.rounds
        if ref.episodes < 1 or ref.max_steps < 1 or ref.states < 0:
            raise ValueError(
                f"reference.episodes and reference.max_steps must be >= 1 and reference.states >= 0, "
                f"got {ref.episodes}, {ref.max_steps}, {ref.states}"
            )
        if any(not 0.0 < a < 1.0 for a in rounds.at) or list(rounds.at) != sorted(rounds.at):
            raise ValueError(f"rounds.at must be increasing budget fractions in (0, 1), got {rounds.at}")
        if rounds.states < 0 or rounds.buffer < 1:
            raise ValueError(f"rounds.states must be >= 0 and rounds.buffer >= 1, got {rounds.states}, {rounds.buffer}")
        if self.distill.members < 1 or self.distill.hidden < 1 or self.distill.epochs < 1:
            raise ValueError("distill.members, distill.hidden and distill.epochs must be >= 1")

    def llm_off(self) -> bool:
        """Every stage gives the LLM weight 0 (the no-LLM control): no call is worth making."""
        return all(float(getattr(self.stages, s)[1]) == 0.0 for s in ("early", "middle", "late"))


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = "You are a strict coach who rates how much progress an agent has made towards its goal."

# score=expected: the question after the state (a 1.5B model judged worse with it before), one digit
# as the whole answer so that the first token's probabilities are the score's distribution
DIGIT_PROMPT = (
    """Task: {background}
Judge the agent on:
{dimensions}
Current state:
{state}

"""
    "How much progress has the agent made towards the goal? Reply with a single digit from 0 (no progress) "
    "to 9 (the goal is fully achieved)."
)

# score=median: the design note's format, a score and a short reason
TEXT_PROMPT = """Task: {background}
Judge the agent on:
{dimensions}
Current state:
{state}

Reply with one line exactly like this:
Score: <integer 1-10> | Reason: <one short sentence>"""

_SCORE = re.compile(r"(?:score|rating|评分)\W{0,4}?\s*[:：=]?\s*\**\s*(-?\d+(?:\.\d+)?)\s*(/\s*10)?", re.I)
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*10\b")
_REASON = re.compile(r"(?:reason|理由)\W{0,3}?\s*[:：=]\s*\**\s*(.+)", re.I)


# -- pure pieces ---------------------------------------------------------------------------


def background_of(goal: str, limit: int = 3) -> str:
    """The task background: the goal cut to at most ``limit`` sentences."""
    sentences = re.split(r"(?<=[.!?])\s+", goal.strip())
    return " ".join(s for s in sentences[:limit] if s)


def build_prompt(background: str, dimensions: list[str], state: str, score: str = "expected") -> list[dict[str, str]]:
    """The chat messages that ask for one progress score (``score``: the config's mode)."""
    dims = "\n".join(f"- {d}" for d in dimensions)
    template = DIGIT_PROMPT if score == "expected" else TEXT_PROMPT
    user = template.format(background=background, dimensions=dims, state=state)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


@dataclass
class Expected:
    """One ``score=expected`` reply read: the score in [1, 10] and where it came from."""

    score: float
    probs: dict[int, float]  # digit -> probability among the digits (empty when read from the text)
    source: str  # "logprobs", or "text" (no usable log-probabilities: the replied digit)


def expected_score(reply: Any, min_mass: float = 0.5) -> Expected | None:
    """The expected score ``1 + E[digit]`` of a one-digit reply, or None when unusable.

    The digits' probabilities come from the first token's alternatives (tokens that strip
    to one digit; their probabilities summed). They are used when they hold at least
    ``min_mass`` of the probability and belong to the reply: a greedy reply is the most
    likely alternative, so a replied digit that is missing from them or less likely than
    another means they describe some other decoding. Otherwise the replied digit itself
    is the score (a backend without log-probabilities). None when neither gives a digit.
    """
    text = str(getattr(reply, "text", "") or "").strip()
    said = int(text[0]) if text[:1].isdigit() else None
    logprobs = getattr(reply, "logprobs", None) or {}
    probs: dict[int, float] = {}
    for token, lp in logprobs.items():
        key = str(token).strip()
        if len(key) == 1 and key.isdigit() and lp is not None and math.isfinite(lp):
            probs[int(key)] = probs.get(int(key), 0.0) + math.exp(float(lp))
    mass = sum(probs.values())
    if probs and mass >= min_mass:
        best = max(probs.values())
        if said is None or probs.get(said, 0.0) >= best * (1 - 1e-6):
            share = {d: p / mass for d, p in sorted(probs.items())}
            return Expected(1.0 + sum(d * p for d, p in share.items()), share, "logprobs")
    if said is None:
        return None
    return Expected(1.0 + said, {}, "text")


@dataclass
class Judgement:
    """One parsed ``score=median`` reply: a score in [1, 10] and the reason (empty when absent)."""

    score: float
    reason: str


def parse_reply(text: str) -> Judgement | None:
    """The score and reason of a ``Score: N | Reason: ...`` reply, or None when it is malformed.

    Accepts ``Score: 7``, ``**Score:** 7/10``, ``评分：7``; falls back to a lone ``7/10``.
    ``Score: 0`` (the small model's "no progress at all") counts as 1. Rejects replies
    with no score, a score outside 0-10, or two different scores.
    """
    found = [float(m.group(1)) for m in _SCORE.finditer(text)]
    if not found:
        found = [float(m.group(1)) for m in _FRACTION.finditer(text)]
    if not found or len(set(found)) > 1:
        return None
    score = found[0]
    if not 0.0 <= score <= 10.0:
        return None
    score = max(1.0, score)
    reason = _REASON.search(text)
    return Judgement(score, reason.group(1).strip().strip("*").strip()[:200] if reason else "")


def consensus(scores: list[float], asked: int, tol: float = 1.0) -> tuple[float, float]:
    """(median, confidence) of the valid scores of ``asked`` samples.

    Confidence is the share of the samples asked whose score lies within ``tol`` of the
    median, so malformed replies and disagreement both lower it.
    """
    if not scores:
        return float("nan"), 0.0
    median = float(statistics.median(scores))
    agree = sum(abs(s - median) <= tol for s in scores)
    return median, agree / max(1, asked)


def rule_score(episode_return: float, returns_seen: list[float]) -> float:
    """The fallback rule: 1 + 9 * the rank of the return so far among the returns seen."""
    if not returns_seen:
        return 5.5
    rank = float(np.mean(np.asarray(returns_seen) <= episode_return))
    return 1.0 + 9.0 * rank


def spearman(x: np.ndarray | list[float], y: np.ndarray | list[float]) -> float:
    """Spearman's rank correlation (Pearson's on average ranks, so ties count as ties); nan
    for fewer than 3 pairs or a constant side."""
    from scipy.stats import rankdata

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) != len(y):
        raise ValueError(f"spearman needs pairs, got {len(x)} and {len(y)} values")
    if len(x) < 3:
        return float("nan")
    rx, ry = rankdata(x) - (len(x) + 1) / 2, rankdata(y) - (len(y) + 1) / 2
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def reference_progress(task: Task, trajectories: list[Trajectory]) -> tuple[list[np.ndarray | None], str]:
    """The true progress of every state a reference trajectory reached (its ``next_obs``),
    per trajectory (None: not defined there), and the definition in words.

    - A task that counts achievements (a field ``achievements_unlocked``, Crafter): the
      achievements unlocked so far in the episode, on every trajectory.
    - Else, a task with a controller: the share of the episode done, ``(t + 1) / T``, on
      the controller's successful episodes only (a random episode's time is no progress).
    - Else: the return so far under the task's reward, on the random episodes.
    """
    if "achievements_unlocked" in task.field_names():
        out: list[np.ndarray | None] = [
            task.split_state(torch.as_tensor(t.next_obs))["achievements_unlocked"].double().numpy()
            for t in trajectories
        ]
        return out, "achievements unlocked so far in the episode"
    if any(t.source == "controller" and t.success for t in trajectories):
        return (
            [
                np.arange(1, t.length + 1) / t.length if t.source == "controller" and t.success else None
                for t in trajectories
            ],
            "share of the way through the controller's successful episodes",
        )
    return [np.cumsum(t.env_reward.astype(np.float64)) for t in trajectories], "return so far of random episodes"


def spread_order(n: int) -> np.ndarray:
    """The indices ``0..n-1`` in an order whose every prefix spreads over the whole range
    (bit-reversed quantiles: 0, n/2, n/4, 3n/4, ...), so that taking the first k of a
    sorted list covers it from low to high."""
    if n <= 0:
        return np.zeros(0, np.int64)
    bits = max(1, math.ceil(math.log2(n)))
    k = np.arange(1 << bits)
    rev = np.zeros_like(k)
    for b in range(bits):
        rev |= ((k >> b) & 1) << (bits - 1 - b)
    idx = (rev * n) >> bits
    _, first = np.unique(idx, return_index=True)
    return idx[np.sort(first)]


def levels_of(values: np.ndarray, bins: int = 8) -> np.ndarray:
    """An integer level per value: the distinct values when there are at most ``bins`` of
    them, else ``bins`` quantile bins; -1 for nan."""
    out = np.full(len(values), -1, np.int64)
    ok = ~np.isnan(values)
    if not ok.any():
        return out
    distinct = np.unique(values[ok])
    if len(distinct) <= bins:
        out[ok] = np.searchsorted(distinct, values[ok])
    else:
        edges = np.quantile(values[ok], np.linspace(0, 1, bins + 1)[1:-1])
        out[ok] = np.searchsorted(edges, values[ok], side="right")
    return out


def stratified_order(truth: np.ndarray, time_share: np.ndarray, bins: int = 8) -> np.ndarray:
    """All indices, taking one state of each progress level in turn (lowest level first).

    Levels are :func:`levels_of` the true progress; states without one (nan) are grouped
    by their time share instead, as levels of their own. Within a level the states go in
    :func:`spread_order` of their time share, so any prefix covers every level and, within
    it, early and late states alike (a few levels then hold as many picks as the common one).
    """
    level = levels_of(truth, bins)
    free = level < 0
    if free.any():  # states with no true progress: by time, after the progress levels
        level[free] = level.max(initial=-1) + 1 + levels_of(time_share[free], bins)
    groups = []
    for value in np.unique(level):
        members = np.flatnonzero(level == value)
        members = members[np.argsort(time_share[members], kind="stable")]
        groups.append(list(members[spread_order(len(members))]))
    out: list[int] = []
    for turn in range(max(len(g) for g in groups)):
        out += [int(g[turn]) for g in groups if turn < len(g)]
    return np.asarray(out, np.int64)


def stage_weights(progress: float, boundaries: list[float], stages: list[list[float]]) -> tuple[float, float, float]:
    """(env, llm, exploration) weights of the stage ``progress`` (budget fraction) is in."""
    index = sum(progress >= b for b in boundaries)
    w = stages[min(index, len(stages) - 1)]
    return float(w[0]), float(w[1]), float(w[2])


class RunningZ:
    """Running z-score with exponential moving mean and variance (decay 0.99 by default).

    ``mean <- d*mean + (1-d)*x``; ``var <- d*var + (1-d)*(x-mean)^2``; the first value
    sets the mean, the variance starts at ``var0``. :meth:`update_batch` applies the same
    step to a batch's mean and its mean squared deviation (one step per env step).
    """

    def __init__(self, decay: float = 0.99, var0: float = 1.0) -> None:
        self.decay, self.mean, self.var, self.count = decay, 0.0, var0, 0

    def update(self, x: float) -> None:
        if self.count == 0:
            self.mean = x
        else:
            self.mean = self.decay * self.mean + (1 - self.decay) * x
            self.var = self.decay * self.var + (1 - self.decay) * (x - self.mean) ** 2
        self.count += 1

    def update_batch(self, xs: np.ndarray) -> None:
        if self.count == 0:
            self.mean = float(np.mean(xs))
        else:
            self.mean = self.decay * self.mean + (1 - self.decay) * float(np.mean(xs))
            self.var = self.decay * self.var + (1 - self.decay) * float(np.mean((xs - self.mean) ** 2))
        self.count += 1

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return (x - self.mean) / (math.sqrt(self.var) + 1e-8)


class StateCache:
    """Scored states in a KD-tree: the nearest one's distance and score (near-duplicate check).

    New states wait in a small list searched by brute force; the tree is rebuilt only when
    that list reaches a quarter of the tree (at least ``rebuild_min``).
    """

    def __init__(self, radius: float, rebuild_min: int = 64) -> None:
        self.radius, self.rebuild_min = radius, rebuild_min
        self.points: list[np.ndarray] = []
        self.values: list[float] = []
        self._tree: Any = None
        self._indexed = 0  # points[:_indexed] are in the tree

    def add(self, x: np.ndarray, value: float) -> None:
        self.points.append(np.asarray(x, np.float64))
        self.values.append(float(value))

    def query(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(nearest distance, its value) per row; ``inf``/``nan`` when the cache is empty."""
        xs = np.asarray(xs, np.float64)
        n = len(self.points)
        if not n:
            return np.full(len(xs), np.inf), np.full(len(xs), np.nan)
        if n - self._indexed >= max(self.rebuild_min, self._indexed // 4):
            from scipy.spatial import cKDTree

            self._tree, self._indexed = cKDTree(np.stack(self.points[:n])), n
        values = np.asarray(self.values[:n])
        dist, value = np.full(len(xs), np.inf), np.full(len(xs), np.nan)
        if self._tree is not None:
            dist, idx = self._tree.query(xs, k=1)
            value = values[idx]
        if n > self._indexed:  # recent points, not in the tree yet
            recent = np.stack(self.points[self._indexed : n])
            d = np.sqrt(((xs[:, None, :] - recent[None]) ** 2).sum(-1))
            j = d.argmin(1)
            near = d[np.arange(len(xs)), j]
            closer = near < dist
            dist = np.where(closer, near, dist)
            value = np.where(closer, values[self._indexed + j], value)
        return np.asarray(dist), np.asarray(value)


class Distiller:
    """A small ensemble regressing the LLM score from state features (mean and spread).

    The members are one batched two-layer tanh MLP (weights ``[members, ...]``), each fitted
    on its own bootstrap of the scores in one full-batch Adam loop; :meth:`predict` runs in
    numpy (a per-step call on a few envs costs microseconds, not a module call per member).
    Targets are standardised for the fit (scores sit around 3-7 on a 1-10 scale) and mapped
    back in :meth:`predict`.
    """

    def __init__(self, dim: int, hidden: int = 64, members: int = 3, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.members, self.seed = members, seed
        self.params = [
            torch.randn(members, dim, hidden, generator=gen) / math.sqrt(dim),
            torch.zeros(members, 1, hidden),
            torch.randn(members, hidden, 1, generator=gen) / math.sqrt(hidden),
            torch.zeros(members, 1, 1),
        ]
        self.y_mean, self.y_std = 0.0, 1.0
        self._numpy = [p.numpy().astype(np.float64) for p in self.params]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = self.params
        return torch.baddbmm(b2, torch.tanh(torch.baddbmm(b1, x, w1)), w2).squeeze(-1)  # [members, N]

    def fit(self, x: np.ndarray, y: np.ndarray, epochs: int = 300, lr: float = 1e-2) -> float:
        """Fit every member on a bootstrap of (x, y); returns the final mean squared error (score points^2)."""
        y = np.asarray(y, np.float64)
        self.y_mean, self.y_std = float(y.mean()), float(y.std()) or 1.0
        xt = torch.as_tensor(x, dtype=torch.float32)
        yt = torch.as_tensor((y - self.y_mean) / self.y_std, dtype=torch.float32)
        gen = torch.Generator().manual_seed(self.seed * 1000 + 1)
        n = len(xt)
        idx = torch.randint(n, (self.members, n), generator=gen) if self.members > 1 else torch.arange(n)[None]
        xb, yb = xt[idx], yt[idx]  # [members, N, D], [members, N]
        for p in self.params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(self.params, lr=lr, weight_decay=1e-3)  # a little: a few hundred noisy scores
        for _ in range(epochs):
            loss = ((self._forward(xb) - yb) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        for p in self.params:
            p.requires_grad_(False)
        self._numpy = [p.detach().numpy().astype(np.float64) for p in self.params]
        return float(loss.detach()) * self.y_std**2

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w1, b1, w2, b2 = self._numpy
        h = np.tanh(np.einsum("nd,mdh->mnh", np.asarray(x, np.float64), w1) + b1)
        out = (np.einsum("mnh,mho->mno", h, w2) + b2)[..., 0] * self.y_std + self.y_mean  # [members, N]
        return out.mean(0), out.std(0)


class NoveltyCounter:
    """Visit counts of grid cells (features floored to ``cell``) in a hashed table.

    :meth:`visit` counts a batch of states and returns each one's bonus ``1/sqrt(n)``,
    vectorised: a cell's integer coordinates are hashed into ``2**bits`` slots (a
    collision merges two cells' counts; rare at the state counts training reaches).
    """

    def __init__(self, cell: float, bits: int = 20, seed: int = 0) -> None:
        self.cell, self.mask = cell, (1 << bits) - 1
        self.counts = np.zeros(1 << bits, dtype=np.int64)
        self._mult: np.ndarray | None = None
        self._seed = seed

    def slots(self, feats: np.ndarray) -> np.ndarray:
        """The table slot of each row's cell."""
        keys = np.floor(feats / self.cell).astype(np.int64)
        if self._mult is None or len(self._mult) != keys.shape[-1]:
            self._mult = np.random.default_rng(self._seed).integers(1, 2**61, size=keys.shape[-1], dtype=np.int64) | 1
        with np.errstate(over="ignore"):
            h = (keys * self._mult).sum(-1)
        return (h ^ (h >> 29)) & self.mask

    def visit(self, feats: np.ndarray) -> np.ndarray:
        idx = self.slots(feats)
        np.add.at(self.counts, idx, 1)
        return 1.0 / np.sqrt(self.counts[idx])


# -- the judge -----------------------------------------------------------------------------


@dataclass
class Label:
    """One LLM-scored state."""

    obs: np.ndarray  # the flat observation
    feature: np.ndarray  # its scaled features (the distiller's input)
    score: float  # in [1, 10]
    source: str  # "logprobs" / "text" (expected), "llm" / "rule" (median)
    origin: str  # "reference" or "agent"
    frames: int  # training frames when it was scored
    detail: str  # probabilities or samples, for the artifact
    truth: float = float("nan")  # the state's true progress (reference states where defined)


@dataclass
class _Counters:
    llm_calls: int = 0
    llm_replies_cached: int = 0
    llm_seconds: float = 0.0
    blocked_seconds: float = 0.0
    rejected: int = 0
    fallbacks: int = 0
    text_scores: int = 0
    llm_errors: int = 0
    duplicates: int = 0
    distilled: int = 0
    steps: int = 0
    env_steps: int = 0
    changed: int = 0
    sparse_steps: int = 0
    term_sum: float = 0.0
    term_sq: float = 0.0


class ProgressJudge:
    """Per-training state: reference scoring, the agent-state rounds, the per-step reward."""

    # per env, set by _init_envs on the first batch
    prev_phi: np.ndarray
    ep_return: np.ndarray

    def __init__(self, train: TrainContext, cfg: Config) -> None:
        self.train, self.cfg = train, cfg
        self.task = train.task
        self.llm_off = cfg.llm_off()
        self.background = cfg.background or background_of(self.task.goal)
        self.z = RunningZ(cfg.ema)
        self.seen = StateCache(cfg.dedupe_radius)  # scored states, for the near-duplicate check
        self.captions: set[str] = set()
        self.counts = _Counters()
        self.labels: list[Label] = []
        self.returns_seen: list[float] = []
        self.recent_scores: list[float] = []
        self.sparse = False
        self.reasons: list[str] = []
        self.distiller: Distiller | None = None
        self.quality: dict[str, float] = {}
        self.progress_text = ""
        self.summary = ""  # the quality check in words, for the artifact
        self._rounds_left = sorted(cfg.rounds.at)
        self._scale: np.ndarray | None = None
        self._step = 0
        self._b = 0
        self._rng = np.random.default_rng(int(train.seed))
        self.novelty = NoveltyCounter(cfg.novelty_cell)
        # the agent's states to choose round states from (a uniform reservoir sample)
        self._buffer: list[tuple[np.ndarray, float]] = []
        self._offered = 0
        self._rollout_terms: list[float] = [0.0, 0.0, 0.0]  # n, sum, sum of squares since the last rollout
        # per-step constants read once: attribute lookups and list building cost every step
        self._eval_every = cfg.eval_every
        self._boundaries = list(cfg.stages.boundaries)
        self._stages = [list(cfg.stages.early), list(cfg.stages.middle), list(cfg.stages.late)]
        self._shaping, self._gamma = cfg.shaping, cfg.gamma

    # -- features ----------------------------------------------------------------------
    def features(self, obs: np.ndarray) -> np.ndarray:
        """States scaled per dimension by their spread over the reference states."""
        if self._scale is None:  # no reference states (not prepared): the first batch fixes the scale
            std = obs.std(0) if len(obs) > 1 else np.ones(obs.shape[-1])
            self._scale = np.where(std > 1e-6, std, 1.0)
        return obs / self._scale

    # -- before training -------------------------------------------------------------------
    def prepare(self) -> None:
        """Roll out the reference episodes, score a spread of their states (blocking), check
        the scores against the states' true progress, and fit the evaluator."""
        t0 = time.perf_counter()
        ref = self.cfg.reference
        trajectories = self.task.reference_trajectories(ref.episodes, ref.seed, ref.max_steps)
        obs = np.concatenate([t.next_obs for t in trajectories]).astype(np.float64)
        std = obs.std(0)
        self._scale = np.where(std > 1e-6, std, 1.0)
        self.returns_seen.extend(float(t.ground_truth) for t in trajectories)
        truths, self.progress_text = reference_progress(self.task, trajectories)
        truth = np.concatenate(
            [t if t is not None else np.full(tr.length, np.nan) for t, tr in zip(truths, trajectories)]
        )
        returns = np.concatenate([np.cumsum(t.env_reward.astype(np.float64)) for t in trajectories])
        if self.llm_off:
            self.reasons.append("- control: every stage's LLM weight is 0; no LLM call was made")
            self.counts.blocked_seconds += time.perf_counter() - t0
            return
        # cover the range: every level of true progress in turn, each level's states spread over the episodes' time
        done_share = np.concatenate([(np.arange(t.length) + 1) / t.length for t in trajectories])
        order = stratified_order(truth, done_share)
        chosen = self._choose(obs, order, ref.states)
        labels = self._score([(obs[i], returns[i]) for i in chosen], "reference", "scoring reference states")
        for label, i in zip(labels, chosen):
            if label is not None:
                label.truth = float(truth[i])
        self._add_labels([lab for lab in labels if lab is not None])
        self._fit()
        self._check_quality(obs, truth)
        self.counts.blocked_seconds += time.perf_counter() - t0

    def _check_quality(self, obs: np.ndarray, truth: np.ndarray) -> None:
        """Spearman of the LLM's scores (and of the evaluator on every reference state) with true progress."""
        ref = [lab for lab in self.labels if lab.origin == "reference" and lab.truth == lab.truth]
        self.quality["judge/rank_correlation"] = spearman([lab.score for lab in ref], [lab.truth for lab in ref])
        self.quality["judge/reference_states"] = float(len(ref))
        defined = truth == truth
        if self.distiller is not None and defined.sum() >= 3:
            pred, _ = self.distiller.predict(self.features(obs[defined]))
            self.quality["judge/distilled_rank_correlation"] = spearman(pred, truth[defined])
        for key, value in self.quality.items():
            self.train.log_metric(key, value)
        rc = self.quality["judge/rank_correlation"]
        self.summary = (
            f"Rank correlation of the LLM's scores with the true progress ({self.progress_text}) "
            f"on {len(ref)} reference states: **{rc:.3f}**; of the distilled evaluator on every "
            f"reference state: {self.quality.get('judge/distilled_rank_correlation', float('nan')):.3f}\n"
        )

    # -- during training ---------------------------------------------------------------------
    def maybe_round(self) -> None:
        """At each of ``rounds.at`` (budget fractions), score a spread of the agent's states and refit."""
        if not self._rounds_left or self.train.progress < self._rounds_left[0] or self.llm_off:
            return
        while self._rounds_left and self.train.progress >= self._rounds_left[0]:
            self._rounds_left.pop(0)
        if not self._buffer or self.cfg.rounds.states < 1:
            return
        t0 = time.perf_counter()
        obs = np.stack([o for o, _ in self._buffer])
        returns = np.array([r for _, r in self._buffer])
        pred = self.distiller.predict(self.features(obs))[0] if self.distiller is not None else np.zeros(len(obs))
        order = np.argsort(pred, kind="stable")[spread_order(len(obs))]  # from the lowest current score to the highest
        chosen = self._choose(obs, order, self.cfg.rounds.states)
        labels = self._score(
            [(obs[i], returns[i]) for i in chosen],
            "agent",
            f"scoring agent states at {self.train.progress:.0%} of training",
        )
        self._add_labels([lab for lab in labels if lab is not None])
        self._fit()
        self.counts.blocked_seconds += time.perf_counter() - t0

    def _choose(self, obs: np.ndarray, order: np.ndarray, k: int) -> list[int]:
        """The first ``k`` of ``order`` that are not near-duplicates of a scored or chosen state."""
        chosen: list[int] = []
        mode = self.cfg.dedupe
        for i in order:
            if len(chosen) >= k:
                break
            if mode == "caption":
                key = self.task.caption(obs[i])
                if key in self.captions:
                    self.counts.duplicates += 1
                    continue
                self.captions.add(key)
            elif mode == "features":
                f = self.features(obs[i : i + 1])
                if self.seen.query(f)[0][0] <= self.seen.radius:
                    self.counts.duplicates += 1
                    continue
                self.seen.add(f[0], 0.0)
            chosen.append(int(i))
        return chosen

    def _score(self, states: list[tuple[np.ndarray, float]], origin: str, what: str) -> list[Label | None]:
        """Ask the LLM about every state, ``batch`` at a time, with a progress bar; a failed
        call costs its state only."""
        out: list[Label | None] = []
        # a bar of its own in the driver only: a pool worker's trainings draw through the driver's relay
        show = (
            bool(getattr(getattr(self.train.settings, "run", None), "progress", False))
            and multiprocessing.parent_process() is None
        )
        with make_progress(enabled=show) as bar:
            task = bar.add_task(f"{NAME}: {what}", total=len(states)) if bar is not None else None
            for start in range(0, len(states), self.cfg.batch):
                chunk = states[start : start + self.cfg.batch]
                out += self._score_batch(chunk, origin)
                if bar is not None and task is not None:
                    c = self.counts
                    bar.update(task, advance=len(chunk), info=f"{c.llm_calls} calls, {c.llm_seconds:.0f} s in the LLM")
        return out

    def _call(self, state: np.ndarray) -> dict[str, Any]:
        cfg = self.cfg
        messages = build_prompt(self.background, list(cfg.dimensions), self.task.render_state(state), cfg.score)
        if cfg.score == "expected":  # one greedy token and its alternatives
            options: dict[str, Any] = {"n": 1, "temperature": 0.0, "max_tokens": 1, "top_logprobs": cfg.top_logprobs}
        else:
            options = {"n": cfg.samples, "temperature": cfg.temperature, "max_tokens": cfg.max_tokens, "stop": ["\n"]}
        # the seed of the reference rollouts for every call: a state asked again in a later seed or run is cached
        return {"messages": messages, **options, "seed": int(cfg.reference.seed), "tag": f"{NAME}/score"}

    def _score_batch(self, chunk: list[tuple[np.ndarray, float]], origin: str) -> list[Label | None]:
        llm, c = self.train.llm, self.counts
        calls = [self._call(o) for o, _ in chunk]
        t0 = time.perf_counter()
        replies: list[list[Any] | None]
        try:
            many = getattr(llm, "chat_many", None)
            replies = list(many(calls)) if many is not None else [llm.chat(**call) for call in calls]
        except Exception:  # one failed call must not cost the batch: ask each again (answered ones are cached)
            replies = []
            for call in calls:
                try:
                    replies.append(llm.chat(**call))
                except Exception as exc:  # an LLM failure costs one state
                    c.llm_errors += 1
                    self.reasons.append(
                        f"- frames {self.train.frames}: LLM error {type(exc).__name__}: {str(exc)[:200]}"
                    )
                    replies.append(None)
        c.llm_seconds += time.perf_counter() - t0
        c.llm_calls += len(calls)
        out: list[Label | None] = []
        for (obs, ret), reply in zip(chunk, replies):
            if reply is None:
                out.append(None)
                continue
            c.llm_replies_cached += sum(bool(getattr(r, "cached", False)) for r in reply)
            out.append(self._read(obs, ret, reply, origin))
        return out

    def _read(self, obs: np.ndarray, ret: float, replies: list[Any], origin: str) -> Label | None:
        """One state's label from its replies (None when the replies give no score)."""
        cfg, c = self.cfg, self.counts
        feature = self.features(obs[None])[0]
        if cfg.score == "expected":
            got = expected_score(replies[0], cfg.min_mass)
            if got is None:
                c.rejected += 1
                self._note(f"rejected reply {str(getattr(replies[0], 'text', ''))[:40]!r}", obs, origin)
                return None
            c.text_scores += got.source == "text"
            detail = (
                ", ".join(f"{d}: {p:.2f}" for d, p in got.probs.items())
                or f"replied {getattr(replies[0], 'text', '')!r}"
            )
            return Label(obs, feature, got.score, got.source, origin, int(self.train.frames), detail)
        parsed = [parse_reply(str(getattr(r, "text", ""))) for r in replies]
        c.rejected += sum(p is None for p in parsed)
        valid = [p for p in parsed if p is not None]
        median, conf = consensus([p.score for p in valid], len(replies), cfg.agree_tol)
        source, score = "llm", median
        if conf < cfg.confidence:  # the samples disagree: the design note's rule scores the state
            source, score = "rule", rule_score(ret, self.returns_seen)
            c.fallbacks += 1
        reason = next((p.reason for p in valid if p.reason and abs(p.score - median) <= cfg.agree_tol), "")
        detail = f"samples {', '.join(f'{p.score:g}' for p in valid) or 'none parsed'}; confidence {conf:.2f}; {reason}"
        return Label(obs, feature, float(score), source, origin, int(self.train.frames), detail)

    def _note(self, text: str, obs: np.ndarray, origin: str) -> None:
        if len(self.reasons) < self.cfg.max_reasons:
            first = (self.task.render_state(obs).splitlines() or [""])[0]
            self.reasons.append(f"- frames {self.train.frames} ({origin}): {text} | state: {first}")

    def _add_labels(self, labels: list[Label]) -> None:
        self.labels += labels
        for lab in labels:
            if lab.source != "rule":
                self._sparse_guard(lab.score)

    def _fit(self) -> None:
        """Refit the evaluator on every label so far; their statistics start the z-score."""
        usable = self.labels
        if len(usable) < 2:
            self.reasons.append(
                f"- frames {self.train.frames}: {len(usable)} scored state(s): no evaluator, LLM term 0"
            )
            return
        d = self.cfg.distill
        x = np.stack([lab.feature for lab in usable])
        y = np.array([lab.score for lab in usable])
        model = Distiller(x.shape[1], d.hidden, d.members, seed=int(self.train.seed))
        mse = model.fit(x, y, epochs=d.epochs)
        self.distiller = model
        if self.z.count == 0:  # start the running z-score at the scores' own statistics
            self.z.mean, self.z.var, self.z.count = float(y.mean()), max(float(y.var()), 1e-4), 1
        self.train.log_metric("judge/distill_mse", mse)
        self.train.log_metric("judge/labels", float(len(usable)))

    def _sparse_guard(self, score: float) -> None:
        window = self.cfg.sparse.window
        self.recent_scores = (self.recent_scores + [score])[-window:]
        now = len(self.recent_scores) == window and max(self.recent_scores) <= self.cfg.sparse.max_score
        if now != self.sparse:
            self.sparse = now
            what = (
                (
                    f"sparse signal: the last {window} LLM scores were all <= {self.cfg.sparse.max_score:g}; using the "
                    "exploration bonus instead"
                )
                if now
                else "sparse signal over: the LLM scored progress again"
            )
            self.reasons.append(f"- frames {self.train.frames}: **{what}**")
            self.train.log_metric("judge/sparse", float(now))

    # -- main thread: per step ---------------------------------------------------------
    def reward(self, batch: StepBatch) -> torch.Tensor:
        """The per-step path, vectorised over envs (no Python loop over envs)."""
        c = self.counts
        obs = batch.next_obs.detach().cpu().numpy().astype(np.float64)
        B = obs.shape[0]
        if self._b != B:
            self._init_envs(B)
        feats = self.features(obs)
        done = batch.done.detach().cpu().numpy().astype(bool).reshape(B)
        self.ep_return += batch.env_reward.detach().cpu().numpy()
        if not self.llm_off:
            self._keep(obs)
        bonus = self.novelty.visit(feats)  # exploration bonus 1/sqrt(visits of the state's cell)
        if self.distiller is not None:
            due = np.flatnonzero((self._step % self._eval_every == 0) | np.isnan(self.progress))
            if len(due):
                score = np.clip(self.distiller.predict(feats[due])[0], 1.0, 10.0)
                self.progress[due] = score
                self.z.update_batch(score)
                c.distilled += len(due)
        self._step += 1
        # mixed reward
        w_env, w_llm, w_exp = stage_weights(self.train.progress, self._boundaries, self._stages)
        c.steps += 1
        if self.sparse:  # the LLM says nothing useful: its share goes to exploration
            w_exp, w_llm = w_exp + w_llm, 0.0
            c.sparse_steps += 1
        known = ~np.isnan(self.progress)
        z = np.where(known, self.z.normalize(np.nan_to_num(self.progress)), 0.0)
        if self._shaping:
            llm_term = self._gamma * z - self.prev_phi
            self.prev_phi = np.where(done, 0.0, z)
        else:
            llm_term = z
        term = w_llm * llm_term
        c.env_steps += B
        c.changed += int(np.count_nonzero(term))
        s1, s2 = float(term.sum()), float((term * term).sum())
        c.term_sum += s1
        c.term_sq += s2
        r = self._rollout_terms
        r[0], r[1], r[2] = r[0] + B, r[1] + s1, r[2] + s2
        base = batch.reward.detach().cpu().numpy().astype(np.float64)
        mixed = w_env * base + term + w_exp * bonus
        if done.any():  # a new episode starts: the next state is scored afresh
            self.returns_seen = (self.returns_seen + self.ep_return[done].tolist())[-512:]
            self.ep_return[done] = 0.0
            self.progress[done] = np.nan
        return torch.from_numpy(mixed - base).float()

    def _keep(self, obs: np.ndarray) -> None:
        """Offer this step's states to the reservoir of agent states (each kept with equal chance)."""
        cap = self.cfg.rounds.buffer
        for i in range(len(obs)):
            self._offered += 1
            if len(self._buffer) < cap:
                self._buffer.append((obs[i].copy(), float(self.ep_return[i])))
            else:
                j = int(self._rng.integers(self._offered))
                if j < cap:
                    self._buffer[j] = (obs[i].copy(), float(self.ep_return[i]))

    def _init_envs(self, B: int) -> None:
        self._b = B
        self.progress = np.full(B, np.nan)
        self.prev_phi = np.zeros(B)
        self.ep_return = np.zeros(B)

    def rollout_spread(self) -> float:
        """Std of the weighted LLM term over the env steps since the last call (then reset)."""
        n, s1, s2 = self._rollout_terms
        self._rollout_terms = [0.0, 0.0, 0.0]
        return math.sqrt(max(0.0, s2 / n - (s1 / n) ** 2)) if n else 0.0

    # -- summary -----------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        c = self.counts
        n = max(1, c.env_steps)
        mean = c.term_sum / n
        llm_labels = [lab.score for lab in self.labels if lab.source != "rule"]
        out = {
            "llm/calls": float(c.llm_calls),
            "llm/seconds": float(c.llm_seconds),
            "llm/changed_share": c.changed / n,
            "judge/llm_calls": float(c.llm_calls),
            "judge/llm_replies_cached": float(c.llm_replies_cached),
            "judge/llm_term_std": math.sqrt(max(0.0, c.term_sq / n - mean**2)),
            "judge/llm_term_mean": mean,
            "judge/labels": float(len(self.labels)),
            "judge/agent_labels": float(sum(lab.origin == "agent" for lab in self.labels)),
            "judge/distilled": float(c.distilled),
            "judge/llm_share": c.llm_calls / max(1, c.llm_calls + c.distilled),
            "judge/rejected_replies": float(c.rejected),
            "judge/text_scores": float(c.text_scores),
            "judge/fallbacks": float(c.fallbacks),
            "judge/duplicates": float(c.duplicates),
            "judge/llm_errors": float(c.llm_errors),
            "judge/blocked_s": float(c.blocked_seconds),
            "judge/sparse_fraction": c.sparse_steps / max(1, c.steps),
            "judge/progress_mean": float(np.mean(llm_labels)) if llm_labels else float("nan"),
            "judge/progress_std": float(np.std(llm_labels)) if llm_labels else float("nan"),
        }
        out.update(self.quality)
        return out

    def report(self) -> str:
        """The artifact text: the quality check, then every scored state."""
        lines = [f"# Progress judge ({self.counts.llm_calls} LLM calls, {self.counts.llm_seconds:.0f} s)\n"]
        lines += [self.summary] if self.summary else []
        lines += self.reasons
        for lab in self.labels[: self.cfg.max_reasons]:
            first = self.task.render_state(lab.obs).splitlines()
            truth = f"; true progress {lab.truth:g}" if lab.truth == lab.truth else ""
            lines.append(
                f"- frames {lab.frames} ({lab.origin}): **{lab.score:.2f}** ({lab.source}; {lab.detail}{truth}) "
                f"| {' / '.join(first)}"
            )
        return "\n".join(lines) + "\n"


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """The progress reward of a run. Each training's :class:`ProgressJudge` (labels,
    evaluator and statistics) lives in ``train.state[NAME]``, from ``on_train_start``
    to ``on_train_end``; the plugin object holds only the config."""

    def __init__(self, config: Config) -> None:
        self.cfg = config

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Make the training's judge and score the reference states before the loop (blocking)."""
        if not self.cfg.llm_off():
            if train.llm is None:
                raise UserError(
                    "progress_reward needs an LLM (the run's `llm` settings) unless every stage's LLM "
                    "weight is 0 (the no-LLM control)."
                )
            warm_up(train.llm)
        judge = train.state[NAME] = ProgressJudge(train, self.cfg)
        judge.prepare()

    @hookimpl
    def compute_reward(self, train: TrainContext, batch: StepBatch) -> torch.Tensor | None:
        """The mixed reward minus the reward so far (the hook's terms are added)."""
        judge = train.state.get(NAME)
        return judge.reward(batch) if judge is not None else None

    @hookimpl
    def on_rollout(self, train: TrainContext) -> None:
        """Score the agent's states at the round points; log the LLM term's spread per batch."""
        judge = train.state.get(NAME)
        if judge is None:
            return
        judge.maybe_round()
        c = judge.counts
        train.log_metric("judge/llm_calls", c.llm_calls)
        train.log_metric("judge/llm_term_std", judge.rollout_spread())
        train.log_metric("judge/changed_share", c.changed / max(1, c.env_steps))

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """Put the judge's metrics on the result and its scored states in a text."""
        judge = train.state.pop(NAME, None)
        if judge is None:
            return
        result.metrics.update({k: v for k, v in judge.metrics().items() if v == v})
        train.log_text(f"{NAME}/reasons.md", judge.report())
