"""saycan: the LLM's likelihood of each skill for the instruction, times a learned affordance.

Method (Ahn et al., 2022, "Do As I Can, Not As I Say: Grounding Language in Robotic
Affordances"): a robot with a library of named skills picks the next one by
``p(skill | instruction, state) ~ p_LLM(skill text | instruction) * p_afford(skill | state)``:
the language model says which skill is useful for the instruction, a learned value
function says which skill can succeed from the current state.

Here, for a discrete task whose actions have names (Crafter's 17 actions, CartPole's two
pushes), every action is a skill:

1. The state is rendered as text (``Task.render_state``), with the details that change
   every step and do not bear on the choice removed (``forget``), so that states repeat.
2. The LLM gets the instruction, the skills as a lettered list and the state, and is asked
   for the letter of the next skill; the log-probabilities of the letters as the reply's
   first token (``top_logprobs``; the embedded llama.cpp model and OpenAI-style backends
   return them) are the skill scores, renormalised over the skills. A backend without
   log-probabilities falls back to the letter it replied (``fallback_prob`` on it).
3. Scores are cached per (instruction, state text) and computed by a worker thread:
   the ``action_prior`` hook never waits (unless ``blocking``), it covers the rows whose
   state is scored and leaves the others to the policy alone.
4. The affordance is the PPO policy itself: the trainer samples from
   ``softmax(logits + weight * log p_LLM)``, i.e. ``pi(a|s) * p_LLM(a)^weight``, and PPO
   trains ``pi`` on the task's reward through that product, so the policy learns what
   can succeed where the LLM's preference is wrong.

Config: ``conf/plugins/saycan.yaml`` (schema: :class:`Config`). Each training's scorer
(worker thread, queue, counters) lives in ``train.state["saycan"]``; the score cache is
the plugin object's (shared by the trainings of a run). Scored states are logged as the
text artifact ``saycan/scores.md``.
"""

from __future__ import annotations

import math
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core import PluginConfig, hookimpl
from core.context import ActionPrior
from core.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from core.context import RunContext, TrainContext
    from core.envs.task import Task
    from core.records import TrainResult

NAME = "saycan"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class Config(PluginConfig):
    """``plugins.saycan``: how skills are scored and how strongly the score steers the policy."""

    instruction: str = ""  # the instruction the skills are scored for; "" uses the task's goal
    weight: float = 1.0  # exponent of the LLM's skill distribution in the product with the policy
    top_logprobs: int = 20  # first-token alternatives asked for (OpenAI-style backends give at most 20)
    floor: float = -10.0  # log-probability given to a skill missing from the alternatives
    fallback_prob: float = 0.8  # without log-probabilities: the probability put on the replied skill
    max_queries: int = 400  # LLM scoring calls per training; later unseen states get no prior
    queue_size: int = 64  # states waiting to be scored; new ones are dropped while it is full
    blocking: bool = False  # score unseen states before acting (reproducible, slow) instead of in the background
    # regular expressions removed from the state text before scoring and caching (details that change every step)
    forget: list[str] = field(default_factory=lambda: [r"Position \([^)]*\), ", r"; daylight [0-9.]+"])
    finish_s: float = 5.0  # seconds to wait for the scoring in progress when a training ends

    def check(self) -> None:
        super().check()
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 1..20, got {self.top_logprobs}")
        if not 0.0 < self.fallback_prob < 1.0:
            raise ValueError(f"fallback_prob must be in (0, 1), got {self.fallback_prob}")
        if self.max_queries < 0 or self.queue_size < 1:
            raise ValueError("max_queries must be >= 0 and queue_size >= 1")
        for pattern in self.forget:
            re.compile(pattern)


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
        raise UserError(f"saycan scores named discrete actions; the task '{task.name}' has {text or 'no action description'}. "
                        "Use a discrete task (cartpole, mountaincar, minecraft), or rlingua for continuous actions.")
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
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": PROMPT.format(instruction=instruction, skills=listed, state=state)}]


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


def preload(llm: Any) -> None:
    """Load an in-process model now: loading holds the GIL for seconds, which must not
    happen in the worker thread while the training loop runs."""
    settings = getattr(llm, "settings", None)
    if settings is not None and getattr(settings, "is_embedded", False):
        from core.llm import embedded

        embedded.get_server(llm.model.split("/", 1)[1])


class SkillScorer:
    """One training's scoring: state texts, the cache lookups, the worker thread, counters."""

    def __init__(self, train: TrainContext, cfg: Config, cache: dict[tuple[str, str], np.ndarray]) -> None:
        self.train, self.cfg, self.cache = train, cfg, cache
        self.task = train.task
        self.skills = skill_names(self.task)
        self.instruction = cfg.instruction or self.task.goal
        self.forget = [re.compile(p) for p in cfg.forget]
        self.requests: queue.Queue[str] = queue.Queue(cfg.queue_size)
        self.pending: set[str] = set()
        self.queries = self.failures = self.rows = self.covered = 0
        self.log: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def state_text(self, obs: np.ndarray) -> str:
        text = self.task.render_state(obs)
        for pattern in self.forget:
            text = pattern.sub("", text)
        return text

    def prior(self, obs: torch.Tensor) -> ActionPrior | None:
        """The cached scores of the rows whose state is scored (others masked out); queues the rest."""
        rows = obs.detach().cpu().numpy()
        n = len(self.skills)
        log_probs = torch.zeros(rows.shape[0], n)
        mask = torch.zeros(rows.shape[0], dtype=torch.bool)
        for i, row in enumerate(rows):
            text = self.state_text(row)
            scores = self.cache.get((self.instruction, text))
            if scores is None:
                scores = self.score(text) if self.cfg.blocking else self.enqueue(text)
            if scores is not None:
                log_probs[i] = torch.as_tensor(scores, dtype=torch.float32)
                mask[i] = True
        self.rows += rows.shape[0]
        self.covered += int(mask.sum())
        if not bool(mask.any()):
            return None
        return ActionPrior(log_probs=log_probs, weight=self.cfg.weight, mask=mask)

    def enqueue(self, text: str) -> None:
        if text in self.pending or self.queries + len(self.pending) >= self.cfg.max_queries:
            return None
        try:
            self.requests.put_nowait(text)
        except queue.Full:
            return None
        self.pending.add(text)
        return None

    def score(self, text: str) -> np.ndarray | None:
        """Ask the LLM for the skill distribution at one state text; cache and return it."""
        if self.queries >= self.cfg.max_queries:
            return None
        self.queries += 1
        messages = build_prompt(self.instruction, self.skills, text)
        try:
            reply = self.train.llm.chat(messages, n=1, temperature=0.0, max_tokens=1, tag=f"{NAME}/score",
                                        top_logprobs=self.cfg.top_logprobs)[0]
        except Exception as exc:  # noqa: BLE001 - an LLM failure costs one state's prior
            self.failures += 1
            self.log.append(f"- LLM error {type(exc).__name__}: {str(exc)[:200]}")
            return None
        scores = skill_scores(reply, len(self.skills), self.cfg.floor, self.cfg.fallback_prob)
        if scores is None:
            self.failures += 1
            self.log.append(f"- no skill letter in the reply {reply.text[:80]!r}")
            return None
        self.cache[(self.instruction, text)] = scores
        if len(self.log) < 100:
            best = np.argsort(-scores)[:3]
            top = ", ".join(f"{self.skills[k]} {math.exp(scores[k]):.2f}" for k in best)
            self.log.append(f"- {' | '.join(text.splitlines())}\n  -> {top}")
        return scores

    # -- the worker thread ---------------------------------------------------------------
    def start(self) -> None:
        if not self.cfg.blocking and self._thread is None:
            # not a daemon: at exit Python waits for the call in progress instead of freeing the model under it
            self._thread = threading.Thread(target=self._work, name="saycan-scorer", daemon=False)
            self._thread.start()

    def stop(self, wait_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _work(self) -> None:
        torch.set_num_threads(1)
        while not self._stop.is_set():
            try:
                text = self.requests.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.score(text)
            finally:
                self.pending.discard(text)

    def metrics(self) -> dict[str, float]:
        return {f"{NAME}/queries": float(self.queries), f"{NAME}/failures": float(self.failures),
                f"{NAME}/states_cached": float(len(self.cache)),
                f"{NAME}/covered": self.covered / max(1, self.rows)}


class Plugin:
    """SayCan's action prior. The score cache is the run's (on the object); each training's
    :class:`SkillScorer` lives in ``train.state[NAME]`` from ``on_train_start`` to ``on_train_end``."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.cache: dict[tuple[str, str], np.ndarray] = {}

    @hookimpl
    def on_run_start(self, run: RunContext) -> None:
        """Refuse a task without named discrete actions before any training."""
        skill_names(run.task)

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Make the training's scorer and start its worker (the model is loaded here, before the loop)."""
        preload(train.llm)
        scorer = train.state[NAME] = SkillScorer(train, self.cfg, self.cache)
        scorer.start()

    @hookimpl
    def action_prior(self, train: TrainContext, obs: torch.Tensor) -> ActionPrior | None:
        """The LLM's skill distribution on the rows whose state is scored."""
        scorer = train.state.get(NAME)
        return scorer.prior(obs) if scorer is not None else None

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """Stop the worker; its counters go to the result, the scored states to a text."""
        scorer = train.state.pop(NAME, None)
        if scorer is None:
            return
        scorer.stop(self.cfg.finish_s)
        result.metrics.update(scorer.metrics())
        header = f"# SayCan skill scores ({scorer.queries} LLM queries, instruction: {scorer.instruction})\n\n"
        train.log_text(f"{NAME}/scores.md", header + "\n".join(scorer.log) + "\n")
