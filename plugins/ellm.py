"""ellm: the LLM suggests goals from a caption of the state; a transition that matches one pays (ELLM, ICML 2023).

Method (Du et al., "Guiding Pretraining in Reinforcement Learning with Large Language
Models"): a state captioner describes what the agent sees and has; an LLM, prompted with
that caption, suggests a few goals in free text; a transition captioner says what each step
did; the intrinsic reward of a transition is ``max_i cos(E(caption of the step), E(goal_i))``
over the goals suggested for the state it started from, paid when it reaches a threshold
``T`` (``E``: a sentence encoder). Goals the agent already achieved in the episode are left
out, so each is rewarded once per episode. The agent is pre-trained on this reward alone.

Here:

1. State captions are the task's coarse ``Task.caption`` (Crafter: what is within two
   cells, the items held, low vitals), so that they recur and one answer serves many
   steps. Suggestions are cached per caption on the plugin object (the run's trainings share
   them; the LLM client's response cache keeps them across runs).
2. Before training, the captions of random-policy rollouts are asked, most frequent first,
   blocking and in batches (``chat_many``), within ``presuggest_calls`` / ``presuggest_s``;
   at ``resuggest_at`` points of the training the agent's unanswered captions are asked the
   same way. Either way the captions of states a step with an event started from come
   first (only there can an answer pay), then the most visited. A step from an unanswered
   caption earns nothing.
3. Transition captions are ``Task.caption_transition`` (Crafter: "collect wood", "place
   table", "eat cow", ...); a step with several events is matched event by event.
4. Embeddings come from ``LLMClient.embed`` (the embedded model's own weights in embedding
   mode, or a litellm embedding model, ``embed_model``), centred on the mean embedding of the
   task's goal phrases (``center``: a decoder model's embeddings share one large direction,
   which squeezes every cosine towards 1), then compared by cosine.
5. ``pretrain: true`` (the default) trains on the intrinsic reward alone: the env's reward
   (and a reward program's) is replaced. Evaluation still reports the task's fitness.

Variants: ``match: names`` asks for goals from the task's achievement names and pays
``bonus`` when a suggested achievement unlocks (the earlier behaviour); ``goals: fixed``
gives every state the task's goal phrases and calls no LLM (the no-LLM control).

Config: ``conf/plugins/ellm.yaml`` (schema: :class:`Config`); page: ``docs/plugins/ellm.md``.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.plugin import (
    PluginConfig,
    RunContext,
    StepBatch,
    Task,
    TrainContext,
    TrainResult,
    UserError,
    ask_in_batches,
    goal_names,
    hookimpl,
    match_goal,
    newly_achieved,
)

NAME = "ellm"


@dataclass
class Config(PluginConfig):
    """``plugins.ellm``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 1  # outer rounds (ELLM has no outer loop: one training)
    # llm: the LLM suggests goals per state caption; fixed: the task's goal phrases for every state,
    # no LLM call (control)
    goals: str = "llm"
    # embedding: cosine of goal and step caption >= threshold (ELLM); names: a suggested achievement
    # unlocks (variant)
    match: str = "embedding"
    # train on the intrinsic reward alone (the env's reward is replaced); false: add it to the env's reward
    pretrain: bool = True
    # cosine (after centring) at which a step achieves a goal; calibrated in docs/plugins/ellm.md
    threshold: float = 0.64
    bonus: float = 1.0  # scale of the reward: a matching step pays bonus * cosine (names: bonus)
    center: bool = True  # subtract the mean embedding of the task's goal phrases before the cosine
    # "": the LLM's own model (embedded: its weights in embedding mode); else a litellm embedding model
    embed_model: str = ""
    goals_per_state: int = 5  # most goals kept from one suggestion
    presuggest_episodes: int = 8  # random-policy rollouts captioned before training
    presuggest_steps: int = 500  # steps per rollout at most
    presuggest_calls: int = 32  # LLM calls before training at most (most frequent captions first)
    presuggest_s: float = 240.0  # seconds of LLM calls before training at most (0: no limit)
    resuggest_at: list[float] = field(
        default_factory=lambda: [0.25, 0.5, 0.75]
    )  # fractions of training at which the agent's most frequent unanswered captions are asked, blocking
    resuggest_calls: int = 8  # LLM calls per point at most
    resuggest_s: float = 60.0  # seconds per point at most (0: no limit)
    batch: int = 4  # captions per batch of concurrent calls (llm.chat_many)
    temperature: float = 0.0  # sampling temperature of the suggestions (0: one answer per caption)
    max_tokens: int = 80  # cap on each reply
    final_seeds: int = 0  # retrain the best candidate on this many more seeds after the loop

    def check(self) -> None:
        super().check()
        if self.goals not in ("llm", "fixed"):
            raise ValueError(f"goals must be 'llm' or 'fixed', got {self.goals!r}")
        if self.match not in ("embedding", "names"):
            raise ValueError(f"match must be 'embedding' or 'names', got {self.match!r}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine in [-1, 1], got {self.threshold}")
        for name in ("goals_per_state", "batch", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("presuggest_episodes", "presuggest_steps", "presuggest_calls", "resuggest_calls"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.presuggest_s < 0 or self.resuggest_s < 0 or self.temperature < 0:
            raise ValueError("presuggest_s, resuggest_s and temperature must be >= 0")
        if any(not 0.0 < p < 1.0 for p in self.resuggest_at):
            raise ValueError(f"resuggest_at holds fractions of the training in (0, 1), got {self.resuggest_at}")


# -- prompt pieces -----------------------------------------------------------------------

#: no list of goals or actions: given the actions, the small embedded model copied them out as its "goals"
SYSTEM = """You suggest goals to the player of a game. The player's aim: {aim}
Given what the player sees and has, suggest the {k} most useful goals to do next. Each goal
is a short phrase: a verb and what it acts on. One goal per line, numbered, nothing else."""

#: ``match: names``: the goals must be the task's achievement names (the variant)
SYSTEM_NAMES = """You advise a player of a game. Given what the player sees and has, suggest the {k}
most useful goals to do next. Choose only from this list, one goal name per line, nothing
else: {goals}."""

ASK = "{caption}\nWhat should the player do next?"


# -- helpers -------------------------------------------------------------------------------


def goal_phrase(name: str) -> str:
    """A goal name as words: ``collect_wood`` -> ``collect wood``."""
    return name.replace("_", " ")


def plain_aim(goal: str) -> str:
    """The task's goal in words for a player: its first clause, without asides on state fields
    ("(`health` above 0)"). Not the list after a colon: the small model recited it as its goals
    ("collect resources; craft tools; place objects; eat; drink") for every state."""
    text = re.sub(r"\s*\([^)]*`[^)]*\)", "", goal).replace("`", "").split(":")[0].strip()
    return text if text.endswith(".") else text + "."


#: a line's list marker ("1.", "2)", "-", "*", "a.") and the markup around a goal
_MARKER = re.compile(r"^\s*(?:[-*\u2022]+|\(?\d+[.):]|[a-z][.)])\s*", re.I)
_NOT_GOAL = ("here ", "sure", "goals", "the player", "suggested", "next goals", "i ", "as an")


def parse_suggestions(reply: str, k: int) -> list[str]:
    """The goals a free-form reply suggests, at most ``k``, in order, lower-cased.

    One per line (or ``;`` / ``,``-separated), list markers, markup and explanations after
    ``:`` / `` - `` / ``(`` dropped; a leading "to" dropped; sentences (over 6 words),
    headers ("Here are the goals:") and repeats left out.
    """
    goals: list[str] = []
    for line in re.split(r"[\n;]+", reply or ""):
        line = re.sub(r"[*`\"]+", "", _MARKER.sub("", line)).strip()
        if not line or line.endswith(":") and len(line.split()) > 2:
            continue  # empty, or a header
        for part in line.split(","):
            item = re.split(r":|\s[-\u2013\u2014]\s|\(|\.\s", part)[0].strip(" .!'").lower()
            item = re.sub(r"^(?:to|then|and)\s+", "", item)
            if len(item.split()) > 6:  # "chop the tree with the wood pickaxe": the goal before its means or purpose
                item = re.split(r"\s(?:with|using|to|so|for|in order to|because)\s", item)[0]
            if not item or len(item.split()) > 6 or item.startswith(_NOT_GOAL):
                continue
            if item not in goals:
                goals.append(item)
    return goals[:k]


def parse_goal_names(reply: str, names: list[str], k: int) -> list[str]:
    """``match: names``: the task's goal names a reply names (case, spaces aside, or inside a phrase), at most ``k``."""
    found: list[str] = []
    for line in re.split(r"[\n,;]+", reply or ""):
        item = _MARKER.sub("", line).strip().strip("`'\".")
        goal = match_goal(item, names) if item else None
        if goal is None and item:
            goal = next((g for g in names if re.search(rf"\b{g.replace('_', '[ _]')}\b", item.lower())), None)
        if goal is not None and goal not in found:
            found.append(goal)
    return found[:k]


def unit_rows(vectors: np.ndarray, center: np.ndarray | None = None) -> np.ndarray:
    """Rows minus ``center`` (if given), scaled to unit length (a zero row stays zero)."""
    x = np.asarray(vectors, np.float64) - (center if center is not None else 0.0)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


class Embeddings:
    """Goal and caption embeddings of one training: ``LLMClient.embed`` (cached there per
    text), centred on the task's goal phrases, unit length. A text whose embedding failed is
    not asked again; its rows match nothing."""

    def __init__(self, llm: Any, model: str, anchors: list[str], center: bool) -> None:
        self.llm, self.model, self.anchors, self.use_center = llm, model or None, anchors, center
        self.center: np.ndarray | None = None
        self.vectors: dict[str, np.ndarray] = {}
        self.failed: set[str] = set()
        self.off = False  # the anchors could not be embedded: no text is matched in this training
        self.calls = self.errors = 0
        self.seconds = 0.0
        self.log: list[str] = []

    def _embed(self, texts: list[str]) -> np.ndarray | None:
        start = time.perf_counter()
        self.calls += 1
        try:
            return np.asarray(self.llm.embed(texts, model=self.model, tag=f"{NAME}/embed"), np.float64)
        except Exception as exc:  # an embedding failure costs its texts' matches, never the training
            self.errors += 1
            self.failed.update(texts)
            if len(self.log) < 50:
                self.log.append(f"- embedding {len(texts)} text(s) failed: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        finally:
            self.seconds += time.perf_counter() - start

    def get(self, texts: list[str]) -> np.ndarray | None:
        """``[len(texts), D]`` unit rows, or None if any text has no embedding."""
        if self.off:
            return None
        if self.use_center and self.center is None and self.anchors:
            anchors = self._embed(list(self.anchors))
            if anchors is None:
                self.off = True
                return None
            self.center = anchors.mean(axis=0)
        todo = [t for t in dict.fromkeys(texts) if t not in self.vectors and t not in self.failed]
        if todo:
            raw = self._embed(todo)
            if raw is not None:
                self.vectors.update(zip(todo, unit_rows(raw, self.center)))
        if any(t not in self.vectors for t in texts):
            return None
        return np.stack([self.vectors[t] for t in texts])


# -- one training's goals and rewards ------------------------------------------------------


class GoalReward:
    """One training's suggestions, per-env achieved goals, intrinsic rewards and counters.

    The suggestion cache (caption -> goals) is the run's, shared with its other trainings.
    """

    def __init__(self, train: TrainContext, cfg: Config, suggested: dict[str, list[str]]) -> None:
        self.train, self.cfg, self.task, self.suggested = train, cfg, train.task, suggested
        self.names = goal_names(self.task)
        self.fixed = list(self.names) if cfg.match == "names" else [goal_phrase(n) for n in self.names]
        self.embeddings = (
            Embeddings(train.llm, cfg.embed_model, [goal_phrase(n) for n in self.names], cfg.center)
            if cfg.match == "embedding"
            else None
        )
        self.seen: Counter[str] = Counter()  # state captions, one row per step (a sample: captions cost ~0.1 ms)
        self.starts: Counter[str] = Counter()  # captions of the states steps with an event started from
        self.achieved: list[set[str]] = []  # per env: the goals rewarded in its current episode
        self.points = sorted(cfg.resuggest_at)
        self.failed: set[str] = set()  # captions whose call failed in this training
        self.steps = self.events = self.unanswered = self.hits = self.changed = 0
        self.from_suggestions = 0  # (episode, goal) rewards of goals the LLM suggested
        self.reward = 0.0
        self.calls = self.queries = self.failures = 0
        self.seconds = 0.0
        self.per_goal: Counter[str] = Counter()
        self.log: list[str] = []
        self.figures: dict[str, float] = {}

    # -- goals -------------------------------------------------------------------------------
    def goals_for(self, caption: str) -> list[str] | None:
        """The goals of a state caption; None while the LLM has not answered it."""
        return self.fixed if self.cfg.goals == "fixed" else self.suggested.get(caption)

    def wanted(self, caption: str) -> bool:
        return self.cfg.goals == "llm" and caption not in self.suggested and caption not in self.failed

    def prompt(self, caption: str) -> list[dict[str, str]]:
        k = self.cfg.goals_per_state
        if self.cfg.match == "names":
            system = SYSTEM_NAMES.format(k=k, goals=", ".join(self.names))
        else:
            system = SYSTEM.format(aim=plain_aim(self.task.goal), k=k)
        return [{"role": "system", "content": system}, {"role": "user", "content": ASK.format(caption=caption)}]

    def ask(self, captions: list[str]) -> int:
        """Suggestions for ``captions`` in one batch of calls; cached (also when empty). How many landed."""
        llm = self.train.llm
        calls = [
            dict(
                messages=self.prompt(c),
                n=1,
                temperature=self.cfg.temperature,
                max_tokens=self.cfg.max_tokens,
                seed=0,
                tag=f"{NAME}/suggest",
            )
            for c in captions
        ]
        start = time.perf_counter()
        first = len(getattr(llm, "records", ()))
        replies: list[Any] = [None] * len(calls)
        error = ""
        try:
            many = getattr(llm, "chat_many", None)
            replies = (
                [r[0] for r in many(calls)]
                if many is not None and len(calls) > 1
                else [llm.chat(**c)[0] for c in calls]
            )
        except Exception as exc:  # an LLM failure costs its captions, never the training
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            # calls of the batch that did land are in the client's records: keep them
            landed = {
                rec.messages[-1]["content"]: rec.replies[0]
                for rec in list(getattr(llm, "records", ()))[first:]
                if rec.replies
            }
            replies = [landed.get(c["messages"][-1]["content"]) for c in calls]  # type: ignore[index]
        self.seconds += time.perf_counter() - start
        self.calls += len(calls)
        self.queries += len(calls)
        done, new_goals = 0, []
        for caption, reply in zip(captions, replies):
            if reply is None:
                self.failures += 1
                self.failed.add(caption)
                self.log.append(f"- {caption}\n  -> LLM error {error}")
                continue
            if self.cfg.match == "names":
                goals = parse_goal_names(reply.text, self.names, self.cfg.goals_per_state)
            else:
                goals = parse_suggestions(reply.text, self.cfg.goals_per_state)
            self.suggested[caption] = goals
            new_goals += goals
            done += 1
            self.log.append(
                f"- {caption}\n  -> {'; '.join(goals) or '(no goal in the reply ' + repr(reply.text[:80]) + ')'}"
            )
        if self.embeddings is not None and new_goals:
            self.embeddings.get(list(dict.fromkeys(new_goals)))  # now, so that steps seldom wait on an embedding
        return done

    def ask_blocking(
        self, starts: Counter[str], seen: Counter[str], calls: int, seconds: float, what: str
    ) -> dict[str, float]:
        """Ask unanswered captions, in batches, up to ``calls`` and ``seconds`` (0: no limit), with
        a progress bar: first those steps with an event started from (``starts``: where an answer
        can pay), most frequent first, then the most frequent of ``seen``. Returns its figures;
        ``covered`` is the share of ``starts``' steps whose caption now has goals."""
        order = [c for c, _ in starts.most_common()] + [c for c, _ in seen.most_common()]
        todo = [c for c in dict.fromkeys(order) if self.wanted(c)][:calls]
        start = time.perf_counter()
        asked, done = ask_in_batches(
            todo,
            self.ask,
            batch=self.cfg.batch,
            seconds=seconds,
            label=f"{NAME}: {what}",
            show=self.train.settings.run.progress,
        )
        basis = starts or seen
        covered = sum(n for c, n in basis.items() if self.goals_for(c) is not None) / max(1, sum(basis.values()))
        return {
            "captions": float(len(set(starts) | set(seen))),
            "calls": float(asked),
            "answered": float(done),
            "seconds": time.perf_counter() - start,
            "covered": covered,
        }

    def presuggest(self) -> None:
        """Before training: caption random rollouts; ask their most frequent captions; embed
        the anchors and the rollouts' events (so the first steps need not wait on them)."""
        cfg = self.cfg
        if cfg.presuggest_episodes == 0:
            return
        start = time.perf_counter()
        trajectories = self.task.reference_trajectories(cfg.presuggest_episodes, self.train.seed, cfg.presuggest_steps)
        seen: Counter[str] = Counter()
        starts: Counter[str] = Counter()
        events: set[str] = set()
        for t in trajectories:
            for o, n in zip(t.obs, t.next_obs):
                caption, did = self.task.caption(o), self.task.caption_transition(o, n)
                seen[caption] += 1
                if did:
                    starts[caption] += 1
                    events.update(did.split(", "))
        self.figures["rollout_s"] = time.perf_counter() - start
        if self.cfg.goals == "llm" and cfg.presuggest_calls:
            self.figures.update(
                self.ask_blocking(starts, seen, cfg.presuggest_calls, cfg.presuggest_s, "suggesting goals")
            )
        if self.embeddings is not None:
            self.embeddings.get(sorted(events) + (self.fixed if cfg.goals == "fixed" else []))

    def maybe_resuggest(self) -> None:
        """At each ``resuggest_at`` point: the agent's most frequent unanswered captions, blocking."""
        if not self.points or self.train.progress < self.points[0]:
            return
        point = self.points.pop(0)
        while self.points and self.train.progress >= self.points[0]:
            self.points.pop(0)  # points passed in one batch count once
        if self.cfg.goals == "llm" and self.cfg.resuggest_calls:
            figures = self.ask_blocking(
                self.starts,
                self.seen,
                self.cfg.resuggest_calls,
                self.cfg.resuggest_s,
                f"suggesting goals at {point:.0%}",
            )
            self.train.log_metric(f"{NAME}/resuggest_covered", figures["covered"])

    # -- rewards -------------------------------------------------------------------------------
    def step(self, batch: StepBatch) -> torch.Tensor | None:
        """The intrinsic reward of each env's step (``[B]``), as a term added to ``batch.reward``."""
        obs = batch.obs.detach().cpu().numpy()
        nxt = batch.next_obs.detach().cpu().numpy()
        done = batch.done.detach().cpu().numpy().reshape(-1)
        n = obs.shape[0]
        while len(self.achieved) < n:
            self.achieved.append(set())
        self.seen[self.task.caption(obs[self.steps // n % n])] += 1
        unlocked = newly_achieved(self.task, batch.obs, batch.next_obs) if self.cfg.match == "names" else None
        paid = np.zeros(n, np.float32)
        for i in range(n):
            text = self.task.caption_transition(obs[i], nxt[i])
            if text:
                self.events += 1
                paid[i] = self._pay(i, self.task.caption(obs[i]), text, unlocked)
            if done[i]:
                self.achieved[i].clear()  # after paying: the episode's last step is still in it
        self.steps += n
        term = torch.as_tensor(paid)
        if self.cfg.pretrain:
            return term - batch.reward.detach().float().reshape(-1).cpu()
        return term if paid.any() else None

    def _pay(self, env: int, caption: str, text: str, unlocked: torch.Tensor | None) -> float:
        self.starts[caption] += 1
        goals = self.goals_for(caption)
        if goals is None:
            self.unanswered += 1
            return 0.0
        goals = [g for g in goals if g not in self.achieved[env]]
        if not goals:
            return 0.0
        if unlocked is not None:  # names: the suggested achievements this step unlocked
            hits = [g for g in goals if bool(unlocked[env, self.names.index(g)])]
            value = 1.0
        else:
            events = text.split(", ")
            assert self.embeddings is not None
            g, e = self.embeddings.get(goals), self.embeddings.get(events)
            if g is None or e is None:
                return 0.0
            best = (g @ e.T).max(axis=1)  # each goal's best event
            hits = [goal for goal, s in zip(goals, best) if s >= self.cfg.threshold]
            value = float(best.max())
        if not hits:
            return 0.0
        self.achieved[env].update(hits)
        self.per_goal.update(f"{h} <- {text}" for h in hits)
        self.hits += 1
        reward = self.cfg.bonus * value
        self.reward += reward
        if self.cfg.goals == "llm":  # the LLM's suggestion made this step pay
            self.changed += 1
            self.from_suggestions += len(hits)
        return reward

    def metrics(self) -> dict[str, float]:
        steps = max(1, self.steps)
        emb = self.embeddings
        out = {
            f"{NAME}/goal_reward": self.reward,
            f"{NAME}/hits": float(self.hits),
            f"{NAME}/goals_achieved_from_suggestions": float(self.from_suggestions),
            f"{NAME}/distinct_goals_achieved": float(len({k.split(" <- ")[0] for k in self.per_goal})),
            f"{NAME}/bonus_share": self.hits / steps,
            f"{NAME}/events": float(self.events),
            f"{NAME}/unanswered_share": self.unanswered / max(1, self.events),
            f"{NAME}/captions": float(len(self.seen)),
            f"{NAME}/captions_answered": float(sum(1 for c in self.seen if self.goals_for(c) is not None)),
            f"{NAME}/suggestions": float(len({g for goals in self.suggested.values() for g in goals})),
            f"{NAME}/queries": float(self.queries),
            f"{NAME}/failures": float(self.failures),
            f"{NAME}/control": float(self.cfg.goals == "fixed"),
            f"{NAME}/embed_calls": float(emb.calls if emb else 0),
            f"{NAME}/embed_seconds": emb.seconds if emb else 0.0,
            f"{NAME}/embed_errors": float(emb.errors if emb else 0),
            "llm/changed_share": self.changed / steps,
            "llm/calls": float(self.calls),
            "llm/seconds": self.seconds,
        }
        out.update({f"{NAME}/presuggest_{k}": v for k, v in self.figures.items()})
        return out

    def report(self) -> str:
        achieved = "\n".join(f"- {k}: {v}" for k, v in self.per_goal.most_common(60)) or "- (none)"
        errors = "\n".join(self.embeddings.log) if self.embeddings else ""
        return (
            f"# ELLM goals ({self.queries} captions asked, {self.calls} LLM calls, {self.seconds:.0f} s)\n\n"
            + "\n".join(self.log[:300])
            + f"\n\n## Achieved (goal <- step caption: times)\n\n{achieved}\n"
            + (f"\n## Embedding errors\n\n{errors}\n" if errors else "")
        )


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """ELLM's intrinsic reward. The suggestion cache is the run's (on the object); each
    training's :class:`GoalReward` lives in ``train.state[NAME]``."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.suggested: dict[str, list[str]] = {}  # state caption -> suggested goals (ELLM's cache)

    @hookimpl
    def on_run_start(self, run: RunContext) -> None:
        """Refuse, before any training, a task whose steps cannot be captioned or whose goals are unknown."""
        if not goal_names(run.task) or type(run.task).caption_transition is Task.caption_transition:
            raise UserError(
                f"ellm needs a task that captions its steps (Task.caption_transition) and names its goals "
                f"(achievement_ fields), e.g. env=minecraft; {run.task.name!r} does not"
            )

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Make the training's goal reward; suggest goals for the rollouts' captions (blocking)."""
        goals = train.state[NAME] = GoalReward(train, self.cfg, self.suggested)
        goals.presuggest()

    @hookimpl
    def compute_reward(self, train: TrainContext, batch: StepBatch) -> torch.Tensor | None:
        """ELLM's intrinsic reward (with ``pretrain``: in place of the reward so far)."""
        goals = train.state.get(NAME)
        return goals.step(batch) if goals is not None else None

    @hookimpl
    def on_rollout(self, train: TrainContext, batch: Any) -> None:
        goals = train.state.get(NAME)
        if goals is None:
            return
        goals.maybe_resuggest()
        train.log_metric(f"{NAME}/goal_reward", goals.reward)
        train.log_metric(f"{NAME}/captions", float(len(goals.seen)))

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """The training's figures to the result, its suggestions and achieved goals to a text."""
        goals = train.state.pop(NAME, None)
        if goals is None:
            return
        result.metrics.update(goals.metrics())
        train.log_text(f"{NAME}/goals.md", goals.report())
