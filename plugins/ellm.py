"""ellm: the LLM suggests goals from a caption of the state; achieving one pays a reward (ELLM, ICML 2023).

Method (Du et al., "Guiding Pretraining in Reinforcement Learning with Large Language
Models"): at each state the agent's observation is captioned in text (what it sees, what
it holds, how it is doing); an LLM, asked what a player should do next, suggests a few
goals; a transition whose caption matches a suggested goal earns an intrinsic reward.
Suggestions are cached per unique caption, so the LLM is asked once per kind of state.

Here, on Crafter (``env=minecraft``):

- Captions (:func:`caption`) are coarse on purpose, so that they repeat: the kinds of
  things near the player (resources, stations, creatures within ``view_radius`` cells),
  the items held (without counts) and the vitals running low.
- Queries never block a step: ``compute_reward`` pays for the captions already answered
  and notes the others; after each collected batch (``on_rollout``) the most frequent
  unanswered captions, at most ``queries_per_rollout`` of them, go to the LLM together
  (``chat_many``).
- A suggestion counts when it names one of the task's checkable goals (Crafter's
  achievements, :func:`core.plan.match_goal`); other names are dropped, counted, and
  listed in the next prompts as goals the game cannot check.
- A transition earns ``bonus`` when it achieves (the achievement's flag turns on) a goal
  suggested for its starting state; the term is added to the reward (the env's own, or
  a reward program's: ``+plugins=[eureka,ellm]``).

Config: ``conf/plugins/ellm.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core import PluginConfig, hookimpl
from core.errors import UserError
from core.plan import goal_names, match_goal, newly_achieved
from core.records import TrainResult

NAME = "ellm"


@dataclass
class Config(PluginConfig):
    """``plugins.ellm``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 1  # outer rounds (ELLM has no outer loop: one training)
    goals_per_state: int = 3  # most goals kept from one suggestion
    bonus: float = 1.0  # reward when a transition achieves a goal suggested for its state
    queries_per_rollout: int = 4  # most new captions sent to the LLM after each collected batch
    low_vital: int = 3  # a vital (food, drink, energy, health) at or below this is named in the caption
    view_radius: int = 2  # the caption names what is within this many cells of the player (x and y; 4 = the whole 9x7 view)
    temperature: float = 0.0  # sampling temperature of the suggestions (0: one answer per caption)
    max_tokens: int = 60  # cap on each reply
    final_seeds: int = 0  # retrain the best candidate on this many more seeds after the loop

    def check(self) -> None:
        super().check()
        if self.view_radius < 1:
            raise ValueError(f"view_radius must be >= 1, got {self.view_radius}")
        for name in ("goals_per_state", "queries_per_rollout", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You advise a player of Crafter, a 2D Minecraft-like survival game. Given what the
player sees and has, suggest the {k} most useful goals to do next. Choose only from this
list, one goal name per line, nothing else: {goals}."""

ASK = """{caption}
{unknown}Which goals should the player do next?"""

UNKNOWN = "(The game cannot check these, never suggest them: {names}.)\n"


# -- captions ------------------------------------------------------------------------------

#: what a caption names in view (grass, sand and path are the background)
SEEN = ("water", "stone", "tree", "lava", "coal", "iron", "diamond", "table", "furnace", "cow", "zombie", "skeleton", "plant")


def caption_keys(task: Any, obs: torch.Tensor, low_vital: int, radius: int = 4) -> np.ndarray:
    """``[B, K]`` bool: for each observation, what its caption says (things within ``radius``
    cells of the player, items held, low vitals)."""
    from core.envs.crafter import ITEMS, VIEW, VIEW_IDS, VITALS

    state = task.split_state(torch.as_tensor(obs)[..., : task.obs_dim])
    cx, cy = VIEW[0] // 2, VIEW[1] // 2
    view = state["local_view"].reshape(obs.shape[0], *VIEW)
    view = view[:, max(0, cx - radius): cx + radius + 1, max(0, cy - radius): cy + radius + 1].reshape(obs.shape[0], -1)
    seen = torch.stack([(view == VIEW_IDS[k]).any(-1) for k in SEEN], -1)
    held = torch.stack([state[i].reshape(-1) > 0 for i in ITEMS], -1)
    low = torch.stack([state[v].reshape(-1) <= low_vital for v in VITALS], -1)
    return torch.cat([seen, held, low], -1).numpy()


def caption(key: np.ndarray) -> str:
    """The text of a caption key (:func:`caption_keys`)."""
    from core.envs.crafter import ITEMS, VITALS

    seen = [k for k, on in zip(SEEN, key[: len(SEEN)]) if on]
    held = [i.replace("_", " ") for i, on in zip(ITEMS, key[len(SEEN): len(SEEN) + len(ITEMS)]) if on]
    low = [v for v, on in zip(VITALS, key[len(SEEN) + len(ITEMS):]) if on]
    parts = [f"You see: {', '.join(seen) or 'only grass'}.", f"You have: {', '.join(held) or 'nothing'}."]
    if low:
        parts.append(f"Low: {', '.join(low)}.")
    return " ".join(parts)


def parse_goals(reply: str, goals: list[str], k: int) -> tuple[list[str], list[str]]:
    """(the checkable goals a reply names, at most ``k``, in order; the names it gave that are not goals)."""
    found: list[str] = []
    unknown: list[str] = []
    for line in re.split(r"[\n,;]+", reply or ""):
        item = re.sub(r"^\s*(?:[-*]|\d+[.)])\s*", "", line).strip().strip("`'\".")
        if not item:
            continue
        goal = match_goal(item, goals)
        if goal is None:  # a goal named inside a sentence
            goal = next((g for g in goals if re.search(rf"\b{g.replace('_', '[ _]')}\b", item.lower())), None)
        if goal is None:
            if len(item.split()) <= 4:  # a name, not a sentence
                unknown.append(item[:40])
        elif goal not in found:
            found.append(goal)
    return found[:k], unknown


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """One ELLM run: the suggestions per caption (shared by its trainings) and the rejected names."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.suggested: dict[bytes, list[str]] = {}  # caption key -> suggested goals (ELLM's cache)
        self.unknown: Counter[str] = Counter()  # suggested names the task cannot check

    @hookimpl
    def on_run_start(self, run) -> None:
        names = {f.name for f in run.task.state_fields}
        if not goal_names(run.task) or "local_view" not in names:
            raise UserError(f"ellm needs a task whose goals it can check and caption (env=minecraft); "
                            f"{run.task.name!r} has no achievement fields or local view")

    def _state(self, train) -> dict[str, Any]:
        st = train.state.get(NAME)
        if st is None:
            goals = goal_names(train.task)
            st = train.state[NAME] = {"goals": goals, "pending": Counter(), "keys": {}, "reward": 0.0, "hits": 0,
                                      "per_goal": Counter(), "queries": 0, "rejected": 0}
        return st

    @hookimpl
    def on_train_start(self, train) -> None:
        self._state(train)

    @hookimpl
    def compute_reward(self, train, batch) -> torch.Tensor | None:
        st = self._state(train)
        goals = st["goals"]
        keys = caption_keys(train.task, batch.obs, self.cfg.low_vital, self.cfg.view_radius)
        allowed = torch.zeros(len(keys), len(goals), dtype=torch.bool)
        for row, key in enumerate(keys):
            raw = np.packbits(key).tobytes()
            got = self.suggested.get(raw)
            if got is None:
                st["pending"][raw] += 1
                st["keys"].setdefault(raw, key)
                continue
            for g in got:
                allowed[row, goals.index(g)] = True
        hit = (newly_achieved(train.task, batch.obs, batch.next_obs) & allowed)
        if not hit.any():
            return None
        for row, col in hit.nonzero().tolist():
            st["per_goal"][goals[col]] += 1
        rows = hit.any(-1)
        st["hits"] += int(rows.sum())
        st["reward"] += float(rows.sum()) * self.cfg.bonus
        return rows.float() * self.cfg.bonus

    @hookimpl
    def on_rollout(self, train, batch: Any) -> None:
        st = self._state(train)
        cfg = self.cfg
        todo = [raw for raw, _ in st["pending"].most_common() if raw not in self.suggested][: cfg.queries_per_rollout]
        st["pending"].clear()
        if todo:
            self._ask(train, st, todo)
        train.log_metric(f"{NAME}/goal_reward", st["reward"])
        train.log_metric(f"{NAME}/captions", len(self.suggested))

    def _ask(self, train, st: dict[str, Any], todo: list[bytes]) -> None:
        cfg, goals = self.cfg, st["goals"]
        system = SYSTEM.format(k=cfg.goals_per_state, goals=", ".join(goals))
        unknown = UNKNOWN.format(names=", ".join(n for n, _ in self.unknown.most_common(6))) if self.unknown else ""
        calls = [{"messages": [{"role": "system", "content": system},
                               {"role": "user", "content": ASK.format(caption=caption(st["keys"][raw]), unknown=unknown)}],
                  "n": 1, "temperature": cfg.temperature, "max_tokens": cfg.max_tokens, "seed": 0, "tag": f"{NAME}-goals"}
                 for raw in todo]
        llm = train.llm
        try:
            many = getattr(llm, "chat_many", None)
            replies = many(calls) if many is not None else [llm.chat(**c) for c in calls]
        except Exception as e:  # an LLM failure skips this batch's captions; training goes on
            train.log_text(f"{NAME}-errors.txt", f"frames {train.frames}: {type(e).__name__}: {e}\n")
            return
        st["queries"] += len(calls)
        lines = []
        for raw, (reply,) in zip(todo, replies):
            found, bad = parse_goals(reply.text, goals, cfg.goals_per_state)
            self.suggested[raw] = found
            self.unknown.update(bad)
            st["rejected"] += len(bad)
            lines.append(f"- {caption(st['keys'][raw])} -> {', '.join(found) or '(none usable)'}"
                         + (f"; not goals: {', '.join(bad)}" if bad else ""))
        train.log_text(f"{NAME}-suggestions.md", "\n".join(lines) + "\n")

    @hookimpl
    def on_train_end(self, train, result: TrainResult) -> None:
        st = train.state.pop(NAME, None)
        if st is None:
            return
        result.metrics.update({f"{NAME}/goal_reward": st["reward"], f"{NAME}/hits": float(st["hits"]),
                               f"{NAME}/queries": float(st["queries"]), f"{NAME}/captions": float(len(self.suggested)),
                               f"{NAME}/rejected": float(st["rejected"])})
        for goal, count in st["per_goal"].items():
            result.metrics[f"{NAME}/achieved_{goal}"] = float(count)
