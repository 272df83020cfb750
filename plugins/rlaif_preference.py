"""rlaif_preference: a reward model fitted to an LLM's preferences between observations (RLAIF).

Methods: Motif (Klissarov et al., "Motif: Intrinsic Motivation from Artificial
Intelligence Feedback", ICLR 2024) and RL-VLM-F (Wang et al., "RL-VLM-F: Reinforcement
Learning from Vision Language Foundation Model Feedback", ICML 2024), both after the
preference-based RL of Christiano et al. (2017).

1. States: ``labelling: offline`` (Motif, the default) collects a random-policy dataset
   before training; ``online`` (RL-VLM-F) keeps the agent's own recent rollouts. Each
   state has the task's coarse caption (``Task.caption``: on Crafter what is within two
   cells, the items held, low vitals), so that a few hundred captions stand for thousands
   of states, and its ground truth: the env return of its episode so far (on Crafter, the
   achievements unlocked so far, plus the health term).
2. Items: what the LLM compares. ``unit: caption`` (default): the distinct captions, as
   Motif compares captions (NetHack messages); ``unit: segment``: pieces of
   ``segment_len`` steps, rendered as text (the older variant).
3. Pairs: distinct items, chosen to cover many items (every item in one pair before any is
   in two; frequent items first) and to differ (of a few candidate partners, the one
   sharing the fewest words).
4. Labels: the LLM sees the goal and the two texts. ``judge: logprobs``: one digit; the
   vote is ``P("1") / (P("1") + P("2"))``, asked in both orders, the label the sigmoid of
   the votes' mean log-odds, which cancels a position bias (soft AI labels as in Lee et
   al., "RLAIF", 2023). ``judge: text``: written answers (Motif's describe-then-answer
   shape with ``describe``), parsed. Pairs are labelled in batches (concurrent calls),
   up to ``label_budget`` pairs and ``label_seconds``; labels are cached per (goal, pair)
   on the plugin object, so the run's seeds share them, and the LLM response cache replays
   identical prompts across runs. ``control`` gives uninformative labels (all ties, or
   coin flips) through the same pipeline without the LLM. The ``label_preferences`` hook,
   which this plugin adds (``HOOKSPECS``), makes the labeller replaceable.
5. Reward model: an ensemble of ``r(x)`` over the caption's words (one column per word;
   ``features: obs``: the scaled observation), linear by default (``hidden: 0``), all
   starting at ``r = 0``; an item's score is the sum of ``r`` over its states; fitted with
   the Bradley-Terry loss (cross-entropy of ``sigmoid(R_a - R_b)`` against the soft label)
   on all labelled pairs but a held-out share (``heldout``). Reported: agreement with the
   held-out LLM labels and with the ground truth's order of the dataset's items.
6. Reward: ``r(s')`` less its mean over the dataset's states, in the Bradley-Terry model's
   own units (log-odds of the LLM's preference; not standardised, so labels near 0.5 give
   a reward near 0 instead of noise blown up to full scale), zeroed below ``threshold``
   (Motif's thresholding), times ``scale``, added to or replacing the env reward. A model
   that learned nothing (``r = 0``, as all-tie labels leave it) adds nothing.

Config: ``conf/plugins/rlaif_preference.yaml`` (schema: :class:`Config`). Each training's
learner lives in ``train.state["rlaif_preference"]``; the labeller and its label cache
belong to the run's plugin object.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.plugin import (
    BackgroundCalls,
    PluginConfig,
    StepBatch,
    TrainContext,
    TrainResult,
    hookimpl,
    hookspec,
    make_progress,
    task_steps,
    warm_up,
)

NAME = "rlaif_preference"
JUDGES = ("logprobs", "text")
LABELLING = ("online", "offline")
UNITS = ("caption", "segment")
FEATURES = ("caption", "obs")
CONTROLS = ("ties", "random")
MODES = ("add", "replace")


@dataclass
class Offline:
    """``offline``: the random-policy dataset that pairs are drawn from (Motif's dataset)."""

    envs: int = 8  # random-policy envs
    steps: int = 512  # steps per env


@dataclass
class Config(PluginConfig):
    """``plugins.rlaif_preference``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`
    (this plugin proposes nothing: the defaults leave the run's loop as it is)."""

    goal: str | None = None  # goal text shown to the labeller; null = the task's goal
    # offline: label a random-policy dataset before training (Motif); online: the agent's rollouts during it (RL-VLM-F)
    labelling: str = "offline"
    # what the LLM compares: caption (one state's coarse caption, Task.caption, as Motif compares captions) or
    # segment (segment_len steps rendered as text)
    unit: str = "caption"
    # reward-model input per state: caption (one column per word of its caption) or obs (the observation scaled
    # by its spread in the states seen)
    features: str = "caption"
    # null: the LLM labels; ties: every label 0.5; random: a fair coin per pair (0 or 1) - the control arm,
    # the same pipeline without the LLM
    control: str | None = None
    label_budget: int = 200  # pairs labelled per training (cached labels included; online and offline)
    label_seconds: float = 600.0  # wall seconds of LLM labelling per training; 0 = no limit
    batch: int = 8  # pairs per batch of concurrent LLM calls (llm.chat_many; both orders of each pair)
    heldout: float = 0.2  # share of the labelled pairs kept out of the fit, to measure agreement on
    candidates: int = 16  # partners drawn for each item of a pair; the one sharing the fewest words is taken
    segment_len: int = 16  # unit=segment: steps per segment (segments never cross an episode end)
    min_segment_len: int = 4  # unit=segment: shorter segments are kept only when their episode terminated in them
    pool_size: int = 8192  # online: most recent states (steps of all envs) kept to draw pairs from
    label_every: int = 2048  # online: frames between labelling requests
    pairs_per_query: int = 8  # online: pairs per request
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
    # judge=text, true: Motif's shape (describe each, compare, then answer); false: answer first, then a short reason
    describe: bool = False
    summary_fields: int = 6  # unit=segment: scalar fields whose change over the segment is stated
    temperature: float = 0.3  # judge=text: sampling temperature (logprobs reads one greedy token)
    # judge=text: cap on each reply: the answer and a short reason (use ~96 with describe: true)
    max_tokens: int = 40
    seed: int = 0  # dataset, pairs, split and labeller seed: the same for every training seed, so labels are shared
    min_pairs: int = 2  # labelled pairs (not held out) needed before the reward model is fitted
    members: int = 3  # reward-model ensemble size (each fits a bootstrap of the pairs)
    hidden: int = 0  # hidden units of each member; 0 = linear in the features
    epochs: int = 300  # full-batch Adam steps per fit (online: the model is refit after each labelling round)
    lr: float = 0.05  # Adam learning rate of the fit
    l2: float = 0.001  # weight penalty of the fit (keeps words seen in few pairs near 0)
    # the centred reward (r less its mean over the states, in log-odds of the LLM's preference) is multiplied by this
    scale: float = 0.1
    threshold: float | None = None  # centred rewards below this become 0 (Motif's thresholding); null = keep all
    mode: str = "add"  # add: env reward + scaled model reward; replace: the scaled model reward alone
    # online: after training, wait up to this long for the LLM call in progress (so it is logged); 0 = do not wait
    finish_s: float = 30.0
    max_reasons: int = 200  # labelling replies kept for the artifact rlaif_preference/labels.md
    offline: Offline = field(default_factory=Offline)  # offline labelling dataset

    def check(self) -> None:
        super().check()
        for name, allowed in (
            ("labelling", LABELLING),
            ("unit", UNITS),
            ("features", FEATURES),
            ("judge", JUDGES),
            ("mode", MODES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
        if self.control is not None and self.control not in CONTROLS:
            raise ValueError(
                f"control must be null or one of {', '.join(repr(a) for a in CONTROLS)}, got {self.control!r}"
            )
        for name in (
            "batch",
            "candidates",
            "segment_len",
            "min_segment_len",
            "label_every",
            "pairs_per_query",
            "top_logprobs",
            "samples",
            "max_tokens",
            "min_pairs",
            "members",
            "epochs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("label_budget", "label_seconds", "hidden", "l2"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.pool_size < 2:
            raise ValueError(f"pool_size must be >= 2 (pairs are drawn from it), got {self.pool_size}")
        if not 0.0 <= self.heldout < 1.0:
            raise ValueError(f"heldout must be in [0, 1), got {self.heldout}")
        if self.offline.envs < 1 or self.offline.steps < 1:
            raise ValueError(
                f"offline.envs and offline.steps must be >= 1, got {self.offline.envs} and {self.offline.steps}"
            )


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = "You are a fair and careful judge of how well an agent is doing at its task."

# The question comes last: a 1.5B model answered near chance with it before the
# texts (docs/plugins/rlaif_preference.md has the measurements).
PROMPT = """Goal: {goal}

{kind} 1: {a}

{kind} 2: {b}

{instruction}"""

# judge=logprobs: one token, read as P("1") against P("2")
DIGIT = (
    "Which {kind} is better for the goal? Reply with a single digit: 1 if {Kind} 1 is better, 2 if {Kind} 2 is better."
)

# Motif's shape: describe each, compare, then a fixed-format answer
DESCRIBE = """First describe in one short sentence what each {kind} shows. Then compare them:
which one shows more progress towards the goal? End with exactly one line, one of:
Answer: 1
Answer: 2
Answer: tie
Answer: unknown"""

# the answer first, then a short reason: a few tokens per label on a slow local model
ANSWER_FIRST = """Which {kind} shows more progress towards the goal? Reply with ONE of these lines,
then " | Reason: " and one short sentence:
Answer: 1
Answer: 2
Answer: tie
Answer: unknown"""

#: what the prompt calls an item of each unit
KINDS = {"caption": "Observation", "segment": "Segment"}

_ANSWER = re.compile(
    r"answer(?:\s+is)?\W{0,3}\s*[:=]?\s*\**\s*\(?(segment\s*1|segment\s*2|1|2|tie|unknown|none|cannot tell)\b", re.I
)
# small models often skip the answer line and end with a sentence instead
_VERDICT = re.compile(
    r"segment\s*(1|2)\b[^.\n]{0,40}?\b(?:makes|made|is|shows|has|achieves|does)\b[^.\n]{0,30}?"
    r"\b(?:more|better|most|greater)\b|(neither|both) segments?\b[^.\n]{0,40}?\b(?:more|better|equal|same)",
    re.I,
)
_VALUES = {"1": 1.0, "2": 0.0, "tie": 0.5}
_PARROT = re.compile(r"answer\W{0,3}\s*[:=]?\s*(?:1|2|tie)\s*(?:,|/|\bor\b)\s*(?:1|2|tie|unknown)\b", re.I)


def build_prompt(
    goal: str, a: str, b: str, judge: str = "logprobs", describe: bool = False, unit: str = "segment"
) -> list[dict[str, str]]:
    """The chat messages that ask which of two texts (captions or segments) is better.

    ``judge="logprobs"``: a one-digit answer; ``"text"``: a written answer, with Motif's
    analysis before it when ``describe``, else answer first with a short reason.
    """
    kind = KINDS[unit]
    instruction = (DIGIT if judge == "logprobs" else DESCRIBE if describe else ANSWER_FIRST).format(
        kind=kind.lower(), Kind=kind
    )
    user = PROMPT.format(goal=goal, kind=kind, a=a, b=b, instruction=instruction)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


# -- labels ------------------------------------------------------------------------------------


def parse_label(text: str) -> float | None:
    """1.0 / 0.0 / 0.5 from the reply's last ``Answer:`` line; None for unknown or malformed
    (including the answer template copied back with its options).

    Without an answer line, the last verdict sentence counts ("Segment 2 makes more
    progress", "neither observation is better" = tie).
    """
    text = re.sub(r"observation", "segment", text, flags=re.I)  # one grammar for both units
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
    """P(first better) from a one-digit greedy reply: ``P("1") / (P("1") + P("2"))`` over the
    first token's alternatives; without log-probabilities (a backend that drops them) the
    digit itself (1.0 / 0.0). None when neither digit is likely (< ``min_mass``) or the
    reply is not a digit.

    A greedy reply's digit is the likelier one; log-probabilities that say otherwise are
    not this reply's (a backend that reports another position's, or a sampler's), and the
    digit counts.
    """
    digit = reply.text.strip()[:1]
    logprobs = getattr(reply, "logprobs", None)
    if logprobs:
        p1, p2 = math.exp(logprobs.get("1", -math.inf)), math.exp(logprobs.get("2", -math.inf))
        if p1 + p2 < min_mass:
            return None
        p = p1 / (p1 + p2)
        if digit in ("1", "2") and p != 0.5 and (p > 0.5) != (digit == "1"):
            return _VALUES[digit]
        return p
    return _VALUES.get(digit) if digit in ("1", "2") else None


def vote(labels: Sequence[float | None]) -> float | None:
    """The soft label of several samples: the mean of the decided ones (None if none).

    Its side of 0.5 is the majority; votes that cancel out give a tie (0.5).
    """
    decided = [x for x in labels if x is not None]
    return float(np.mean(decided)) if decided else None


def logit_vote(probs: list[float | None]) -> float | None:
    """The soft label of probability votes from both orders: the sigmoid of their mean
    log-odds (None if none decided).

    If showing an item first adds ``b`` to the judge's log-odds, the two orders give
    ``t + b`` and ``t - b`` (flipped back), and their mean is the unbiased ``t``; the
    mean of the probabilities instead is pulled towards 0.5 when ``b`` is large. Votes
    of exactly 0 or 1 (digits read without log-probabilities) are averaged as they are.
    """
    decided = [x for x in probs if x is not None]
    if not decided or not all(0.0 < x < 1.0 for x in decided):
        return vote(decided)
    return float(1 / (1 + np.exp(-np.mean([np.log(x / (1 - x)) for x in decided]))))


def control_label(kind: str, seed: int, a: str, b: str) -> float:
    """The control arm's label of (a, b): 0.5 (``ties``), or a fair coin (``random``) that is
    the same for the pair in every process and flips with its order."""
    if kind == "ties":
        return 0.5
    first, second = sorted((a, b))
    coin = float(random.Random(f"{seed}\x00{first}\x00{second}").random() < 0.5)
    return coin if (a, b) == (first, second) else 1.0 - coin


def preference(a: float, b: float, tol: float = 1e-6) -> float:
    """What two ground-truth values say: 1.0 (a higher), 0.0 (b higher), 0.5 (equal)."""
    if abs(a - b) <= tol:
        return 0.5
    return 1.0 if a > b else 0.0


def agreement(diffs: np.ndarray, labels: list[float | None]) -> tuple[float, int]:
    """(share, count) of the decided labels (not None, not 0.5) whose side the score
    differences ``R_a - R_b`` take; a difference of 0 (no preference) counts half, as a coin."""
    pairs = [(float(d), lab) for d, lab in zip(diffs, labels) if lab is not None and lab != 0.5]
    if not pairs:
        return float("nan"), 0
    hits = [0.5 if d == 0 else float((d > 0) == (lab > 0.5)) for d, lab in pairs]
    return float(np.mean(hits)), len(pairs)


def label_accuracy(labels: list[float | None], truths: list[float]) -> tuple[float, int]:
    """(agreement, count) of the labels with the ground truth, over pairs where both decide."""
    pairs = [(lab, t) for lab, t in zip(labels, truths) if lab is not None and lab != 0.5 and t != 0.5]
    if not pairs:
        return float("nan"), 0
    return float(np.mean([(lab > 0.5) == (t > 0.5) for lab, t in pairs])), len(pairs)


def truth_agreement(scores: np.ndarray, truths: np.ndarray, limit: int = 1000) -> tuple[float, int]:
    """(share, pairs) of all item pairs with different ground truths that the scores order
    the same way (a concordance, like Kendall's tau; equal scores count half); at most
    ``limit`` items (the first) enter."""
    s, t = np.asarray(scores, np.float64)[:limit], np.asarray(truths, np.float64)[:limit]
    upper = np.triu(np.ones((len(s), len(s)), bool), 1)
    ds, dt = (s[:, None] - s[None, :])[upper], (t[:, None] - t[None, :])[upper]
    keep = np.abs(dt) > 1e-6
    if not keep.any():
        return float("nan"), 0
    ds, dt = ds[keep], dt[keep]
    hits = np.where(ds == 0, 0.5, (np.sign(ds) == np.sign(dt)).astype(np.float64))
    return float(hits.mean()), int(keep.sum())


# -- states and items --------------------------------------------------------------------------


@dataclass
class Run:
    """One env's consecutive steps: the states reached (``obs[t]`` after step ``t``; an
    episode's final observation at its end), actions, rewards, ends, return so far."""

    obs: np.ndarray  # [T, D]
    act: np.ndarray  # [T, ...]
    rew: np.ndarray  # [T]
    term: np.ndarray  # [T] bool: the episode terminated at this step
    done: np.ndarray  # [T] bool: terminated or truncated
    ret: np.ndarray  # [T] env return of the episode up to and including this step (the ground truth)
    captions: list[str] = field(default_factory=list)  # Task.caption of each state, when the unit or features need it


@dataclass
class Item:
    """What the LLM compares: one distinct caption (and the states that have it) or one segment."""

    text: str  # what the LLM reads
    obs: np.ndarray  # [L, D]: a segment's states; a caption's mean state (L = 1)
    captions: list[str]  # the caption of each of the L rows
    truth: float  # a caption's mean return so far; a segment's env return
    count: int = 1  # states that have the caption


@dataclass
class Segment:
    """A piece of one episode: its states (after each step), actions, env return, end."""

    obs: np.ndarray  # [L, D] the states reached by the segment's steps
    actions: list[Any]
    env_return: float
    ended: bool  # the episode terminated at the segment's last step
    text: str = ""
    start: int = 0  # its first step's index in the rollout it was cut from


def env_preference(a: Segment, b: Segment) -> float:
    """What the env's own return says of two segments (:func:`preference`)."""
    return preference(a.env_return, b.env_return)


def returns_so_far(rew: np.ndarray, done: np.ndarray, start: float = 0.0) -> tuple[np.ndarray, float]:
    """Each step's episode return so far (reset after every end), and the running return after the last step."""
    out, running = np.zeros(len(rew), np.float64), float(start)
    for t in range(len(rew)):
        running += float(rew[t])
        out[t] = running
        if done[t]:
            running = 0.0
    return out, running


def random_runs(task: Any, envs: int, steps: int, seed: int) -> list[Run]:
    """A random policy's ``steps`` steps in each of ``envs`` envs of the task (Motif's dataset, here random)."""
    rows: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "act", "rew", "term", "done")}
    for step in task_steps(task, envs, steps, seed):  # next_obs: an ended episode's true last observation
        for k, v in zip(rows, (step.next_obs, step.action, step.reward, step.terminated, step.done)):
            rows[k].append(np.asarray(v))
    arr = {k: np.stack(v, axis=1) for k, v in rows.items()}  # [envs, T, ...]
    out = []
    for e in range(envs):
        ret, _ = returns_so_far(arr["rew"][e], arr["done"][e])
        out.append(
            Run(
                arr["obs"][e][:, : task.obs_dim].astype(np.float32),
                arr["act"][e],
                arr["rew"][e],
                arr["term"][e].astype(bool),
                arr["done"][e].astype(bool),
                ret,
            )
        )
    return out


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
        rows.append(
            (weight, f"{f.name} {_number(v[0])} -> {_number(v[-1])}{unit} (range {_number(lo)} to {_number(hi)})")
        )
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
    end = (
        "the episode ENDED (terminated) at its last step: a failure or a success, judge which from the goal"
        if seg.ended
        else "the episode was still running at its end"
    )
    return (
        f"{len(seg.obs)} steps; {end}.\nEnd state:\n{task.render_state(seg.obs[-1])}\n"
        f"Changes: {summarize_fields(task, seg.obs, fields)}\nActions: {acts}"
    )


def split_segments(
    obs: np.ndarray,
    actions: np.ndarray,
    rewards: np.ndarray,
    terminated: np.ndarray,
    done: np.ndarray,
    length: int,
    min_len: int,
) -> list[Segment]:
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
            out.append(Segment(obs[start:stop].copy(), acts, float(rewards[start:stop].sum()), ended, start=start))
        start = stop
    return out


def make_items(task: Any, runs: list[Run], cfg: Config) -> list[Item]:
    """The items of ``runs``: their distinct captions (``unit=caption``) or their segments."""
    if cfg.unit == "caption":
        groups: dict[str, list[tuple[np.ndarray, float]]] = {}
        for run in runs:
            for o, c, r in zip(run.obs, run.captions, run.ret):
                groups.setdefault(c, []).append((o, float(r)))
        return [
            Item(c, np.mean([o for o, _ in g], axis=0, keepdims=True), [c], float(np.mean([r for _, r in g])), len(g))
            for c, g in groups.items()
        ]
    out = []
    for run in runs:
        for seg in split_segments(run.obs, run.act, run.rew, run.term, run.done, cfg.segment_len, cfg.min_segment_len):
            caps = run.captions[seg.start : seg.start + len(seg.obs)]
            out.append(Item(render_segment(task, seg, cfg.summary_fields), seg.obs, caps, seg.env_return))
    return out


def caption_words(text: str) -> list[str]:
    """A caption's words, each with its heading ("You see: tree, cow." -> "You see: tree",
    "You see: cow"; a line "cart_position: 0.1" is one word): the reward model's inputs."""
    out = []
    for part in re.split(r"\n|(?<=\.)\s+(?=[A-Z])", text):
        part = part.strip().rstrip(".")
        if not part:
            continue
        head, sep, rest = part.partition(": ")
        if sep and rest and ":" not in rest:
            out += [f"{head}: {v.strip()}" for v in rest.split(",") if v.strip()]
        else:
            out.append(part)
    return out


def choose_pairs(
    items: list[Item], n: int, rng: random.Random, candidates: int = 16, taken: set[tuple[str, str]] | None = None
) -> list[tuple[int, int]]:
    """Up to ``n`` pairs of distinct items (indices), none in ``taken`` (text pairs, either order).

    Coverage first: every item is in one pair before any is in two, frequent items
    earlier (an order drawn with weights ``sqrt(count)``). Each partner is, of up to
    ``candidates`` drawn at random among the items still free in that round, the one
    sharing the fewest words (Jaccard), so pairs differ.
    """
    taken = {t for a, b in (taken or ()) for t in ((a, b), (b, a))}
    if len(items) < 2 or n <= 0:
        return []
    words = [set(caption_words(it.text)) for it in items]
    order = sorted(range(len(items)), key=lambda i: -(rng.random() ** (1 / math.sqrt(max(1, items[i].count)))))
    uses = [0] * len(items)
    out: list[tuple[int, int]] = []

    def distance(a: int, b: int) -> float:
        union = len(words[a] | words[b])
        return 1.0 - len(words[a] & words[b]) / union if union else 0.0

    for r in range(len(items)):  # at most len(items) - 1 rounds: then every pair is taken
        added = 0
        for a in order:
            if len(out) >= n:
                return out
            if uses[a] > r:
                continue
            pool = [b for b in order if b != a and uses[b] <= r and (items[a].text, items[b].text) not in taken]
            if not pool:
                continue
            b = max(rng.sample(pool, min(candidates, len(pool))), key=lambda b: distance(a, b))
            out.append((a, b))
            taken |= {(items[a].text, items[b].text), (items[b].text, items[a].text)}
            uses[a] += 1
            uses[b] += 1
            added += 1
        if not added and max(uses) <= r:
            break
    return out


# -- the reward model --------------------------------------------------------------------------


class Features:
    """State -> reward-model input: its caption's words (``caption``: one 0/1 column per word
    seen in ``captions``) or its observation divided by the spread of ``obs`` (``obs``)."""

    def __init__(self, kind: str, captions: list[str], obs: np.ndarray) -> None:
        self.kind = kind
        self.vocab = {w: i for i, w in enumerate(sorted({w for c in set(captions) for w in caption_words(c)}))}
        std = obs.reshape(-1, obs.shape[-1]).std(0) if len(obs) else np.ones(obs.shape[-1])
        self.spread = np.where(std > 1e-6, std, 1.0).astype(np.float32)
        self.dim = len(self.vocab) if kind == "caption" else obs.shape[-1]
        self._rows: dict[str, np.ndarray] = {}

    def of_captions(self, captions: list[str]) -> np.ndarray:
        """``[N, dim]`` word columns of ``captions`` (words not in the vocabulary are left out)."""
        out = np.zeros((len(captions), self.dim), np.float32)
        for i, c in enumerate(captions):
            row = self._rows.get(c)
            if row is None:
                row = self._rows[c] = np.array([self.vocab[w] for w in caption_words(c) if w in self.vocab], np.int64)
            out[i, row] = 1.0
        return out

    def of_item(self, item: Item) -> np.ndarray:
        """``[L, dim]``: the item's rows."""
        return (
            self.of_captions(item.captions) if self.kind == "caption" else item.obs[:, : len(self.spread)] / self.spread
        )


def bt_loss(score_a: torch.Tensor, score_b: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry loss: cross-entropy of ``P(a > b) = sigmoid(R_a - R_b)`` with soft labels."""
    return torch.nn.functional.binary_cross_entropy_with_logits(score_a - score_b, label)


class RewardModel:
    """An ensemble of ``r(x)``: linear (``hidden=0``) or an MLP; an item's score is the sum of
    ``r`` over its rows.

    Every member starts at ``r = 0`` (a zero last layer): the Bradley-Terry gradient of a
    0.5 label between equal scores is 0, so labels that all say "tie" leave ``r = 0``
    exactly and the model adds nothing.
    """

    def __init__(self, dim: int, members: int = 3, hidden: int = 0, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.nets = []
        for _ in range(members):
            last = torch.nn.Linear(hidden or dim, 1)
            torch.nn.init.zeros_(last.weight)
            torch.nn.init.zeros_(last.bias)
            self.nets.append(
                torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(), last) if hidden else last
            )

    @staticmethod
    def _pad(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(len(r) for r in rows)
        x = np.zeros((len(rows), L, rows[0].shape[-1]), np.float32)
        mask = np.zeros((len(rows), L), np.float32)
        for i, r in enumerate(rows):
            x[i, : len(r)], mask[i, : len(r)] = r, 1.0
        return torch.from_numpy(x), torch.from_numpy(mask)

    def fit(
        self,
        a: list[np.ndarray],
        b: list[np.ndarray],
        y: list[float],
        epochs: int = 300,
        lr: float = 0.05,
        l2: float = 1e-3,
    ) -> float:
        """Fit every member on a bootstrap of the labelled pairs (``[L, dim]`` rows each);
        returns the members' mean final loss on all pairs."""
        xa, ma = self._pad(a)
        xb, mb = self._pad(b)
        yt = torch.tensor(y, dtype=torch.float32)
        losses = []
        for k, net in enumerate(self.nets):
            idx = torch.randint(len(yt), (len(yt),), generator=torch.Generator().manual_seed(k))
            opt = torch.optim.Adam(net.parameters(), lr=lr)
            weights = [p for name, p in net.named_parameters() if name.endswith("weight")]
            for _ in range(epochs):
                ra = (net(xa[idx]).squeeze(-1) * ma[idx]).sum(-1)
                rb = (net(xb[idx]).squeeze(-1) * mb[idx]).sum(-1)
                loss = bt_loss(ra, rb, yt[idx]) + l2 * sum((w**2).sum() for w in weights)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                ra, rb = (net(xa).squeeze(-1) * ma).sum(-1), (net(xb).squeeze(-1) * mb).sum(-1)
                losses.append(float(bt_loss(ra, rb, yt)))
        return float(np.mean(losses))

    @torch.no_grad()
    def reward(self, x: np.ndarray) -> np.ndarray:
        """``r`` of rows ``[N, dim]`` (the ensemble mean)."""
        xt = torch.as_tensor(np.asarray(x, np.float32))
        return torch.stack([net(xt).squeeze(-1) for net in self.nets]).mean(0).numpy()

    def score(self, rows: np.ndarray) -> float:
        """An item's score: the sum of ``r`` over its rows."""
        return float(self.reward(rows).sum())


# -- the labeller (behind the label_preferences hook) --------------------------------------


def _chat_all(llm: Any, calls: list[dict[str, Any]]) -> list[Any]:
    """Each call's replies, or the exception it raised: concurrently where the client has
    ``chat_many``; if that fails for the batch, each call alone (paid replies replay from the cache)."""
    many = getattr(llm, "chat_many", None)
    if many is not None and len(calls) > 1:
        try:
            return list(many(calls))
        except Exception:  # one failed call fails the batch: ask each alone
            pass
    out: list[Any] = []
    for call in calls:
        try:
            out.append(llm.chat(**call))
        except Exception as exc:  # an LLM failure costs its pair's label
            out.append(exc)
    return out


@dataclass
class Labeller:
    """Asks the LLM for preference labels; caches them per (goal, a, b) (either order) and counts its work."""

    cache: dict[str, float | None] = field(default_factory=dict)
    calls: int = 0  # chat calls made (a reply replayed from the LLM response cache counts, and costs ~0 s)
    cache_hits: int = 0  # labels answered from the label cache
    rejected: int = 0  # replies that gave no vote
    failures: int = 0  # pairs whose calls failed (no label, not cached)
    latency: list[float] = field(default_factory=list)  # seconds per batch of calls that reached the model
    replies: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @staticmethod
    def key(goal: str, a: str, b: str) -> str:
        return hashlib.sha256("\x00".join((goal, a, b)).encode()).hexdigest()

    def lookup(self, goal: str, a: str, b: str) -> tuple[bool, float | None]:
        """(found, label) from the cache, for either order of the pair."""
        k, k_rev = self.key(goal, a, b), self.key(goal, b, a)
        if k in self.cache:
            return True, self.cache[k]
        if k_rev in self.cache:
            hit = self.cache[k_rev]
            return True, None if hit is None else 1.0 - hit
        return False, None

    def label(self, llm: Any, cfg: Config, goal: str, pairs: list[tuple[str, str]]) -> list[float | None]:
        """One label per pair: cached ones at once, the others from one batch of calls."""
        out: list[float | None] = [None] * len(pairs)
        todo = []
        for i, (a, b) in enumerate(pairs):
            found, value = self.lookup(goal, a, b)
            if found:
                out[i] = value
                with self.lock:
                    self.cache_hits += 1
            else:
                todo.append(i)
        plans = {i: self.calls_for(cfg, goal, *pairs[i]) for i in todo}
        flat = [(i, flipped, call) for i in todo for flipped, call in plans[i]]
        t0 = time.perf_counter()
        results = _chat_all(llm, [call for _, _, call in flat]) if flat else []
        elapsed = time.perf_counter() - t0
        votes: dict[int, list[float | None]] = {i: [] for i in todo}
        texts: dict[int, list[str]] = {i: [] for i in todo}
        failed: set[int] = set()
        for (i, flipped, _), replies in zip(flat, results):
            if isinstance(replies, Exception):
                failed.add(i)
                texts[i].append(f"LLM error {type(replies).__name__}: {str(replies)[:200]}")
                continue
            for r in replies:
                x = digit_preference(r) if cfg.judge == "logprobs" else parse_label(r.text)
                with self.lock:
                    self.rejected += x is None
                votes[i].append(None if x is None else (1.0 - x if flipped else x))
                texts[i].append(
                    f"{r.text.strip()} (P(1st better) {x:.3f})" if cfg.judge == "logprobs" and x is not None else r.text
                )
        with self.lock:
            self.calls += len(flat)
            if flat and not all(not isinstance(r, Exception) and all(x.cached for x in r) for r in results):
                self.latency.append(elapsed)
            for i in todo:
                a, b = pairs[i]
                if i in failed:
                    self.failures += 1
                else:
                    out[i] = logit_vote(votes[i]) if cfg.judge == "logprobs" else vote(votes[i])
                    self.cache[self.key(goal, a, b)] = out[i]
                shown = " || ".join(t.strip().replace("\n", " ")[:300] for t in texts[i])
                self.replies.append(f"{a!r} vs {b!r}: label {out[i]} (votes {votes[i]}): {shown}")
        return out

    @staticmethod
    def calls_for(cfg: Config, goal: str, a: str, b: str) -> list[tuple[bool, dict[str, Any]]]:
        """The chat calls that vote on one pair, each with whether it shows the pair flipped.

        With ``swap`` the pair is also shown in the other order (its vote is flipped
        back), which cancels position bias: a model that always picks one position then
        votes a tie instead of a wrong label. ``judge=logprobs``: one greedy digit per
        order (:func:`digit_preference`); ``judge=text``: ``samples`` sampled replies,
        shared between the orders.
        """
        if cfg.judge == "logprobs":
            samples = 2 if cfg.swap else 1
            options: dict[str, Any] = {"temperature": 0.0, "max_tokens": 1, "top_logprobs": cfg.top_logprobs}
        else:
            samples = cfg.samples
            options = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
        orders = [(a, b, False), (b, a, True)] if cfg.swap and samples > 1 else [(a, b, False)]
        out = []
        for j, (first, second, flipped) in enumerate(orders):
            n = samples // len(orders) + (j < samples % len(orders))
            messages = build_prompt(goal, first, second, cfg.judge, cfg.describe, cfg.unit)
            out.append((flipped, dict(messages=messages, n=n, seed=cfg.seed, tag=f"{NAME}/label", **options)))
        return out


# -- the preference learner ---------------------------------------------------------------


@dataclass
class Labelled:
    """One labelled pair; ``heldout`` pairs are kept out of the fit."""

    a: Item
    b: Item
    label: float | None
    heldout: bool


class PreferenceLearner:
    """Per-training state: the states and items, the labelled pairs, the reward model, the figures.

    ``labeller`` is the run's (the plugin object's): its label cache serves every
    training of the run in this process.
    """

    def __init__(self, train: TrainContext, cfg: Config, labeller: Labeller) -> None:
        self.train, self.cfg, self.task, self.labeller = train, cfg, train.task, labeller
        self.goal = cfg.goal or train.task.goal
        self.need_captions = cfg.unit == "caption" or cfg.features == "caption"
        self.runs: list[Run] = []
        self.labelled: list[Labelled] = []
        self.model: RewardModel | None = None
        self.features: Features | None = None
        self.mean = 0.0  # mean of r over the states, subtracted from the reward
        self.figures: dict[str, float] = {}  # what the last fit measured
        self.rewards: dict[str, float] = {}  # caption -> centred r, for the current model
        self.calls = 0
        self.seconds = 0.0  # wall seconds spent labelling (LLM calls, and the label cache)
        self.steps = self.changed = 0
        self.term_sum = self.term_sq = 0.0  # the term over the training's steps (its spread is logged)
        self.requested = 0
        self.next_label_at = cfg.label_every
        self.running: np.ndarray | None = None  # online: each env's episode return so far
        self.pending: dict[tuple[tuple[str, str], ...], list[tuple[Item, Item]]] = {}
        self.background: BackgroundCalls[tuple[tuple[str, str], ...], list[float | None]] = BackgroundCalls(
            self.ask, name="preference-labeller", queue_size=2
        )

    # -- labels ------------------------------------------------------------------------
    def ask(self, texts: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> list[float | None]:
        """Labels of text pairs: the control's, or the labeller's (through the hook, so another plugin may answer)."""
        texts = list(texts)
        if self.cfg.control is not None:
            return [control_label(self.cfg.control, self.cfg.seed, a, b) for a, b in texts]
        before, t0 = self.labeller.calls, time.perf_counter()
        hook = self.train.hook
        labels = hook.label_preferences(run=self.train, goal=self.goal, pairs=texts) if hook is not None else None
        if labels is None:
            labels = self.labeller.label(self.train.llm, self.cfg, self.goal, texts)
        self.calls += self.labeller.calls - before
        self.seconds += time.perf_counter() - t0
        return list(labels)

    def add_labels(self, pairs: list[tuple[Item, Item]], labels: list[float | None]) -> None:
        h = self.cfg.heldout
        for (a, b), lab in zip(pairs, labels):
            k = len(self.labelled)  # every 1/h-th pair is held out (h = 0.2: the 5th, 10th, ...)
            self.labelled.append(Labelled(a, b, lab, int((k + 1) * h) > int(k * h)))

    def label_blocking(self, pairs: list[tuple[Item, Item]], what: str) -> None:
        """Label ``pairs`` in batches (cached ones first, free), within ``label_seconds``, with a progress bar."""
        cfg = self.cfg
        cached = [p for p in pairs if cfg.control is None and self.labeller.lookup(self.goal, p[0].text, p[1].text)[0]]
        order = cached + [p for p in pairs if not any(p is c for c in cached)]
        start = time.perf_counter()
        # a bar of its own in the driver only: a pool worker's trainings draw through the driver's relay
        show = self.train.settings.run.progress and cfg.control is None and multiprocessing.parent_process() is None
        with make_progress(show) as progress:
            bar = progress.add_task(f"{NAME}: {what}", total=len(order)) if progress is not None else None
            i = 0
            while i < len(order):
                if cfg.label_seconds and i >= len(cached) and time.perf_counter() - start >= cfg.label_seconds:
                    break
                chunk = order[i : len(cached)] if i < len(cached) else order[i : i + cfg.batch]
                self.add_labels(chunk, self.ask([(a.text, b.text) for a, b in chunk]))
                i += len(chunk)
                if progress is not None and bar is not None:
                    progress.update(bar, completed=i, info=f"{self.calls} calls, {time.perf_counter() - start:.0f} s")

    # -- offline: Motif --------------------------------------------------------------------
    def offline(self) -> None:
        """Collect the random-policy dataset, label pairs of its items, fit once."""
        cfg = self.cfg
        self.runs = random_runs(self.task, cfg.offline.envs, cfg.offline.steps, cfg.seed)
        self._caption_runs(self.runs)
        items = make_items(self.task, self.runs, cfg)
        chosen = choose_pairs(items, cfg.label_budget, random.Random(cfg.seed), cfg.candidates)
        self.requested = len(chosen)
        what = f"labelling {len(chosen)} pairs of {len(items)} {cfg.unit}s"
        self.label_blocking([(items[a], items[b]) for a, b in chosen], what)
        self.fit(items)

    def _caption_runs(self, runs: list[Run]) -> None:
        if self.need_captions:
            for run in runs:
                if not run.captions:
                    run.captions = [self.task.caption(o) for o in run.obs]

    # -- online: RL-VLM-F ------------------------------------------------------------------
    def add_rollout(self, batch: Any) -> None:
        """Keep the batch ``[envs, steps]`` as runs, with each env's return so far carried across batches."""
        dim = self.task.obs_dim
        nxt = batch.get("next")
        obs = nxt.get("observation")[..., :dim].numpy()
        rew = (nxt.get("env_reward") if "env_reward" in nxt.keys() else nxt.get("reward")).squeeze(-1).numpy()
        done = nxt.get("done").squeeze(-1).numpy().astype(bool)
        term = nxt.get("terminated").squeeze(-1).numpy().astype(bool) if "terminated" in nxt.keys() else done
        act = batch.get("action").numpy()
        if self.running is None:
            self.running = np.zeros(obs.shape[0])
        new = []
        for e in range(obs.shape[0]):
            ret, self.running[e] = returns_so_far(rew[e], done[e], self.running[e])
            new.append(Run(obs[e].astype(np.float32), act[e], rew[e], term[e], done[e], ret))
        self._caption_runs(new)
        self.runs += new
        while sum(len(r.obs) for r in self.runs) > self.cfg.pool_size and len(self.runs) > 1:
            self.runs.pop(0)

    def online(self) -> None:
        """Fit on labels that came back; every ``label_every`` frames queue new pairs (never waits)."""
        cfg = self.cfg
        back = self.background.drain()
        for job, labels in back:
            self.add_labels(self.pending.pop(job), labels)
        if back:
            self.fit(make_items(self.task, self.runs, cfg))
        if self.train.frames < self.next_label_at or self.requested >= cfg.label_budget:
            return
        if cfg.label_seconds and self.seconds >= cfg.label_seconds:
            return
        self.next_label_at += cfg.label_every
        items = make_items(self.task, self.runs, cfg)
        taken = {(p.a.text, p.b.text) for p in self.labelled} | {t for job in self.pending for t in job}
        chosen = choose_pairs(
            items,
            min(cfg.pairs_per_query, cfg.label_budget - self.requested),
            random.Random(cfg.seed + self.requested),
            cfg.candidates,
            taken,
        )
        pairs = [(items[a], items[b]) for a, b in chosen]
        if not pairs:
            return
        job = tuple((a.text, b.text) for a, b in pairs)
        if cfg.control is not None:  # no LLM to wait for
            self.add_labels(pairs, self.ask(job))
            self.requested += len(pairs)
            self.fit(items)
        elif self.background.submit(job):  # refused while the worker is still busy: skip this round
            self.pending[job] = pairs
            self.requested += len(pairs)

    # -- the fit -----------------------------------------------------------------------------
    def fit(self, items: list[Item]) -> None:
        """Fit the reward model on the labelled pairs not held out; measure it; set the reward's scale."""
        cfg = self.cfg
        fit = [p for p in self.labelled if not p.heldout and p.label is not None]
        if len(fit) < cfg.min_pairs or not items:
            return
        states = [o for run in self.runs for o in run.obs]
        captions = [c for run in self.runs for c in run.captions]
        feats = Features(cfg.features, captions, np.asarray(states, np.float32))
        model = RewardModel(feats.dim, cfg.members, cfg.hidden, seed=cfg.seed)
        loss = model.fit(
            [feats.of_item(p.a) for p in fit],
            [feats.of_item(p.b) for p in fit],
            [float(p.label) for p in fit],  # type: ignore[arg-type]
            cfg.epochs,
            cfg.lr,
            cfg.l2,
        )

        def diffs(pairs: list[Labelled]) -> np.ndarray:
            return np.array([model.score(feats.of_item(p.a)) - model.score(feats.of_item(p.b)) for p in pairs])

        held = [p for p in self.labelled if p.heldout]
        fit_acc, _ = agreement(diffs(fit), [p.label for p in fit])
        held_acc, held_n = agreement(diffs(held), [p.label for p in held])
        truth_acc, truth_n = truth_agreement(
            np.array([model.score(feats.of_item(it)) for it in items]), np.array([it.truth for it in items])
        )
        # the reward's centre: r over every state kept (each distinct caption weighted by its states)
        if cfg.features == "caption":
            counts = Counter(captions)
            r = model.reward(feats.of_captions(list(counts)))
            w = np.array(list(counts.values()), np.float64)
        else:
            r = model.reward(np.asarray(states, np.float32)[:, : len(feats.spread)] / feats.spread)
            w = np.ones(len(r))
        mean = float(np.average(r, weights=w))
        spread = float(np.sqrt(np.average((r - mean) ** 2, weights=w)))
        self.model, self.features, self.mean, self.rewards = model, feats, mean, {}
        self.figures = {
            "preference/rm_loss": loss,
            "preference/fit_agreement": fit_acc,
            "preference/heldout_agreement": held_acc,
            "preference/heldout_pairs": float(held_n),
            "preference/truth_agreement": truth_acc,
            "preference/truth_pairs": float(truth_n),
            "preference/items": float(len(items)),
            "preference/features": float(feats.dim),
            "preference/r_spread": spread,
        }
        self.train.log_metric("preference/rm_loss", loss)

    # -- reward ------------------------------------------------------------------------
    def reward(self, batch: StepBatch) -> torch.Tensor | None:
        """``scale * (r(s') - mean)``, thresholded; ``mean`` is r's mean over the states."""
        self.steps += int(batch.next_obs.shape[0])
        model, feats, mean = self.model, self.features, self.mean
        if model is None or feats is None:
            return None
        obs = batch.next_obs.detach().cpu().numpy()[:, : self.task.obs_dim]
        if feats.kind == "caption":
            captions = [self.task.caption(o) for o in obs]
            new = [c for c in dict.fromkeys(captions) if c not in self.rewards]
            if new:
                self.rewards.update(zip(new, (model.reward(feats.of_captions(new)) - mean).tolist()))
            z = np.array([self.rewards[c] for c in captions], np.float64)
        else:
            z = model.reward(obs / feats.spread) - mean
        if self.cfg.threshold is not None:
            z = np.where(z >= self.cfg.threshold, z, 0.0)
        term = (self.cfg.scale * z).astype(np.float32)
        self.changed += int(np.count_nonzero(term))
        self.term_sum += float(term.sum())
        self.term_sq += float((term.astype(np.float64) ** 2).sum())
        if self.cfg.mode == "replace":
            term = term - batch.reward.detach().cpu().numpy()
        return torch.as_tensor(term, dtype=torch.float32)

    def metrics(self) -> dict[str, float]:
        labels = [p.label for p in self.labelled]
        truths = [preference(p.a.truth, p.b.truth) for p in self.labelled]
        acc, n = label_accuracy(labels, truths)
        lab = self.labeller
        decided = [abs(x - 0.5) for x in labels if x is not None]
        steps = max(1, self.steps)
        return {
            "preference/labels": float(len(labels)),
            "preference/pairs_planned": float(self.requested),
            "preference/label_seconds": self.seconds,
            "preference/label_accuracy": acc,
            "preference/label_decisive": float(n),
            "preference/ties": float(sum(x == 0.5 for x in labels)),
            "preference/unknown": float(sum(x is None for x in labels)),
            "preference/label_margin": float(np.mean(decided)) if decided else float("nan"),
            **self.figures,
            "preference/term_spread": math.sqrt(max(0.0, self.term_sq / steps - (self.term_sum / steps) ** 2)),
            "llm/changed_share": self.changed / steps,
            "llm/calls": float(self.calls),
            "llm/seconds": self.seconds,
            "llm/control": float(self.cfg.control is not None),
            "judge/llm_calls": float(lab.calls),
            "judge/cache_hits": float(lab.cache_hits),
            "judge/rejected_replies": float(lab.rejected),
            "judge/failures": float(lab.failures),
            "judge/latency_llm_s": float(np.mean(lab.latency)) if lab.latency else float("nan"),
        }


# -- hooks -----------------------------------------------------------------------------------


class HOOKSPECS:
    """The hook this plugin adds: it asks it for its labels, so another plugin may give them.

    The plugin manager adds these specs before any plugin registers. A plugin that
    answers ``label_preferences`` marks its implementation ``@hookimpl(optionalhook=True)``,
    so that it still loads in a run without this one.
    """

    @hookspec(firstresult=True)
    def label_preferences(self, run: Any, goal: str, pairs: list[tuple[str, str]]) -> list[float | None] | None:
        """Preference labels: which of two described states (or segments) better achieves ``goal``.

        Called in the training process for each batch of pairs this plugin labels (never
        under ``control``); this plugin's own answer asks the run's LLM (the configured
        judge) through its label cache.

        :param run: the calling context (a TrainContext).
        :param goal: the goal the texts are judged against.
        :param pairs: text renderings ``(a, b)`` of the pairs.
        :return: one label per pair: the probability that a is better, 1.0 (a better),
            0.0 (b better), 0.5 (tie) or anything between (a soft label, e.g. read from
            the judge's token probabilities), None (cannot tell); or None to abstain.
            Stops at first non-None result.
        """


class Plugin:
    """RLAIF for a run. The labeller (and its label cache) is the run's; each training's
    :class:`PreferenceLearner` (states, worker, reward model) lives in ``train.state[NAME]``,
    from ``on_train_start`` to ``on_train_end``."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.labeller = Labeller()

    @hookimpl
    def label_preferences(self, run: Any, goal: str, pairs: list[tuple[str, str]]) -> list[float | None] | None:
        """Label text pairs with the run's LLM (the configured judge), through the label cache."""
        return self.labeller.label(run.llm, self.cfg, goal, pairs)

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Offline: label the random-policy dataset and fit, before training. Online: start the labelling worker."""
        learner = train.state[NAME] = PreferenceLearner(train, self.cfg, self.labeller)
        if self.cfg.control is None:
            warm_up(train.llm)  # loading holds the GIL: not inside the worker, beside the loop
        if self.cfg.labelling == "offline":
            learner.offline()
        elif self.cfg.control is None:
            learner.background.start()

    @hookimpl
    def on_rollout(self, train: TrainContext, batch: Any) -> None:
        """Online: keep the batch's states, fit on labels that came back, queue pairs on schedule."""
        learner = train.state.get(NAME)
        if learner is None or self.cfg.labelling != "online":
            return
        learner.add_rollout(batch)
        learner.online()
        train.log_metric("preference/labels", len(learner.labelled))

    @hookimpl
    def compute_reward(self, train: TrainContext, batch: StepBatch) -> torch.Tensor | None:
        """The reward model's centred, thresholded, scaled reward (added, or replacing the reward)."""
        learner = train.state.get(NAME)
        return learner.reward(batch) if learner is not None else None

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """Stop the worker (labels still landing are counted); metrics on the result, the replies as a text."""
        learner = train.state.pop(NAME, None)
        if learner is None:
            return
        learner.background.stop(self.cfg.finish_s)
        for job, labels in learner.background.drain():
            learner.add_labels(learner.pending.pop(job), labels)
        for error in learner.background.errors:
            self.labeller.replies.append(f"labelling failed: {error}")
        result.metrics.update({k: v for k, v in learner.metrics().items() if v == v})
        text = "\n".join(f"- {r}" for r in self.labeller.replies[-self.cfg.max_reasons :])
        train.log_text(f"{NAME}/labels.md", f"# Preference labels ({len(learner.labelled)})\n\n{text}\n")
