"""progress_reward: the LLM judges the agent's progress; its score is blended into the reward.

Method (design note "Progress Reward Model for Reinforcement Learning via Large Language
Models"):

1. Semantic channel: the task's text rendering of a state, with the recent actions, goes
   to the LLM with at most three sentences of background, a list of evaluation
   dimensions and a fixed output format (``Score: 1-10`` and ``Reason: ...``). Replies
   without a usable score are rejected.
2. Consistency: each state is scored ``samples`` times; the median is kept when the
   samples agree (confidence >= ``confidence``), otherwise a rule scores the state
   (how the episode's env return so far ranks among the returns seen).
3. Cost: states are judged only every ``eval_every`` steps (the score is reused in
   between); a KD-tree over judged states serves similar states within ``cache_radius``;
   once ``distill.min_labels`` states are scored, a small ensemble regresses the score
   from the state and answers wherever it agrees with itself and the state is not novel.
4. Asynchrony: a worker thread asks the LLM; the reward transform never waits, it reads
   the results the worker left in a ring buffer.
5. Mixed reward: ``w_env * r + w_llm * z(progress) + w_exp * bonus`` with stage weights
   (early / middle / late fractions of the budget), a running z-score (EMA 0.99) of the
   progress score, and a count-based novelty bonus. With ``shaping`` the LLM term is the
   potential difference ``gamma * z(s') - z(s)``, which keeps the optimal policy.
6. Sparse-signal guard: when the LLM keeps scoring no progress, its weight moves to the
   exploration bonus until a better score comes (logged).

Config: ``conf/plugins/progress_reward.yaml`` (schema: :class:`Config`). Each training's
judge lives in ``train.state["progress_reward"]``. The evaluator's reasons are logged as
the text artifact ``progress_reward/reasons.md``.
"""

from __future__ import annotations

import math
import queue
import re
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from core import PluginConfig, hookimpl

if TYPE_CHECKING:  # pragma: no cover
    from core.context import StepBatch, TrainContext
    from core.records import TrainResult

NAME = "progress_reward"


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
class Distill:
    """``distill``: a small ensemble serves most evaluations once enough states are scored."""

    enabled: bool = True  # fit and use the distilled evaluator
    min_labels: int = 24  # LLM-scored states before the first fit
    refit_every: int = 16  # new LLM scores between refits
    members: int = 3  # ensemble size; their spread is the uncertainty
    hidden: int = 64  # hidden units of each member
    epochs: int = 200  # full-batch Adam steps per fit
    max_std: float = 0.75  # ask the LLM when the members disagree by more than this (score points)
    novelty_radius: float = 3.0  # ask the LLM when the nearest judged state is farther than this


@dataclass
class Config(PluginConfig):
    """``plugins.progress_reward``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`
    (this plugin proposes nothing: the defaults leave the run's loop as it is)."""

    background: str | None = None  # task background for the prompt (<= 3 sentences); None = the goal cut to 3 sentences
    dimensions: list[str] = field(default_factory=lambda: [  # evaluation dimensions listed in the prompt
        "closeness to the goal", "avoiding failure or danger", "useful intermediate steps achieved"])
    recent_actions: int = 4  # how many of the env's last actions the prompt shows
    samples: int = 3  # evaluations per state; the median is kept (design: 3)
    temperature: float = 0.7  # sampling temperature of the evaluations
    max_tokens: int = 40  # cap on each reply: a score and a short reason
    agree_tol: float = 1.0  # a sample agrees with the median when within this many points
    # below this share of agreeing samples, the fallback rule scores the state (design: 0.7; 0.6 = two of three)
    confidence: float = 0.6
    eval_every: int = 4  # judge the envs' states every k steps and reuse the score in between (design: 4)
    cache_radius: float = 0.5  # a judged state within this distance (per-dimension-scaled features) is reused (KD-tree)
    scale_states: int = 256  # states used to fix the per-dimension feature scale
    novelty_cell: float = 0.5  # grid cell (scaled features) of the count-based exploration bonus 1/sqrt(n)
    ema: float = 0.99  # decay of the running mean and variance that z-score the LLM score
    shaping: bool = False  # true: the LLM term is gamma*z(s') - z(s) (potential-based; keeps the optimal policy)
    gamma: float = 0.99  # discount of the potential-based shaping
    max_pending: int = 4  # states waiting for the LLM; more are dropped (the training loop never waits)
    ring_size: int = 256  # finished evaluations the worker can leave for the reward side
    # after training, wait up to this long for the LLM call in progress (so it is logged); 0 = do not wait
    finish_s: float = 30.0
    max_reasons: int = 300  # reasons kept for the artifact progress_reward/reasons.md
    stages: Stages = field(default_factory=Stages)  # weights (env, llm, exploration) per training stage
    sparse: Sparse = field(default_factory=Sparse)  # sparse-signal guard
    # the distilled evaluator: a small ensemble serves most evaluations once enough states are scored
    distill: Distill = field(default_factory=Distill)

    def check(self) -> None:
        super().check()
        for name in ("samples", "max_tokens", "eval_every", "max_pending", "ring_size", "scale_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {self.confidence}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.cache_radius < 0 or self.novelty_cell <= 0:
            raise ValueError(f"cache_radius must be >= 0 and novelty_cell > 0, got {self.cache_radius} and {self.novelty_cell}")
        if not self.dimensions:
            raise ValueError("dimensions must list at least one evaluation dimension")
        for stage in ("early", "middle", "late"):
            if len(getattr(self.stages, stage)) != 3:
                raise ValueError(f"stages.{stage} must be three weights (env, llm, exploration), "
                                 f"got {getattr(self.stages, stage)}")
        if list(self.stages.boundaries) != sorted(self.stages.boundaries):
            raise ValueError(f"stages.boundaries must be increasing, got {self.stages.boundaries}")
        if self.sparse.window < 1:
            raise ValueError(f"sparse.window must be >= 1, got {self.sparse.window}")
        if self.distill.members < 1 or self.distill.min_labels < 1:
            raise ValueError(f"distill.members and distill.min_labels must be >= 1, got {self.distill.members}, "
                             f"{self.distill.min_labels}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = "You are a strict coach who rates how much progress an agent has made towards its goal."

PROMPT = """Task: {background}
Judge the agent on:
{dimensions}
Recent actions: {actions}
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


def build_prompt(background: str, dimensions: list[str], state: str, actions: str) -> list[dict[str, str]]:
    """The chat messages that ask for one progress score."""
    dims = "\n".join(f"- {d}" for d in dimensions)
    user = PROMPT.format(background=background, dimensions=dims, actions=actions or "none", state=state)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


@dataclass
class Judgement:
    """One parsed reply: a score in [1, 10] and the reason (empty when absent)."""

    score: float
    reason: str


def parse_reply(text: str) -> Judgement | None:
    """The score and reason of a reply, or None when it is malformed.

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


def stage_weights(progress: float, boundaries: list[float], stages: list[list[float]]) -> tuple[float, float, float]:
    """(env, llm, exploration) weights of the stage ``progress`` (budget fraction) is in."""
    index = sum(progress >= b for b in boundaries)
    w = stages[min(index, len(stages) - 1)]
    return float(w[0]), float(w[1]), float(w[2])


class RunningZ:
    """Running z-score with exponential moving mean and variance (decay 0.99 by default).

    ``mean <- d*mean + (1-d)*x``; ``var <- d*var + (1-d)*(x-mean)^2``; the first value
    sets the mean, the variance starts at ``var0``.
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

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return (x - self.mean) / (math.sqrt(self.var) + 1e-8)


class StateCache:
    """Judged states in a KD-tree: a similar state (within ``radius``) reuses the score.

    New states wait in a small list searched by brute force; the tree is rebuilt only when
    that list reaches a quarter of the tree (at least ``rebuild_min``), so the reward
    side never rebuilds it after every finished evaluation.
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
            recent = np.stack(self.points[self._indexed:n])
            d = np.sqrt(((xs[:, None, :] - recent[None]) ** 2).sum(-1))
            j = d.argmin(1)
            near = d[np.arange(len(xs)), j]
            closer = near < dist
            dist = np.where(closer, near, dist)
            value = np.where(closer, values[self._indexed + j], value)
        return np.asarray(dist), np.asarray(value)


class Distiller:
    """A small ensemble regressing the LLM score from state features (mean and spread)."""

    def __init__(self, dim: int, hidden: int = 64, members: int = 3, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.nets = [self._net(dim, hidden, gen) for _ in range(members)]

    @staticmethod
    def _net(dim: int, hidden: int, gen: torch.Generator) -> torch.nn.Module:
        net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
        return net

    def fit(self, x: np.ndarray, y: np.ndarray, epochs: int = 200, lr: float = 1e-2) -> float:
        """Fit every member on a bootstrap of (x, y); returns the final mean squared error."""
        xt, yt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)
        losses = []
        for k, net in enumerate(self.nets):
            idx = torch.randint(len(xt), (len(xt),), generator=torch.Generator().manual_seed(k))
            opt = torch.optim.Adam(net.parameters(), lr=lr)
            for _ in range(epochs):
                loss = torch.nn.functional.mse_loss(net(xt[idx]).squeeze(-1), yt[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(float(loss.detach()))
        return float(np.mean(losses))

    @torch.no_grad()
    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xt = torch.as_tensor(x, dtype=torch.float32)
        out = torch.stack([net(xt).squeeze(-1) for net in self.nets])
        return out.mean(0).numpy(), out.std(0).numpy()


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


def preload(llm: Any) -> None:
    """Load an in-process model now: loading holds the GIL for seconds, so it must not
    happen in the worker while the training loop runs."""
    settings = getattr(llm, "settings", None)
    if settings is not None and getattr(settings, "is_embedded", False):
        from core.llm import embedded

        embedded.get_server(llm.model.split("/", 1)[1])


def render_actions(actions: list[Any]) -> str:
    return ", ".join(str(a) for a in actions)


# -- the judge -----------------------------------------------------------------------------


@dataclass
class _Request:
    env: int
    episode: int
    obs: np.ndarray
    feature: np.ndarray
    actions: str
    episode_return: float
    frames: int


@dataclass
class _Result:
    request: _Request
    score: float
    confidence: float
    source: str  # "llm" or "rule"
    samples: list[float]
    reason: str
    latency_s: float


@dataclass
class _Counters:
    llm_calls: int = 0
    llm_replies_cached: int = 0
    cache_hits: int = 0
    distilled: int = 0
    rejected: int = 0
    fallbacks: int = 0
    dropped: int = 0
    llm_errors: int = 0
    llm_latency: list[float] = field(default_factory=list)
    distilled_latency: list[float] = field(default_factory=list)
    sparse_steps: int = 0
    steps: int = 0


class ProgressJudge:
    """Per-training state: the reward side (main thread) and the LLM worker thread."""

    def __init__(self, train: TrainContext, cfg: Config) -> None:
        self.train, self.cfg = train, cfg
        self.task = train.task
        self.background = cfg.background or background_of(self.task.goal)
        self.z = RunningZ(cfg.ema)
        self.cache = StateCache(cfg.cache_radius)
        self.requests: queue.Queue[_Request] = queue.Queue(maxsize=cfg.max_pending)
        self.ring: deque[_Result] = deque(maxlen=cfg.ring_size)
        self.counts = _Counters()
        self.returns_seen: deque[float] = deque(maxlen=512)
        self.recent_scores: deque[float] = deque(maxlen=cfg.sparse.window)
        self.sparse = False
        self.reasons: list[str] = []
        self.distiller: Distiller | None = None
        self.labels: list[tuple[np.ndarray, float]] = []
        self._fitted_at = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step = 0
        self._scale: np.ndarray | None = None
        self._scale_rows: list[np.ndarray] = []
        self._b = 0
        self._one_hot: bool | None = None
        self.novelty = NoveltyCounter(cfg.novelty_cell)
        # per-step constants read once: attribute lookups and list building cost every step
        self._eval_every = cfg.eval_every
        self._boundaries = list(cfg.stages.boundaries)
        self._stages = [list(cfg.stages.early), list(cfg.stages.middle), list(cfg.stages.late)]
        self._shaping, self._gamma = cfg.shaping, cfg.gamma

    # -- features ----------------------------------------------------------------------
    def features(self, obs: np.ndarray) -> np.ndarray:
        """States scaled per dimension by their spread in the first batches seen."""
        if self._scale is None:
            self._scale_rows.append(obs)
            rows = np.concatenate(self._scale_rows)
            if len(rows) >= self.cfg.scale_states:
                std = rows.std(0)
                self._scale = np.where(std > 1e-6, std, 1.0)
            else:
                std = rows.std(0) if len(rows) > 1 else np.ones(obs.shape[-1])
                return obs / np.where(std > 1e-6, std, 1.0)
        return obs / self._scale

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
        self.act_hist[:, self._step % self.act_hist.shape[1]] = self.action_codes(batch.action)
        self.ep_steps += 1
        self.ep_return += batch.env_reward.detach().cpu().numpy()
        self._drain()
        bonus = self.novelty.visit(feats)  # exploration bonus 1/sqrt(visits of the state's cell)
        if self._step % self._eval_every == 0:
            self._judge(obs, feats)
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
        base = batch.reward.detach().cpu().numpy().astype(np.float64)
        mixed = w_env * base + w_llm * llm_term + w_exp * bonus
        if done.any():  # a new episode starts: its progress is unknown again
            self.returns_seen.extend(self.ep_return[done].tolist())
            self.ep_return[done] = 0.0
            self.ep_steps[done] = 0
            self.episode[done] += 1
            self.progress[done] = np.nan
        return torch.from_numpy(mixed - base).float()

    def action_codes(self, action: torch.Tensor) -> np.ndarray:
        """One number per env for the action history: the index of a one-hot action, else
        the first component (one-hot or not is decided once, on the first batch)."""
        a = action.detach().cpu().numpy()
        if a.ndim == 1:
            return a
        if self._one_hot is None:
            self._one_hot = bool(a.shape[-1] > 1 and np.isin(a, (0, 1)).all())
        return a.argmax(-1) if self._one_hot else a.reshape(len(a), -1)[:, 0]

    def recent_actions(self, env: int) -> str:
        """The env's last actions in this episode, oldest first, as text."""
        K = self.act_hist.shape[1]
        n = int(min(self.ep_steps[env], K))
        values = self.act_hist[env, [(self._step - n + k) % K for k in range(n)]]
        return render_actions([int(v) if float(v).is_integer() else round(float(v), 2) for v in values])

    def _init_envs(self, B: int) -> None:
        self._b = B
        self.progress = np.full(B, np.nan)
        self.prev_phi = np.zeros(B)
        self.ep_return = np.zeros(B)
        self.ep_steps = np.zeros(B, dtype=np.int64)
        self.episode = np.zeros(B, dtype=np.int64)
        self.act_hist = np.zeros((B, max(1, self.cfg.recent_actions)))

    def _judge(self, obs: np.ndarray, feats: np.ndarray) -> None:
        """Score every env's state from the cache, the distilled model, or queue it for the LLM."""
        cfg, c = self.cfg, self.counts
        dist, cached = self.cache.query(feats)
        hit = dist <= self.cache.radius
        self.progress[hit] = cached[hit]
        c.cache_hits += int(hit.sum())
        need = np.flatnonzero(~hit)
        distiller = self.distiller
        if len(need) and distiller is not None:
            t0 = time.perf_counter()
            mean, std = distiller.predict(feats[need])
            c.distilled_latency.append((time.perf_counter() - t0) / len(need))
            sure = (std <= cfg.distill.max_std) & (dist[need] <= cfg.distill.novelty_radius)
            self.progress[need[sure]] = np.clip(mean[sure], 1.0, 10.0)
            c.distilled += int(sure.sum())
            need = need[~sure]
        for k, i in enumerate(need):
            if self.requests.full():  # never wait: the LLM is busy, the envs keep their last score
                c.dropped += len(need) - k
                break
            self.requests.put_nowait(_Request(int(i), int(self.episode[i]), obs[i].astype(np.float32), feats[i].copy(),
                                              self.recent_actions(int(i)), float(self.ep_return[i]), int(self.train.frames)))

    def _drain(self) -> None:
        """Take what the worker finished: cache it, update the z-score, set env progress."""
        while self.ring:
            res = self.ring.popleft()
            req = res.request
            self.cache.add(req.feature, res.score)
            self.z.update(res.score)
            if req.episode == self.episode[req.env]:
                self.progress[req.env] = res.score
            if res.source == "llm":
                self._sparse_guard(res.score)

    def _sparse_guard(self, score: float) -> None:
        self.recent_scores.append(score)
        window = self.recent_scores.maxlen or 1
        now = len(self.recent_scores) == window and max(self.recent_scores) <= self.cfg.sparse.max_score
        if now != self.sparse:
            self.sparse = now
            what = (f"sparse signal: the last {window} LLM scores were all <= {self.cfg.sparse.max_score:g}; using the "
                    "exploration bonus instead") if now else "sparse signal over: the LLM scored progress again"
            self.reasons.append(f"- frames {self.train.frames}: **{what}**")
            self.train.log_metric("judge/sparse", float(now))

    # -- worker thread -----------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # not a daemon: at exit Python waits for the LLM call in progress instead of
            # freeing the model under it (a crash)
            self._thread = threading.Thread(target=self._work, name="progress-judge", daemon=False)
            self._thread.start()

    def stop(self, wait_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _work(self) -> None:
        torch.set_num_threads(1)
        llm = self.train.llm
        while not self._stop.is_set():
            try:
                req = self.requests.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.ring.append(self._evaluate(llm, req))
            except Exception as exc:  # noqa: BLE001 - an LLM failure costs one evaluation
                self.counts.llm_errors += 1
                self.reasons.append(f"- frames {req.frames}: LLM error {type(exc).__name__}: {str(exc)[:200]}")
            self._maybe_distill()

    def _evaluate(self, llm: Any, req: _Request) -> _Result:
        cfg, c = self.cfg, self.counts
        state = self.task.render_state(req.obs)
        messages = build_prompt(self.background, list(cfg.dimensions), state, req.actions)
        t0 = time.perf_counter()
        replies = llm.chat(messages, n=cfg.samples, temperature=cfg.temperature,
                           max_tokens=cfg.max_tokens, stop=["\n"], seed=int(self.train.seed),
                           tag=f"{NAME}/evaluate")
        latency = time.perf_counter() - t0
        c.llm_calls += 1
        c.llm_replies_cached += sum(bool(r.cached) for r in replies)
        if not all(r.cached for r in replies):
            c.llm_latency.append(latency)
        parsed = [parse_reply(r.text) for r in replies]
        c.rejected += sum(p is None for p in parsed)
        valid = [p for p in parsed if p is not None]
        median, conf = consensus([p.score for p in valid], len(replies), cfg.agree_tol)
        source, score = "llm", median
        if conf < cfg.confidence:
            source, score = "rule", rule_score(req.episode_return, list(self.returns_seen))
            c.fallbacks += 1
        else:
            self.labels.append((req.feature, median))
        reason = next((p.reason for p in valid if p.reason and abs(p.score - median) <= cfg.agree_tol), "")
        if len(self.reasons) < cfg.max_reasons:
            scores = ", ".join(f"{p.score:g}" for p in valid) or "none parsed"
            first_line = state.splitlines()[0] if state else ""
            self.reasons.append(f"- frames {req.frames}, env {req.env}: **{score:.1f}** ({source}; samples {scores}; "
                                f"confidence {conf:.2f}; {latency:.2f} s) {reason} | state: {first_line}")
        return _Result(req, float(score), conf, source, [p.score for p in valid], reason, latency)

    def _maybe_distill(self) -> None:
        d = self.cfg.distill
        n = len(self.labels)
        if not d.enabled or n < d.min_labels or n - self._fitted_at < d.refit_every:
            return
        x = np.stack([f for f, _ in self.labels])
        y = np.array([s for _, s in self.labels])
        model = Distiller(x.shape[1], d.hidden, d.members, seed=int(self.train.seed))
        mse = model.fit(x, y, epochs=d.epochs)
        self.distiller, self._fitted_at = model, n  # one assignment: the reward side sees old or new
        self.train.log_metric("judge/distill_mse", mse)

    # -- summary -----------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        c = self.counts
        evaluations = c.cache_hits + c.distilled + c.llm_calls
        return {
            "judge/llm_calls": float(c.llm_calls),
            "judge/llm_replies_cached": float(c.llm_replies_cached),
            "judge/cache_hits": float(c.cache_hits),
            "judge/distilled": float(c.distilled),
            "judge/rejected_replies": float(c.rejected),
            "judge/fallbacks": float(c.fallbacks),
            "judge/dropped": float(c.dropped),
            "judge/llm_errors": float(c.llm_errors),
            "judge/llm_share": c.llm_calls / evaluations if evaluations else 0.0,
            "judge/latency_llm_s": float(np.mean(c.llm_latency)) if c.llm_latency else float("nan"),
            "judge/latency_distilled_s": float(np.mean(c.distilled_latency)) if c.distilled_latency else float("nan"),
            "judge/sparse_fraction": c.sparse_steps / max(1, c.steps),
            "judge/progress_mean": self.z.mean,
        }


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """The progress reward of a run. Each training's :class:`ProgressJudge` (its worker
    thread, caches and statistics) lives in ``train.state[NAME]``, from ``on_train_start``
    to ``on_train_end``; the plugin object holds only the config."""

    def __init__(self, config: Config) -> None:
        self.cfg = config

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Make the training's judge and start its LLM worker (the model is loaded here, before the loop)."""
        preload(train.llm)
        judge = train.state[NAME] = ProgressJudge(train, self.cfg)
        judge.start()

    @hookimpl
    def compute_reward(self, train: TrainContext, batch: StepBatch) -> torch.Tensor | None:
        """The mixed reward minus the reward so far (the hook's terms are added)."""
        judge = train.state.get(NAME)
        return judge.reward(batch) if judge is not None else None

    @hookimpl
    def on_rollout(self, train: TrainContext) -> None:
        """Log the judge's counters once per collected batch."""
        judge = train.state.get(NAME)
        if judge is not None:
            c = judge.counts
            train.log_metric("judge/llm_calls", c.llm_calls)
            train.log_metric("judge/cache_hits", c.cache_hits)
            train.log_metric("judge/distilled", c.distilled)

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """Stop the worker; put the judge's metrics on the result and its reasons in a text."""
        judge = train.state.pop(NAME, None)
        if judge is None:
            return
        judge.stop(self.cfg.finish_s)
        result.metrics.update({k: v for k, v in judge.metrics().items() if v == v})
        header = f"# Progress judge reasons ({judge.counts.llm_calls} LLM evaluations)\n\n"
        train.log_text(f"{NAME}/reasons.md", header + "\n".join(judge.reasons) + "\n")
