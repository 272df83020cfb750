"""rlaif_preference: reward from an LLM's preferences between trajectory segments (RLAIF).

Methods: Motif (Klissarov et al., "Motif: Intrinsic Motivation from Artificial
Intelligence Feedback", ICLR 2024) and RL-VLM-F (Wang et al., "RL-VLM-F: Reinforcement
Learning from Vision Language Foundation Model Feedback", ICML 2024), both after the
preference-based RL of Christiano et al. (2017).

1. Segments: training rollouts are cut into segments of ``segment_len`` steps (never
   across an episode end); each has a text rendering (the task's plain-language account
   of it when the task has one, else its length and end, the task's rendering of its
   last state, how the task's scalar fields moved, its actions) and its env return.
2. Labels: the LLM sees the goal and two renderings. With ``judge: logprobs`` it answers
   with one digit; the vote is the probability of "1" against "2", and the label the
   mean log-odds of the votes from both orders of the pair, which cancels a position
   bias (soft AI labels as in Lee et al., "RLAIF: Scaling Reinforcement Learning from
   Human Feedback with AI Feedback", 2023). With ``judge: text`` it writes 1 (first
   better), 0 (second), 0.5 (tie) or None (cannot tell), in Motif's shape (describe
   each, compare, then answer) or answer first; ``samples`` votes per pair, every other
   one with the pair swapped, and the label is their mean.
   Labels are cached; the ``label_preferences`` hook makes the labeller replaceable.
3. Reward model: an ensemble (3 by default) of MLPs ``r(s)``; a segment's score is the
   sum over its states; trained with the Bradley-Terry loss, i.e. the cross-entropy of
   ``sigmoid(R_a - R_b)`` against the (soft) label.
4. Reward: the ensemble mean, z-scored with running statistics, times ``scale``, zeroed
   below ``threshold`` (Motif's thresholding), added to or replacing the env reward.
5. Modes: ``online`` asks for ``pairs_per_query`` labels every ``label_every`` frames up
   to ``label_budget`` (RL-VLM-F); ``offline`` labels segments of a random-policy dataset
   before training and keeps the reward model fixed (Motif). Online, a worker thread
   labels and trains; the training loop never waits for it.

Label accuracy against the env's own segment returns is logged when they differ.
Config: ``conf/plugins/rlaif_preference.yaml`` (schema: :class:`Config`). Each
training's learner lives in ``train.state["rlaif_preference"]``; the labeller and its
label cache belong to the run's plugin object.
"""

from __future__ import annotations

import hashlib
import math
import queue
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core import PluginConfig, hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from core.context import StepBatch, TrainContext
    from core.records import TrainResult

NAME = "rlaif_preference"
JUDGES = ("logprobs", "text")
LABELLING = ("online", "offline")
MODES = ("add", "replace")


@dataclass
class Offline:
    """``offline``: the random-policy dataset that offline labelling draws pairs from."""

    envs: int = 4  # random-policy envs
    steps: int = 256  # steps per env


@dataclass
class Config(PluginConfig):
    """``plugins.rlaif_preference``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`
    (this plugin proposes nothing: the defaults leave the run's loop as it is)."""

    goal: str | None = None  # goal text shown to the labeller; null = the task's goal
    # online: labels during training (RL-VLM-F); offline: label a random-policy dataset first (Motif)
    labelling: str = "online"
    segment_len: int = 16  # steps per segment (segments never cross an episode end)
    min_segment_len: int = 4  # shorter segments are kept only when their episode terminated in them
    pool_size: int = 512  # most recent segments kept to draw pairs from
    label_every: int = 2048  # online: frames between labelling requests
    pairs_per_query: int = 2  # online: pairs labelled per request
    label_budget: int = 8  # total pairs labelled per training (online and offline)
    # logprobs: a one-digit answer, the vote is P("1") / (P("1") + P("2")) (Lee et al. 2023), the label their
    # mean log-odds over both orders; text: written answers, parsed
    judge: str = "logprobs"
    # judge=logprobs: alternatives of the answer token read (a backend without log-probabilities falls back to the
    # digit itself)
    top_logprobs: int = 10
    # judge=text: votes per pair; the label is their mean (its side of 0.5 = the majority; a split = a tie)
    samples: int = 2
    # every other vote (logprobs: the second call) sees the pair in the other order (cancels the small model's
    # position bias)
    swap: bool = True
    # judge=text, true: Motif's shape (describe each segment, compare, then answer); false: answer first, then a
    # short reason
    describe: bool = False
    summary_fields: int = 6  # scalar fields whose change over the segment is stated (start -> end, min, max)
    temperature: float = 0.3  # judge=text: sampling temperature (logprobs reads one greedy token)
    # judge=text: cap on each reply: the answer and a short reason (use ~96 with describe: true)
    max_tokens: int = 40
    seed: int = 0  # labeller sampling seed (the LLM cache makes labels reproducible)
    min_pairs: int = 2  # labelled pairs needed before the reward model is trained
    members: int = 3  # reward-model ensemble size
    hidden: int = 64  # hidden units of each member
    epochs: int = 100  # full-batch Adam steps per fit (the model is refit after each labelling round)
    ema: float = 0.99  # decay of the running mean and variance that z-score the model's reward
    scale: float = 0.1  # the z-scored reward is multiplied by this
    threshold: float | None = None  # z-scored rewards below this become 0 (Motif's thresholding); null = keep all
    mode: str = "add"  # add: env reward + scaled model reward; replace: the scaled model reward alone
    # after training, wait up to this long for the LLM call in progress (so it is logged); 0 = do not wait
    finish_s: float = 30.0
    max_reasons: int = 200  # labelling replies kept for the artifact rlaif_preference/labels.md
    offline: Offline = field(default_factory=Offline)  # offline labelling dataset

    def check(self) -> None:
        super().check()
        for name, allowed in (("labelling", LABELLING), ("judge", JUDGES), ("mode", MODES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
        for name in ("segment_len", "min_segment_len", "label_every", "pairs_per_query", "top_logprobs", "samples",
                     "max_tokens", "min_pairs", "members", "hidden", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pool_size < 2:
            raise ValueError(f"pool_size must be >= 2 (pairs are drawn from it), got {self.pool_size}")
        if self.label_budget < 0:
            raise ValueError(f"label_budget must be >= 0, got {self.label_budget}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.offline.envs < 1 or self.offline.steps < 1:
            raise ValueError(f"offline.envs and offline.steps must be >= 1, got {self.offline.envs} and {self.offline.steps}")

# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = "You are a fair and careful judge of how well an agent is doing at its task."

# The question comes last: a 1.5B model answered near chance with it before the
# segments (docs/plugins/rlaif_preference.md has the measurements).
PROMPT = """Goal: {goal}

Segment 1: {a}

Segment 2: {b}

{instruction}"""

# judge=logprobs: one token, read as P("1") against P("2")
DIGIT = ("Which segment is better for the goal? Reply with a single digit: 1 if Segment 1 is better, "
         "2 if Segment 2 is better.")

# Motif's shape: describe each segment, compare, then a fixed-format answer
DESCRIBE = """First describe in one short sentence what happens in each segment. Then compare them:
which one makes more progress towards the goal? End with exactly one line, one of:
Answer: 1
Answer: 2
Answer: tie
Answer: unknown"""

# the answer first, then a short reason: a few tokens per label on a slow local model
ANSWER_FIRST = """Which segment makes more progress towards the goal? Reply with ONE of these lines,
then " | Reason: " and one short sentence:
Answer: 1
Answer: 2
Answer: tie
Answer: unknown"""

_ANSWER = re.compile(r"answer(?:\s+is)?\W{0,3}\s*[:=]?\s*\**\s*\(?(segment\s*1|segment\s*2|1|2|tie|unknown|none|cannot tell)\b",
                     re.I)
# small models often skip the answer line and end with a sentence instead
_VERDICT = re.compile(r"segment\s*(1|2)\b[^.\n]{0,40}?\b(?:makes|made|is|shows|has|achieves|does)\b[^.\n]{0,30}?"
                      r"\b(?:more|better|most|greater)\b|(neither|both) segments?\b[^.\n]{0,40}?\b(?:more|better|equal|same)",
                      re.I)
_VALUES = {"1": 1.0, "2": 0.0, "tie": 0.5}
_PARROT = re.compile(r"answer\W{0,3}\s*[:=]?\s*(?:1|2|tie)\s*(?:,|/|\bor\b)\s*(?:1|2|tie|unknown)\b", re.I)


# -- pure pieces ---------------------------------------------------------------------------

@dataclass
class Segment:
    """A piece of one episode: its states (after each step), actions, env return, end."""

    obs: np.ndarray  # [L, D] the states reached by the segment's steps
    actions: list[Any]
    env_return: float
    ended: bool  # the episode terminated at the segment's last step
    text: str = ""


def build_prompt(goal: str, a: str, b: str, judge: str = "logprobs", describe: bool = False) -> list[dict[str, str]]:
    """The chat messages that ask which of two segment renderings is better.

    ``judge="logprobs"``: a one-digit answer; ``"text"``: a written answer, with Motif's
    analysis before it when ``describe``, else answer first with a short reason.
    """
    instruction = DIGIT if judge == "logprobs" else DESCRIBE if describe else ANSWER_FIRST
    user = PROMPT.format(goal=goal, a=a, b=b, instruction=instruction)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def parse_label(text: str) -> float | None:
    """1.0 / 0.0 / 0.5 from the reply's last ``Answer:`` line; None for unknown or malformed
    (including the answer template copied back with its options).

    Without an answer line, the last verdict sentence counts ("Segment 2 makes more
    progress", "neither segment is better" = tie).
    """
    if _PARROT.search(text):  # the template copied back ("Answer: 2, tie or unknown") decides nothing
        return None
    found = _ANSWER.findall(text)
    if not found:
        verdicts = _VERDICT.findall(text)
        if not verdicts:
            return None
        number, neither = verdicts[-1]
        return _VALUES[number] if number else 0.5
    answer = re.sub(r"\s+", "", found[-1].lower()).replace("segment", "")
    return _VALUES.get(answer)


def digit_preference(reply: Any, min_mass: float = 1e-3) -> float | None:
    """P(first segment better) from a one-digit reply: ``P("1") / (P("1") + P("2"))`` over
    the first token's alternatives; without log-probabilities (a backend that drops
    them) the digit itself (1.0 / 0.0). None when neither digit is likely (< ``min_mass``)
    or the reply is not a digit."""
    logprobs = getattr(reply, "logprobs", None)
    if logprobs:
        p1, p2 = math.exp(logprobs.get("1", -math.inf)), math.exp(logprobs.get("2", -math.inf))
        return p1 / (p1 + p2) if p1 + p2 >= min_mass else None
    digit = reply.text.strip()[:1]
    return _VALUES.get(digit) if digit in ("1", "2") else None


def vote(labels: list[float | None]) -> float | None:
    """The soft label of several samples: the mean of the decided ones (None if none).

    Its side of 0.5 is the majority; votes that cancel out give a tie (0.5).
    """
    decided = [x for x in labels if x is not None]
    return float(np.mean(decided)) if decided else None


def logit_vote(probs: list[float | None]) -> float | None:
    """The soft label of probability votes from both orders: the sigmoid of their mean
    log-odds (None if none decided).

    If showing a segment first adds ``b`` to the judge's log-odds, the two orders give
    ``t + b`` and ``t - b`` (flipped back), and their mean is the unbiased ``t``; the
    mean of the probabilities instead is pulled towards 0.5 when ``b`` is large. Votes
    of exactly 0 or 1 (digits read without log-probabilities) are averaged as they are.
    """
    decided = [x for x in probs if x is not None]
    if not decided or not all(0.0 < x < 1.0 for x in decided):
        return vote(decided)
    return float(1 / (1 + np.exp(-np.mean([np.log(x / (1 - x)) for x in decided]))))


def env_preference(a: Segment, b: Segment, tol: float = 1e-6) -> float:
    """What the env's own return says: 1.0 (a higher), 0.0 (b higher), 0.5 (equal)."""
    if abs(a.env_return - b.env_return) <= tol:
        return 0.5
    return 1.0 if a.env_return > b.env_return else 0.0


def label_accuracy(labels: list[float | None], truths: list[float]) -> tuple[float, int]:
    """(agreement, count) over pairs where both the label and the env return decide."""
    pairs = [(lab, t) for lab, t in zip(labels, truths) if lab is not None and lab != 0.5 and t != 0.5]
    if not pairs:
        return float("nan"), 0
    return float(np.mean([(lab > 0.5) == (t > 0.5) for lab, t in pairs])), len(pairs)


def _number(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def summarize_fields(task: Any, obs: np.ndarray, limit: int = 6) -> str:
    """How the task's scalar fields moved over a segment, in words: start -> end and range.

    Generic over tasks (read from ``task.state_fields``): fields that did not change are
    left out; at most ``limit`` fields, those that changed most relative to their range.
    """
    rows = []
    for f in task.state_fields:
        if f.size != 1 or f.shape:
            continue
        v = np.asarray(obs[:, f.start], np.float64)
        lo, hi = float(v.min()), float(v.max())
        if hi - lo <= 1e-9:
            continue
        unit = f" {f.unit}" if f.unit else ""
        weight = abs(v[-1] - v[0]) / (max(abs(lo), abs(hi)) + 1e-9)
        rows.append((weight, f"{f.name} {_number(v[0])} -> {_number(v[-1])}{unit} (range {_number(lo)} to {_number(hi)})"))
    rows.sort(key=lambda r: -r[0])
    return "; ".join(text for _, text in rows[:limit]) or "nothing changed"


def render_segment(task: Any, seg: Segment, fields: int = 6) -> str:
    """A segment as text: the task's plain-language account (``Task.describe_segment``)
    when it has one; otherwise its length and end first (the facts a judge weighs most),
    the task's rendering of its last state, how its scalar fields moved, its actions."""
    account = task.describe_segment(seg.obs, seg.ended)
    if account:
        return account
    counts: dict[str, int] = {}
    for a in seg.actions:
        counts[str(a)] = counts.get(str(a), 0) + 1
    acts = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    end = ("the episode ENDED (terminated) at its last step: a failure or a success, judge which from the goal"
           if seg.ended else "the episode was still running at its end")
    return (f"{len(seg.obs)} steps; {end}.\nEnd state:\n{task.render_state(seg.obs[-1])}\n"
            f"Changes: {summarize_fields(task, seg.obs, fields)}\nActions: {acts}")


def split_segments(obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray,
                   done: np.ndarray, length: int, min_len: int) -> list[Segment]:
    """Cut one env's rollout ``[T, ...]`` into segments of ``length`` steps within episodes.

    A segment shorter than ``min_len`` is kept only when the episode terminated in it (a
    failure or a success is what preferences are about).
    """
    out, start = [], 0
    T = len(obs)
    while start < T:
        stop = start
        while stop < T and stop - start < length:
            stop += 1
            if done[stop - 1]:
                break
        ended = bool(terminated[stop - 1])
        if stop - start >= min_len or ended:
            acts = [int(a) if np.ndim(a) == 0 else np.round(a, 2).tolist() for a in actions[start:stop]]
            out.append(Segment(obs[start:stop].copy(), acts, float(rewards[start:stop].sum()), ended))
        start = stop
    return out


def bt_loss(score_a: torch.Tensor, score_b: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry loss: cross-entropy of ``P(a > b) = sigmoid(R_a - R_b)`` with soft labels."""
    return torch.nn.functional.binary_cross_entropy_with_logits(score_a - score_b, label)


class RewardModel:
    """An ensemble of MLPs ``r(s)``; a segment's score is the sum of ``r`` over its states."""

    def __init__(self, dim: int, members: int = 3, hidden: int = 64, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.nets = [torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                         torch.nn.Tanh(), torch.nn.Linear(hidden, 1)) for _ in range(members)]

    @staticmethod
    def _pad(segments: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(len(s) for s in segments)
        x = np.zeros((len(segments), L, segments[0].shape[-1]), np.float32)
        mask = np.zeros((len(segments), L), np.float32)
        for i, s in enumerate(segments):
            x[i, : len(s)], mask[i, : len(s)] = s, 1.0
        return torch.from_numpy(x), torch.from_numpy(mask)

    def fit(self, a: list[np.ndarray], b: list[np.ndarray], y: list[float], epochs: int = 100, lr: float = 3e-3) -> float:
        """Fit every member on a bootstrap of the labelled pairs; returns the mean final loss."""
        xa, ma = self._pad(a)
        xb, mb = self._pad(b)
        yt = torch.tensor(y, dtype=torch.float32)
        losses = []
        for k, net in enumerate(self.nets):
            idx = torch.randint(len(yt), (len(yt),), generator=torch.Generator().manual_seed(k))
            opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=1e-4)
            for _ in range(epochs):
                ra = (net(xa[idx]).squeeze(-1) * ma[idx]).sum(-1)
                rb = (net(xb[idx]).squeeze(-1) * mb[idx]).sum(-1)
                loss = bt_loss(ra, rb, yt[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(float(loss.detach()))
        return float(np.mean(losses))

    @torch.no_grad()
    def reward(self, x: np.ndarray) -> np.ndarray:
        xt = torch.as_tensor(x, dtype=torch.float32)
        return torch.stack([net(xt).squeeze(-1) for net in self.nets]).mean(0).numpy()


# -- the labeller (behind the label_preferences hook) --------------------------------------


@dataclass
class Labeller:
    """Asks the LLM for preference labels; caches them (both orders) and counts its work."""

    cache: dict[str, float | None] = field(default_factory=dict)
    calls: int = 0
    cache_hits: int = 0
    rejected: int = 0
    latency: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)

    @staticmethod
    def key(goal: str, a: str, b: str) -> str:
        return hashlib.sha256("\x00".join((goal, a, b)).encode()).hexdigest()

    def label(self, llm: Any, cfg: Config, goal: str, pairs: list[tuple[str, str]]) -> list[float | None]:
        out: list[float | None] = []
        for a, b in pairs:
            k, k_rev = self.key(goal, a, b), self.key(goal, b, a)
            if k in self.cache or k_rev in self.cache:
                self.cache_hits += 1
                hit = self.cache.get(k, None) if k in self.cache else self.cache[k_rev]
                out.append(hit if k in self.cache or hit is None else 1.0 - hit)
                continue
            value, votes, texts = self.ask(llm, cfg, goal, a, b)
            self.cache[k] = value
            out.append(value)
            shown = " || ".join(t.strip().replace("\n", " ")[:300] for t in texts)
            self.replies.append(f"label {value} (votes {votes}): {shown}")
        return out

    def ask(self, llm: Any, cfg: Config, goal: str, a: str, b: str) -> tuple[float | None, list[float | None], list[str]]:
        """Votes on one pair (label, votes, reply texts).

        With ``swap`` the pair is also shown in the other order (its vote is flipped
        back), which cancels position bias: a model that always picks one position
        then votes a tie instead of a wrong label. ``judge=logprobs``: one greedy digit
        per order, the vote is P(first better) (:func:`digit_preference`).
        ``judge=text``: ``samples`` sampled replies, shared between the orders.
        """
        judge, swap = cfg.judge, cfg.swap
        if judge == "logprobs":  # one greedy digit per order
            samples = 2 if swap else 1
            options = {"temperature": 0.0, "max_tokens": 1, "top_logprobs": cfg.top_logprobs}
        else:
            samples = cfg.samples
            options = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
        orders = [(a, b, False), (b, a, True)] if swap and samples > 1 else [(a, b, False)]
        votes: list[float | None] = []
        texts: list[str] = []
        for j, (first, second, flipped) in enumerate(orders):
            n = samples // len(orders) + (j < samples % len(orders))
            t0 = time.perf_counter()
            messages = build_prompt(goal, first, second, judge, cfg.describe)
            replies = llm.chat(messages, n=n, seed=cfg.seed, tag=f"{NAME}/label", **options)
            self.calls += 1
            if not all(r.cached for r in replies):
                self.latency.append(time.perf_counter() - t0)
            for r in replies:
                x = digit_preference(r) if judge == "logprobs" else parse_label(r.text)
                self.rejected += x is None
                votes.append(None if x is None else (1.0 - x if flipped else x))
                texts.append(f"{r.text.strip()} (P(1st better) {x:.3f})" if judge == "logprobs" and x is not None
                             else r.text)
        return (logit_vote(votes) if judge == "logprobs" else vote(votes)), votes, texts



# -- the preference learner ---------------------------------------------------------------


class PreferenceLearner:
    """Per-training state: segment pool, labelling worker, reward model, statistics.

    ``labeller`` is the run's (the plugin object's): its label cache serves every
    training of the run in this process.
    """

    def __init__(self, train: TrainContext, cfg: Config, labeller: Labeller) -> None:
        self.train, self.cfg, self.task, self.labeller = train, cfg, train.task, labeller
        self.goal = cfg.goal or train.task.goal
        self.pool: list[Segment] = []
        self.jobs: queue.Queue[list[tuple[Segment, Segment]]] = queue.Queue(maxsize=2)
        self.pairs: list[tuple[Segment, Segment, float]] = []  # labelled (a, b, label)
        self.labels: list[float | None] = []
        self.truths: list[float] = []
        self.requested = 0
        self.model: RewardModel | None = None
        self.rm_loss = float("nan")
        self.scale_obs: np.ndarray | None = None
        self.mean, self.var = 0.0, 1.0
        self.next_label_at = cfg.label_every
        self.rng = random.Random(int(train.seed))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- data --------------------------------------------------------------------------
    def features(self, obs: np.ndarray) -> np.ndarray:
        if self.scale_obs is None:
            return obs
        return obs / self.scale_obs

    def add_rollout(self, batch: Any) -> None:
        """Cut the batch ``[envs, steps]`` into segments and keep them in the pool."""
        dim = self.task.obs_dim
        nxt = batch.get("next")
        obs = nxt.get("observation")[..., :dim].numpy()
        rew = (nxt.get("env_reward") if "env_reward" in nxt.keys() else nxt.get("reward")).squeeze(-1).numpy()
        done = nxt.get("done").squeeze(-1).numpy()
        term = nxt.get("terminated").squeeze(-1).numpy() if "terminated" in nxt.keys() else done
        act = batch.get("action").numpy()
        if self.scale_obs is None:
            std = obs.reshape(-1, dim).std(0)
            self.scale_obs = np.where(std > 1e-6, std, 1.0)
        for e in range(obs.shape[0]):
            self.pool += split_segments(obs[e], act[e], rew[e], term[e], done[e], self.cfg.segment_len,
                                        self.cfg.min_segment_len)
        self.pool = self.pool[-self.cfg.pool_size:]

    def sample_pairs(self, n: int) -> list[tuple[Segment, Segment]]:
        if len(self.pool) < 2:
            return []
        return [tuple(self.rng.sample(self.pool, 2)) for _ in range(n)]  # type: ignore[misc]

    # -- labelling and fitting (the worker in online mode) -----------------------------
    def label_and_fit(self, pairs: list[tuple[Segment, Segment]]) -> None:
        for seg in (s for p in pairs for s in p):
            if not seg.text:
                seg.text = render_segment(self.task, seg, self.cfg.summary_fields)
        hook = self.train.hook
        for a, b in pairs:  # one pair per request: each label counts as soon as it is back
            texts = [(a.text, b.text)]
            labels = hook.label_preferences(run=self.train, goal=self.goal, pairs=texts) if hook is not None else None
            if labels is None:
                labels = self.labeller.label(self.train.llm, self.cfg, self.goal, texts)
            lab = labels[0]
            self.labels.append(lab)
            self.truths.append(env_preference(a, b))
            if lab is not None:
                self.pairs.append((a, b, float(lab)))
        self.fit()

    def fit(self) -> None:
        if len(self.pairs) < self.cfg.min_pairs:
            return
        a = [self.features(p[0].obs) for p in self.pairs]
        b = [self.features(p[1].obs) for p in self.pairs]
        model = RewardModel(a[0].shape[-1], self.cfg.members, self.cfg.hidden, seed=int(self.train.seed))
        self.rm_loss = model.fit(a, b, [p[2] for p in self.pairs], epochs=self.cfg.epochs)
        self.model = model  # one assignment: the reward side sees the old or the new model
        self.train.log_metric("preference/rm_loss", self.rm_loss)

    def maybe_request(self) -> None:
        """Online mode: queue a labelling job every ``label_every`` frames within the budget."""
        cfg = self.cfg
        if self.train.frames < self.next_label_at or self.requested >= cfg.label_budget:
            return
        self.next_label_at += cfg.label_every
        n = min(cfg.pairs_per_query, cfg.label_budget - self.requested)
        pairs = self.sample_pairs(n)
        if pairs:
            try:
                self.jobs.put_nowait(pairs)
                self.requested += len(pairs)
            except queue.Full:  # the worker is still busy: skip this round, never wait
                pass

    def start(self) -> None:
        # not a daemon: at exit Python waits for the LLM call in progress instead of
        # freeing the model under it (a crash)
        self._thread = threading.Thread(target=self._work, name="preference-labeller", daemon=False)
        self._thread.start()

    def stop(self, wait_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _work(self) -> None:
        torch.set_num_threads(1)
        while not self._stop.is_set():
            try:
                pairs = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.label_and_fit(pairs)
            except Exception as exc:  # noqa: BLE001 - a failed labelling round costs its labels
                self.labeller.replies.append(f"labelling failed: {type(exc).__name__}: {str(exc)[:300]}")

    # -- offline mode ------------------------------------------------------------------
    def offline(self) -> None:
        """Motif: label pairs from a random-policy dataset before training, fit once."""
        cfg = self.cfg
        env = self.task.make_env(cfg.offline.envs, int(self.train.seed) + 7)
        obs, _ = env.reset(seed=int(self.train.seed) + 7)
        rows: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "act", "rew", "term", "done")}
        for _ in range(cfg.offline.steps):
            act = env.action_space.sample()
            nobs, rew, term, trunc, info = env.step(act)
            final = np.array(nobs, copy=True)
            for i in np.flatnonzero(np.logical_or(term, trunc)):
                final[i] = info["final_obs"][i]
            for k, v in zip(rows, (final, act, rew, term, np.logical_or(term, trunc))):
                rows[k].append(np.asarray(v))
        env.close()
        arr = {k: np.stack(v, axis=1) for k, v in rows.items()}  # [envs, T, ...]
        dim = self.task.obs_dim
        std = arr["obs"][..., :dim].reshape(-1, dim).std(0)
        self.scale_obs = np.where(std > 1e-6, std, 1.0)
        for e in range(arr["obs"].shape[0]):
            self.pool += split_segments(arr["obs"][e][:, :dim].astype(np.float32), arr["act"][e], arr["rew"][e],
                                        arr["term"][e], arr["done"][e], cfg.segment_len, cfg.min_segment_len)
        pairs = self.sample_pairs(cfg.label_budget)
        self.requested = len(pairs)
        self.label_and_fit(pairs)

    # -- reward ------------------------------------------------------------------------
    def reward(self, batch: StepBatch) -> torch.Tensor | None:
        model = self.model
        if model is None:
            return None
        r = model.reward(self.features(batch.next_obs.detach().cpu().numpy()))
        d = self.cfg.ema
        self.mean = d * self.mean + (1 - d) * float(r.mean())
        self.var = d * self.var + (1 - d) * float(((r - self.mean) ** 2).mean())
        z = (r - self.mean) / (math.sqrt(self.var) + 1e-8)
        if self.cfg.threshold is not None:
            z = np.where(z >= self.cfg.threshold, z, 0.0)
        term = self.cfg.scale * z
        if self.cfg.mode == "replace":
            term = term - batch.reward.detach().cpu().numpy()
        return torch.as_tensor(term, dtype=torch.float32)

    def metrics(self) -> dict[str, float]:
        acc, n = label_accuracy(self.labels, self.truths)
        lab = self.labeller
        return {
            "preference/labels": float(len(self.labels)),
            "preference/label_accuracy": acc,
            "preference/label_decisive": float(n),
            "preference/ties": float(sum(x == 0.5 for x in self.labels)),
            "preference/unknown": float(sum(x is None for x in self.labels)),
            "preference/rm_loss": self.rm_loss,
            "preference/segments": float(len(self.pool)),
            "judge/llm_calls": float(lab.calls),
            "judge/cache_hits": float(lab.cache_hits),
            "judge/rejected_replies": float(lab.rejected),
            "judge/latency_llm_s": float(np.mean(lab.latency)) if lab.latency else float("nan"),
        }


def _preload(llm: Any) -> None:
    """Load an in-process model before the loop: loading holds the GIL for seconds."""
    settings = getattr(llm, "settings", None)
    if settings is not None and getattr(settings, "is_embedded", False):
        from core.llm import embedded

        embedded.get_server(llm.model.split("/", 1)[1])


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """RLAIF for a run. The labeller (and its label cache) is the run's; each training's
    :class:`PreferenceLearner` (segments, worker thread, reward model) lives in
    ``train.state[NAME]``, from ``on_train_start`` to ``on_train_end``."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.labeller = Labeller()

    @hookimpl
    def label_preferences(self, run: Any, goal: str, pairs: list[tuple[str, str]]) -> list[float | None] | None:
        """Label segment pairs with the run's LLM (the configured judge), through the label cache."""
        return self.labeller.label(run.llm, self.cfg, goal, pairs)

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Online: start the labelling worker. Offline: label a random-policy dataset first."""
        learner = train.state[NAME] = PreferenceLearner(train, self.cfg, self.labeller)
        _preload(train.llm)
        if self.cfg.labelling == "offline":
            learner.offline()
        else:
            learner.start()

    @hookimpl
    def on_rollout(self, train: TrainContext, batch: Any) -> None:
        """Keep the batch's segments; online, ask for labels on schedule (never waits)."""
        learner = train.state.get(NAME)
        if learner is None:
            return
        if self.cfg.labelling == "online":
            learner.add_rollout(batch)
            learner.maybe_request()
        train.log_metric("preference/labels", len(learner.labels))

    @hookimpl
    def compute_reward(self, train: TrainContext, batch: StepBatch) -> torch.Tensor | None:
        """The reward model's scaled, thresholded reward (added, or replacing the reward)."""
        learner = train.state.get(NAME)
        return learner.reward(batch) if learner is not None else None

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """Stop the worker; metrics on the result, the LLM's labelling replies as a text."""
        learner = train.state.pop(NAME, None)
        if learner is None:
            return
        learner.stop(self.cfg.finish_s)
        result.metrics.update({k: v for k, v in learner.metrics().items() if v == v})
        text = "\n".join(f"- {r}" for r in self.labeller.replies[-self.cfg.max_reasons:])
        train.log_text(f"{NAME}/labels.md", f"# Preference labels ({len(learner.labels)})\n\n{text}\n")
