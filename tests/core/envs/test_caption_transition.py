"""Task.caption_transition: what one step did, in the game's words ("" when nothing happened)."""

from __future__ import annotations

import numpy as np
import pytest

from core.envs import make_task
from core.envs.crafter import ACTIONS, ITEMS, VIEW_IDS

pytest.importorskip("crafter")


@pytest.fixture(scope="module")
def task():
    return make_task({"name": "minecraft", "max_episode_steps": 200})


FACED = 5 * 7 + 3  # the view cell right of the player ([dx + 4, dy + 3] flattened), faced when facing (1, 0)


def state(task, *, faced="grass", food=5, drink=5, sleeping=0, done=(), **items):
    at = {f.name: f.start for f in task.state_fields}
    obs = np.zeros(task.obs_dim, np.float32)
    obs[at["health"]], obs[at["food"]], obs[at["drink"]], obs[at["energy"]] = 9, food, drink, 5
    obs[at["position"] : at["position"] + 2] = (32, 32)
    obs[at["facing"] : at["facing"] + 2] = (1, 0)
    obs[at["sleeping"]] = sleeping
    obs[at["local_view"] : at["local_view"] + 63] = VIEW_IDS["grass"]
    obs[at["local_view"] + FACED] = VIEW_IDS[faced]
    for item, n in items.items():
        obs[at[item]] = n
    for g in done:
        obs[at[f"achievement_{g}"]] = 1
    return obs


@pytest.mark.parametrize(
    "before,after,caption",
    [
        (dict(faced="tree"), dict(faced="tree", wood=1, done=["collect_wood"]), "collect wood"),
        (
            dict(faced="tree", wood=1, done=["collect_wood"]),
            dict(faced="tree", wood=2, done=["collect_wood"]),
            "collect wood",
        ),
        (
            dict(faced="table", wood=2),
            dict(faced="table", wood_pickaxe=1, done=["make_wood_pickaxe"]),
            "make wood pickaxe",
        ),
        (dict(wood=3), dict(faced="table", done=["place_table"]), "place table"),
        (dict(faced="cow", food=2), dict(faced="cow", food=8, done=["eat_cow"]), "eat cow"),
        (dict(faced="plant", food=2), dict(faced="plant", food=6), "eat plant"),
        (dict(faced="water", drink=3), dict(faced="water", drink=4), "drink water"),
        (dict(), dict(sleeping=1), "sleep"),
        (dict(sleeping=1), dict(done=["wake_up"]), "wake up"),
        (dict(faced="zombie"), dict(done=["defeat_zombie"]), "defeat zombie"),
        (dict(faced="stone", stone=1), dict(faced="path", stone=2, wood=1), "collect wood, collect stone"),
        (dict(food=5, drink=5), dict(food=4, drink=4), ""),  # vitals running down is not an event
        (dict(faced="tree"), dict(faced="cow"), ""),  # a view that changed is not an event
    ],
)
def test_crafter_captions_each_event_of_a_step(task, before, after, caption):
    assert task.caption_transition(state(task, **before), state(task, **after)) == caption


def test_a_placed_thing_counts_only_when_its_material_was_used_up(task):
    assert task.caption_transition(state(task, stone=2), state(task, faced="stone", stone=1)) == "place stone"
    assert (
        task.caption_transition(state(task, stone=2), state(task, faced="stone", stone=2)) == ""
    )  # walked up to a rock


def test_real_steps_are_captioned_from_what_the_observations_show(task):
    env = task.make_env(4, seed=0)
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    at = {f.name: f.start for f in task.state_fields}
    captions, nothing = [], 0
    for _ in range(400):
        nxt, *_, info = env.step(rng.integers(0, len(ACTIONS), size=4))
        for i in range(4):
            last = info["final_obs"][i] if "final_obs" in info and info.get("_final_obs", [False] * 4)[i] else nxt[i]
            text = task.caption_transition(obs[i], last)
            gained = [item for item in ITEMS if last[at[item]] > obs[i][at[item]]]
            for item in gained:  # every item gained is in the caption
                assert item.replace("_", " ") in text, (text, gained)
            if text:
                captions.append(text)
            else:
                nothing += 1
        obs = nxt
    assert captions and nothing > 10 * len(captions)  # most steps do nothing worth saying
    assert {"sleep", "collect sapling"} & {e for c in captions for e in c.split(", ")}


def test_the_default_task_says_nothing():
    cartpole = make_task({"name": "cartpole"})
    assert cartpole.caption_transition(np.zeros(4, np.float32), np.ones(4, np.float32)) == ""
