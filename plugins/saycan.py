"""saycan: the LLM's likelihood of each skill for the instruction, times a learned affordance.

Method (Ahn et al., 2022, "Do As I Can, Not As I Say: Grounding Language in Robotic
Affordances"): a robot with a library of named skills picks the next one by
``p(skill | instruction, state) ~ p_LLM(skill text | instruction) * p_afford(skill | state)``:
the language model says which skill is useful for the instruction, a learned value
function says which skill can succeed from the current state.

Here, for a discrete task whose actions have names (Crafter's 17 actions, CartPole's two
pushes), every action is a skill:

1. The state is the task's coarse caption (``Task.caption``: on Crafter what is within two
   cells, the items held, low vitals), so that a few hundred captions cover a training and
   one LLM answer serves every step with that caption.
2. The LLM gets the instruction, the skills as a lettered list and the caption, and is
   asked for the letter of the next skill; the log-probabilities of the letters as the
   reply's first token (``top_logprobs``; the embedded llama.cpp model and OpenAI-style
   backends return them) are the skill scores of every skill from one call, renormalised.
   A backend without log-probabilities falls back to the letter it replied.
3. Scores are cached per (instruction, caption) on the plugin object: the run's trainings
   (its seeds) share them, and across runs the LLM response cache replays the prompts.
   Before training, the captions of random-policy rollouts (and of the task's reference
   policy, where it has one) are scored, blocking and in batches, most frequent first, up
   to a budget of calls and seconds. During training, new captions go to a background
   worker (:class:`core.llm.background.BackgroundCalls`) and, at a few fixed points
   (``rescore_at``), the agent's most frequent unscored captions are scored, blocking.
   The ``action_prior`` hook covers the rows whose caption is scored and masks the rest.
4. The affordance is the PPO policy itself: the trainer samples from
   ``softmax(logits + weight * log p_LLM)``, i.e. ``pi(a|s) * p_LLM(a)^weight``, and PPO
   trains ``pi`` on the task's reward through that product, so the policy learns what
   can succeed where the LLM's preference is wrong.

Config: ``conf/plugins/saycan.yaml`` (schema: :class:`Config`). Each training's scorer
(background worker, counters) lives in ``train.state["saycan"]``; the score cache is the
plugin object's. Scored captions are logged as the text artifact ``saycan/scores.md``.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.plugin import (
    ActionPrior,
    BackgroundCalls,
    PluginConfig,
    RunContext,
    Task,
    TrainContext,
    TrainResult,
    UserError,
    ask_in_batches,
    hookimpl,
    warm_up,
)

NAME = "saycan"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
Key = tuple[str, str]  # (instruction, caption)


@dataclass
class Config(PluginConfig):
    """``plugins.saycan``: how skills are scored, which captions are scored when, and how strongly the score steers."""

    instruction: str = ""  # the instruction the skills are scored for; "" uses the task's goal
    # exponent of the LLM's skill distribution in the product with the policy (0: uniform-prior control)
    weight: float = 1.0
    top_logprobs: int = 20  # first-token alternatives asked for (OpenAI-style backends give at most 20)
    floor: float = -10.0  # log-probability given to a skill missing from the alternatives
    fallback_prob: float = 0.8  # without log-probabilities: the probability put on the replied skill
    # regular expressions removed from the caption before scoring and caching (details that do not bear on the choice)
    forget: list[str] = field(default_factory=list)
    # random-policy rollouts (and as many of the task's reference policy) captioned before training
    prescore_episodes: int = 8
    prescore_steps: int = 1000  # steps per pre-scoring rollout at most
    prescore_calls: int = 96  # LLM calls before training at most (most frequent captions first)
    prescore_s: float = 180.0  # seconds of LLM calls before training at most (0: no limit)
    batch: int = 4  # captions per batch of concurrent calls (llm.chat_many) in the blocking phases
    rescore_at: list[float] = field(
        default_factory=lambda: [0.1, 0.3, 0.6]
    )  # fractions of training at which the agent's most frequent unscored captions are scored, blocking
    rescore_calls: int = 24  # LLM calls per rescoring point at most
    rescore_s: float = 30.0  # seconds per rescoring point at most (0: no limit)
    max_queries: int = 400  # LLM scoring calls per training, all phases; later unscored captions get no prior
    queue_size: int = 64  # captions waiting for the background worker; new ones are dropped while it is full
    # score every unscored caption before acting (reproducible, slow) instead of in the background
    blocking: bool = False
    finish_s: float = 5.0  # seconds to wait for the background call in progress when a training ends

    def check(self) -> None:
        super().check()
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 1..20, got {self.top_logprobs}")
        if not 0.0 < self.fallback_prob < 1.0:
            raise ValueError(f"fallback_prob must be in (0, 1), got {self.fallback_prob}")
        for name in ("prescore_episodes", "prescore_steps", "prescore_calls", "rescore_calls", "max_queries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch < 1 or self.queue_size < 1:
            raise ValueError(f"batch and queue_size must be >= 1, got {self.batch} and {self.queue_size}")
        if self.prescore_s < 0 or self.rescore_s < 0:
            raise ValueError("prescore_s and rescore_s must be >= 0 (0: no limit)")
        if any(not 0.0 < p < 1.0 for p in self.rescore_at):
            raise ValueError(f"rescore_at holds fractions of the training in (0, 1), got {self.rescore_at}")
        for pattern in self.forget:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"forget pattern {pattern!r} is not a regular expression: {exc}") from exc


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You plan for an agent that acts with a fixed set of skills. Given an instruction and the
agent's current state, you name the one skill the agent should do next. Answer with the
skill's letter only."""

PROMPT = """Instruction: {instruction}

Skills:
{skills}

Current state:
{state}

Which skill should the agent do next to follow the instruction? Answer with one letter."""


def skill_names(task: Task) -> list[str]:
    """The names of a discrete task's actions, read from its action description.

    ``"Discrete(3): 0 accelerates left, 1 does nothing, 2 accelerates right."`` gives
    ``["accelerates left", "does nothing", "accelerates right"]``; actions the text does
    not name are called ``action <i>``.

    :raises UserError: for a task whose actions are not discrete.
    """
    text = task.action_description or ""
    found = re.match(r"\s*Discrete\((\d+)\)\s*:?\s*(.*)", text, re.S)
    if not found:
        raise UserError(
            f"saycan scores named discrete actions; the task '{task.name}' has {text or 'no action description'}. "
            "Use a discrete task (cartpole, mountaincar, minecraft), or rlingua for continuous actions."
        )
    n, rest = int(found.group(1)), found.group(2)
    if n > len(LETTERS):
        raise UserError(f"saycan labels skills with letters: at most {len(LETTERS)} actions, the task has {n}.")
    names = [f"action {i}" for i in range(n)]
    for index, name in re.findall(r"(?:^|[,;:]\s*)(\d+)\s+(.+?)(?=[,;]\s*\d+\s|\.\s|\.?\s*$)", rest.strip()):
        if int(index) < n:
            names[int(index)] = name.strip().replace("_", " ")
    return names


def build_prompt(instruction: str, skills: list[str], state: str) -> list[dict[str, str]]:
    """The scoring messages: the instruction and the skills first (a prefix shared by every state)."""
    listed = "\n".join(f"{LETTERS[i]}. {name}" for i, name in enumerate(skills))
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PROMPT.format(instruction=instruction, skills=listed, state=state)},
    ]


def skill_scores(reply: Any, n: int, floor: float, fallback_prob: float) -> np.ndarray | None:
    """Log-probabilities ``[n]`` over the skills from one reply, renormalised; None if unusable.

    With first-token log-probabilities: each letter's (summed over tokens that strip to
    it, e.g. ``"A"`` and ``" A"``), ``floor`` for letters not among them. Without: the
    replied letter gets ``fallback_prob``, the others share the rest.
    """
    letters = LETTERS[:n]
    logprobs = getattr(reply, "logprobs", None)
    if logprobs:
        found: dict[str, list[float]] = {}
        for token, lp in logprobs.items():
            key = token.strip().rstrip(".):").upper()
            if len(key) == 1 and key in letters and math.isfinite(lp):
                found.setdefault(key, []).append(float(lp))
        if found:
            raw = np.array([float(np.logaddexp.reduce(found[c])) if c in found else floor for c in letters])
            return raw - float(np.logaddexp.reduce(raw))
    match = re.search(r"\b([A-Z])\b", str(getattr(reply, "text", "")).strip().upper())
    if match is None or match.group(1) not in letters:
        return None
    rest = (1.0 - fallback_prob) / max(1, n - 1)
    probs = np.full(n, rest)
    probs[letters.index(match.group(1))] = fallback_prob if n > 1 else 1.0
    return np.log(probs)


def is_uniform(scores: np.ndarray) -> bool:
    """A distribution that changes no action's probability in the product (all skills equal)."""
    return float(np.ptp(scores)) < 1e-6


# -- the scorer --------------------------------------------------------------------------


class SkillScorer:
    """One training's scoring: captions, cache lookups, the blocking phases, the background worker, counters.

    Thread-safe where it must be: the background worker and the training loop (a
    rescoring point) may score at the same time; counters and the budget take a lock.
    """

    def __init__(self, train: TrainContext, cfg: Config, cache: dict[Key, np.ndarray]) -> None:
        self.train, self.cfg, self.cache = train, cfg, cache
        self.task = train.task
        self.skills = skill_names(self.task)
        self.instruction = cfg.instruction or self.task.goal
        self.forget = [re.compile(p) for p in cfg.forget]
        self.lock = threading.Lock()
        self.failed: set[str] = set()  # captions whose call failed in this training: not asked again
        self.asking: set[str] = set()  # captions in a call now (the worker's and a blocking phase's)
        self.seen: Counter[str] = Counter()  # the training's captions, per step
        self.rescore_points = sorted(cfg.rescore_at)
        self.calls = self.queries = self.failures = 0  # client calls; caption scorings asked; unusable ones
        self.seconds = 0.0  # wall seconds spent waiting on those calls
        self.steps = self.covered = self.changed = 0
        self.prescore: dict[str, float] = {}
        self.log: list[str] = []
        self.background: BackgroundCalls[str, None] = BackgroundCalls(
            self._work, name=f"{NAME}-scorer", queue_size=cfg.queue_size
        )

    # -- captions and the cache ----------------------------------------------------------
    def caption(self, obs: np.ndarray) -> str:
        text = self.task.caption(obs)
        for pattern in self.forget:
            text = pattern.sub("", text)
        return text

    def scored(self, text: str) -> np.ndarray | None:
        return self.cache.get((self.instruction, text))

    def wanted(self, text: str) -> bool:
        return self.scored(text) is None and text not in self.failed

    def budget_left(self) -> int:
        return self.cfg.max_queries - self.queries

    # -- scoring -------------------------------------------------------------------------
    def _take(self, texts: list[str]) -> list[str]:
        """The part of ``texts`` not in a call now that the per-training budget still pays for (counted as asked)."""
        with self.lock:
            texts = [t for t in texts if t not in self.asking][: max(0, self.budget_left())]
            self.queries += len(texts)
            self.asking.update(texts)
        return texts

    def score(self, texts: list[str]) -> int:
        """Ask the LLM for the skill distribution of each caption (concurrently where the
        client has ``chat_many``); cache the usable ones. Returns how many were scored."""
        texts = self._take([t for t in dict.fromkeys(texts) if self.wanted(t)])
        if not texts:
            return 0
        try:
            return self._ask(texts)
        finally:
            with self.lock:
                self.asking.difference_update(texts)

    def _ask(self, texts: list[str]) -> int:
        llm = self.train.llm
        calls = [
            dict(
                messages=build_prompt(self.instruction, self.skills, t),
                n=1,
                temperature=0.0,
                max_tokens=1,
                tag=f"{NAME}/score",
                top_logprobs=self.cfg.top_logprobs,
            )
            for t in texts
        ]
        replies: list[Any] = [None] * len(texts)
        errors: list[str | None] = [None] * len(texts)
        start = time.perf_counter()
        many = getattr(llm, "chat_many", None)
        if many is not None and len(calls) > 1:
            first = len(getattr(llm, "records", ()))
            try:
                replies = [r[0] for r in many(calls)]
            except Exception as exc:  # chat_many raises one error for the batch
                # the calls that did land are in the client's records: keep them, so an error costs its own call only
                landed = {
                    rec.messages[-1]["content"]: rec.replies[0]
                    for rec in list(getattr(llm, "records", ()))[first:]
                    if rec.replies
                }
                replies = [landed.get(call["messages"][-1]["content"]) for call in calls]  # type: ignore[index]
                errors = [
                    None if r is not None else f"LLM error in a batch {type(exc).__name__}: {str(exc)[:200]}"
                    for r in replies
                ]
        else:
            for i, call in enumerate(calls):
                try:
                    replies[i] = llm.chat(**call)[0]
                except Exception as exc:  # an LLM failure costs one caption's prior
                    errors[i] = f"LLM error {type(exc).__name__}: {str(exc)[:200]}"
        elapsed = time.perf_counter() - start
        done = 0
        for text, reply, error in zip(texts, replies, errors):
            scores = (
                None if reply is None else skill_scores(reply, len(self.skills), self.cfg.floor, self.cfg.fallback_prob)
            )
            if scores is None:
                error = error or f"no skill letter in the reply {str(getattr(reply, 'text', ''))[:80]!r}"
                with self.lock:
                    self.failures += 1
                    self.failed.add(text)
                    if len(self.log) < 200:
                        self.log.append(f"- {text}\n  -> {error}")
                continue
            self.cache[(self.instruction, text)] = scores
            done += 1
            if len(self.log) < 200:
                best = np.argsort(-scores)[:3]
                top = ", ".join(f"{self.skills[k]} {math.exp(scores[k]):.2f}" for k in best)
                self.log.append(f"- {' | '.join(text.splitlines())}\n  -> {top}")
        with self.lock:
            self.calls += len(calls)
            self.seconds += elapsed
        return done

    def score_blocking(self, counts: Counter[str], calls: int, seconds: float, what: str) -> dict[str, float]:
        """Score the unscored captions of ``counts``, most frequent first, in batches, up to
        ``calls`` and ``seconds`` (0: no limit), with a progress bar. Returns its figures."""
        todo = [t for t, _ in counts.most_common() if self.wanted(t)][: min(calls, max(0, self.budget_left()))]
        start = time.perf_counter()
        asked, done = ask_in_batches(
            todo,
            self.score,
            batch=self.cfg.batch,
            seconds=seconds,
            label=f"{NAME}: {what}",
            show=self.train.settings.run.progress,
            info=lambda done: f"{done} scored, {self.failures} failed",
        )
        total = sum(counts.values())
        hit = sum(n for t, n in counts.items() if self.scored(t) is not None)
        return {
            "captions": float(len(counts)),
            "calls": float(asked),
            "scored": float(done),
            "seconds": time.perf_counter() - start,
            "covered": hit / max(1, total),
        }

    def prescore_rollouts(self) -> None:
        """Before training: caption random (and reference) rollouts, score the most frequent captions."""
        cfg = self.cfg
        if cfg.prescore_episodes == 0 or cfg.prescore_calls == 0:
            return
        start = time.perf_counter()
        trajectories = self.task.reference_trajectories(cfg.prescore_episodes, self.train.seed, cfg.prescore_steps)
        counts = Counter(self.caption(o) for t in trajectories for o in t.obs)
        rollout_s = time.perf_counter() - start
        self.prescore = {
            "rollout_s": rollout_s,
            **self.score_blocking(counts, cfg.prescore_calls, cfg.prescore_s, "scoring rollout captions"),
        }

    def _work(self, text: str) -> None:
        if self.wanted(text):
            self.score([text])

    # -- the training loop's side --------------------------------------------------------
    def prior(self, obs: torch.Tensor) -> ActionPrior | None:
        """The cached scores of the rows whose caption is scored (others masked out); the
        unscored captions go to the background worker (or are scored now with ``blocking``)."""
        rows = obs.detach().cpu().numpy()
        texts = [self.caption(row) for row in rows]
        self.seen.update(texts)
        self._maybe_rescore()
        if self.cfg.blocking:
            self.score([t for t in texts if self.wanted(t)])
        n = len(self.skills)
        log_probs = torch.zeros(rows.shape[0], n)
        mask = torch.zeros(rows.shape[0], dtype=torch.bool)
        for i, text in enumerate(texts):
            scores = self.scored(text)
            if scores is None:
                if text not in self.failed and self.background.waiting < self.budget_left():
                    self.background.submit(text)
                continue
            log_probs[i] = torch.as_tensor(scores, dtype=torch.float32)
            mask[i] = True
            # the prior changes this row's distribution only if it weighs and is not flat
            self.changed += int(self.cfg.weight > 0 and not is_uniform(scores))
        self.steps += rows.shape[0]
        self.covered += int(mask.sum())
        if not bool(mask.any()):
            return None
        return ActionPrior(log_probs=log_probs, weight=self.cfg.weight, mask=mask)

    def _maybe_rescore(self) -> None:
        """At each ``rescore_at`` point: the agent's most frequent unscored captions, blocking."""
        if not self.rescore_points or self.train.progress < self.rescore_points[0]:
            return
        point = self.rescore_points.pop(0)
        while self.rescore_points and self.train.progress >= self.rescore_points[0]:
            self.rescore_points.pop(0)  # points passed in one batch count once
        figures = self.score_blocking(
            self.seen, self.cfg.rescore_calls, self.cfg.rescore_s, f"scoring the agent's captions at {point:.0%}"
        )
        self.train.log_metric(f"{NAME}/rescore_calls", figures["calls"])
        self.train.log_metric(f"{NAME}/rescore_covered", figures["covered"])

    def start(self) -> None:
        if not self.cfg.blocking:
            self.background.start()

    def stop(self, wait_s: float) -> None:
        self.background.stop(wait_s)
        for error in self.background.errors:  # _work catches the LLM's errors; this is what it did not
            self.log.append(f"- worker error {error}")

    def metrics(self) -> dict[str, float]:
        steps = max(1, self.steps)
        out = {
            f"{NAME}/covered": self.covered / steps,
            f"{NAME}/queries": float(self.queries),
            f"{NAME}/failures": float(self.failures + self.background.failures),
            f"{NAME}/captions": float(len(self.seen)),
            f"{NAME}/captions_scored": float(len(self.cache)),
            "llm/changed_share": self.changed / steps,
            "llm/calls": float(self.calls),
            "llm/seconds": self.seconds,
        }
        out.update({f"{NAME}/prescore_{k}": v for k, v in self.prescore.items()})
        return out


class Plugin:
    """SayCan's action prior. The score cache is the run's (on the object); each training's
    :class:`SkillScorer` lives in ``train.state[NAME]`` from ``on_train_start`` to ``on_train_end``."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.cache: dict[Key, np.ndarray] = {}

    @hookimpl
    def on_run_start(self, run: RunContext) -> None:
        """Refuse a task without named discrete actions before any training."""
        skill_names(run.task)

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Make the training's scorer, score the rollout captions (blocking), start the worker."""
        scorer = train.state[NAME] = SkillScorer(train, self.cfg, self.cache)
        warm_up(train.llm)  # an in-process model loads now, not in the worker thread (loading holds the GIL)
        scorer.prescore_rollouts()
        scorer.start()

    @hookimpl
    def action_prior(self, train: TrainContext, obs: torch.Tensor) -> ActionPrior | None:
        """The LLM's skill distribution on the rows whose caption is scored."""
        scorer = train.state.get(NAME)
        return scorer.prior(obs) if scorer is not None else None

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """Stop the worker; its counters go to the result, the scored captions to a text."""
        scorer = train.state.pop(NAME, None)
        if scorer is None:
            return
        scorer.stop(self.cfg.finish_s)
        result.metrics.update(scorer.metrics())
        header = (
            f"# SayCan skill scores ({scorer.queries} captions asked, {scorer.calls} LLM calls, "
            f"{scorer.seconds:.0f} s; instruction: {scorer.instruction})\n\n"
        )
        train.log_text(f"{NAME}/scores.md", header + "\n".join(scorer.log) + "\n")
