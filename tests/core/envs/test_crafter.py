"""Crafter (env=minecraft): symbolic state against the game's internals, score, params."""

from __future__ import annotations

import math

import crafter
import gymnasium as gym
import numpy as np
import pytest

from core.envs import make_task
from core.envs.crafter import (
    ACHIEVEMENTS,
    ACTIONS,
    ITEMS,
    MATERIALS,
    OBJECTS,
    VIEW,
    VIEW_IDS,
    VITALS,
    CrafterEnv,
    WorldParams,
    crafter_score,
    generate_terrain,
)
from core.errors import UserError
from core.records import Episode


@pytest.fixture(scope="module")
def task():
    return make_task({"name": "minecraft"})


def test_vocabulary_matches_the_installed_crafter():
    assert ACTIONS == tuple(crafter.constants.actions)
    assert ACHIEVEMENTS == tuple(crafter.constants.achievements)
    assert VITALS + ITEMS == tuple(crafter.constants.items)
    assert MATERIALS == tuple(crafter.constants.materials)
    assert len(ACHIEVEMENTS) == 22 and len(ACTIONS) == 17


def test_schema_matches_real_observations(task, schema_check):
    schema_check(task, num_envs=2, steps=5)
    assert task.obs_dim == 107
    assert "17" in task.action_description and all(a in task.action_description for a in ACTIONS)


def test_observation_is_the_games_state():
    env = CrafterEnv(seed=4)
    env.reset(seed=4)
    rng = np.random.default_rng(0)
    for _ in range(60):
        obs, *_ = env.step(int(rng.integers(17)))
    game = env._game
    player, world = game._player, game._world
    fields = {f.name: obs[f.start : f.stop] for f in make_task({"name": "minecraft"}).state_fields}
    for name in VITALS + ITEMS:
        assert fields[name][0] == player.inventory[name]
    for name in ACHIEVEMENTS:
        assert fields[f"achievement_{name}"][0] == float(player.achievements[name] > 0)
    assert tuple(fields["position"]) == tuple(player.pos)
    assert tuple(fields["facing"]) == tuple(player.facing)
    assert fields["daylight"][0] == pytest.approx(world.daylight)
    # the local view is crafter's own semantic map, cropped around the player
    full = crafter.engine.SemanticView(world, [getattr(crafter.objects, n.capitalize()) for n in OBJECTS])()
    view = fields["local_view"].reshape(VIEW)
    x0, y0 = player.pos[0] - VIEW[0] // 2, player.pos[1] - VIEW[1] // 2
    for i in range(VIEW[0]):
        for j in range(VIEW[1]):
            x, y = x0 + i, y0 + j
            expected = full[x, y] if 0 <= x < 64 and 0 <= y < 64 else 0
            assert view[i, j] == expected
    assert view[VIEW[0] // 2, VIEW[1] // 2] == VIEW_IDS["player"]


def test_crafter_score_matches_a_hand_computation():
    rates = np.zeros(22)
    rates[:3] = [100.0, 50.0, 10.0]
    by_hand = math.exp((math.log(101) + math.log(51) + math.log(11)) / 22) - 1
    assert crafter_score(rates) == pytest.approx(by_hand)
    assert crafter_score(np.zeros(22)) == 0.0 and crafter_score(np.full(22, 100.0)) == pytest.approx(100.0)


def test_fitness_from_episodes(task):
    def ep(*names):
        return Episode(float(len(names)), 100, info={"achievements": {a: a in names for a in ACHIEVEMENTS}})

    episodes = [ep("collect_wood", "collect_sapling"), ep("collect_wood"), ep(), ep("collect_wood", "wake_up")]
    fit = task.fitness(episodes)
    assert fit.name == "crafter_score"
    assert fit.details["success_collect_wood"] == 75.0
    assert fit.details["success_collect_sapling"] == 25.0 and fit.details["success_wake_up"] == 25.0
    assert fit.details["success_collect_diamond"] == 0.0
    by_hand = math.exp((math.log(76) + 2 * math.log(26)) / 22) - 1
    assert fit.value == pytest.approx(by_hand)


def test_vector_env_reports_achievements_at_episode_end(task):
    small = make_task({"name": "minecraft", "max_episode_steps": 20})
    env = small.make_env(2, seed=1, params={"start_wood": 5})
    env.reset(seed=1)
    # face a grass cell, place a table from the starting wood: one achievement
    for _ in range(19):
        _, _, _, truncated, info = env.step(np.array([ACTIONS.index("place_table")] * 2))
    assert not truncated.any()
    _, _, _, truncated, info = env.step(np.array([0, 0]))
    assert truncated.all() and info["_final_info"].all()
    flag = small.state_fields[[f.name for f in small.state_fields].index("achievement_place_table")].start
    placed = []
    for i in range(2):
        final = {k: v[i] for k, v in info["final_info"].items() if not k.startswith("_")}
        success, extra = small.episode_info(final)
        assert success is None and set(extra["achievements"]) == set(ACHIEVEMENTS)
        # the episode info agrees with the achievement flags of the final observation
        assert extra["achievements"]["place_table"] == bool(info["final_obs"][i][flag])
        placed.append(extra["achievements"]["place_table"])
    assert any(placed)  # the start area is grass, so the table could be placed


def test_render_state_is_a_compact_summary(task):
    env = task.make_env(1, seed=0, params={"start_wood": 3, "start_wood_pickaxe": 1})
    obs, _ = env.reset(seed=0)
    text = task.render_state(obs[0])
    assert "health 9/9" in text and "wood 3" in text and "wood_pickaxe 1" in text
    assert "Achievements (0/22)" in text and "facing" in text and len(text) < 800


def test_starting_inventory_and_param_validation():
    params = WorldParams.from_dict(
        {"start_stone_pickaxe": 2, "start_coal": 12, "biome": "mountain", "diamond_rarity": "common"}
    )
    assert dict(params.inventory) == {"stone_pickaxe": 2, "coal": 9} and params.biome == "mountain"
    with pytest.raises(UserError, match="not one of"):
        WorldParams.from_dict({"biome": "ocean"})
    with pytest.raises(UserError, match="Unknown Crafter params"):
        WorldParams.from_dict({"lava_everywhere": True})


def _counts(params: WorldParams, seeds: range) -> dict[str, float]:
    totals = np.zeros(len(MATERIALS))
    for seed in seeds:
        materials, _ = generate_terrain(np.random.RandomState(seed), (32, 32), params)
        totals += np.bincount(materials.ravel(), minlength=len(MATERIALS))
    return dict(zip(MATERIALS, totals / len(seeds)))


def test_world_params_change_the_generated_worlds():
    seeds = range(6)
    natural = _counts(WorldParams(), seeds)
    assert natural["grass"] > 0 and natural["stone"] > 0 and natural["tree"] > 0 and natural["water"] > 0
    assert _counts(WorldParams(tree_rarity="common"), seeds)["tree"] > 1.8 * natural["tree"]
    assert _counts(WorldParams(coal_rarity="rare"), seeds)["coal"] < 0.6 * natural["coal"]
    assert _counts(WorldParams(iron_rarity="common"), seeds)["iron"] > 1.8 * natural["iron"]
    assert _counts(WorldParams(diamond_rarity="common"), seeds)["diamond"] > 1.5 * max(natural["diamond"], 1)
    assert _counts(WorldParams(biome="mountain"), seeds)["stone"] > 1.3 * natural["stone"]
    grass = _counts(WorldParams(biome="grassland"), seeds)
    assert grass["grass"] + grass["tree"] > 1.3 * (natural["grass"] + natural["tree"])
    assert _counts(WorldParams(biome="beach"), seeds)["water"] > 1.3 * natural["water"]


def test_start_area_is_safe_grass(task):
    env = CrafterEnv(seed=0)
    for seed in range(5):
        env.reset(seed=seed)
        world, pos = env._game._world, env._game._player.pos
        assert world[pos][0] == "grass"
        assert not any(
            type(o).__name__ in ("Zombie", "Skeleton") and env._game._player.distance(o) < 6 for o in world.objects
        )


def test_per_env_params_for_a_training_mix(task):
    env = task.make_env(2, seed=0, params=[{"start_iron": 4}, {}])
    obs, _ = env.reset(seed=0)
    iron = task.state_fields[[f.name for f in task.state_fields].index("iron")].start
    assert obs[0, iron] == 4 and obs[1, iron] == 0
    with pytest.raises(UserError, match="per-env"):
        task.make_env(3, seed=0, params=[{}, {}])


def test_same_seed_same_worlds(task):
    a, b = task.make_env(2, seed=7), task.make_env(2, seed=7)
    oa, ob = a.reset(seed=7)[0], b.reset(seed=7)[0]
    np.testing.assert_array_equal(oa, ob)
    actions = np.array([1, 5])
    np.testing.assert_array_equal(a.step(actions)[0], b.step(actions)[0])


def test_pixels_are_optional(task):
    pix = make_task({"name": "minecraft", "pixels": True})
    env = pix.make_env(1, seed=0)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (1, 107 + 64 * 64 * 3) and pix.state_fields[-1].name == "pixels"
    assert 0.0 <= obs[0, 107:].min() and obs[0, 107:].max() <= 1.0 and obs[0, 107:].std() > 0.01
    assert task.params and {p.name for p in task.params} >= {
        "biome",
        "tree_rarity",
        "coal_rarity",
        "iron_rarity",
        "diamond_rarity",
        "start_wood",
    }


def test_same_seed_and_actions_same_trajectory(task):
    # Crafter's chunks are sets ordered by memory address; ours are ordered, so creature
    # despawns (and everything after them) repeat exactly for a seed
    actions = np.random.default_rng(0).integers(0, 17, size=(300, 2))
    traces = []
    for _ in range(2):
        env = task.make_env(2, seed=7)
        obs, _ = env.reset(seed=7)
        trace = [obs.copy()]
        for a in actions:
            obs, *_ = env.step(a)
            trace.append(obs.copy())
        env.close()
        traces.append(np.array(trace))
    np.testing.assert_array_equal(traces[0], traces[1])


def _reference_obs(game) -> np.ndarray:
    """The observation built from the game's state by hand (crafter's semantic map for the view)."""
    player, world = game._player, game._world
    full = crafter.engine.SemanticView(world, [getattr(crafter.objects, n.capitalize()) for n in OBJECTS])()
    view = np.zeros(VIEW, np.float32)
    x0, y0 = player.pos[0] - VIEW[0] // 2, player.pos[1] - VIEW[1] // 2
    for i in range(VIEW[0]):
        for j in range(VIEW[1]):
            if 0 <= x0 + i < 64 and 0 <= y0 + j < 64:
                view[i, j] = full[x0 + i, y0 + j]
    return np.concatenate(
        [
            [player.inventory[n] for n in VITALS + ITEMS],
            [player.achievements[n] > 0 for n in ACHIEVEMENTS],
            player.pos,
            player.facing,
            [world.daylight, player.sleeping],
            view.ravel(),
        ]
    ).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 5])
def test_steps_follow_crafters_own_step(seed):
    # ours (one array operation finds the creatures to update, no image or info dict) against
    # a twin game stepped by crafter.Env.step: same rewards, ends and observations every step
    ours, twin = CrafterEnv(seed=seed, max_episode_steps=150), CrafterEnv(seed=seed, max_episode_steps=150)
    obs, _ = ours.reset(seed=seed)
    twin.reset(seed=seed)
    np.testing.assert_array_equal(obs, _reference_obs(twin._game))
    actions = np.random.default_rng(seed).integers(0, len(ACTIONS), size=500)
    ends, rewarded = 0, 0
    for t, action in enumerate(actions):
        obs, reward, terminated, truncated, info = ours.step(int(action))
        _, twin_reward, twin_done, _ = type(twin._game).step(twin._game, int(action))
        assert reward == twin_reward and terminated == (twin._game._player.health <= 0), t
        assert terminated or truncated == twin_done, t
        np.testing.assert_array_equal(obs, _reference_obs(twin._game), err_msg=f"step {t}")
        rewarded += reward != 0
        if terminated or truncated:
            ends += 1
            assert set(info) == {f"achievement_{a}" for a in ACHIEVEMENTS}
            ours.reset()
            twin.reset()
    assert ends >= 3 and rewarded >= 5  # episode ends and health/achievement rewards were crossed


class _Wrapped(gym.Wrapper):
    """A game behind a wrapper: the vector env then takes the gymnasium API (as with macro-actions)."""


def test_vector_env_batches_what_the_games_return(task):
    small = make_task({"name": "minecraft", "max_episode_steps": 40})
    fast, plain = small.make_env(3, seed=2), small.make_env(3, seed=2)
    plain.envs = [_Wrapped(e) for e in plain.envs]
    np.testing.assert_array_equal(fast.reset(seed=2)[0], plain.reset(seed=2)[0])
    finals = 0
    for actions in np.random.default_rng(1).integers(0, len(ACTIONS), size=(130, 3)):
        a, b = fast.step(actions), plain.step(actions)
        for x, y in zip(a[:4], b[:4]):
            np.testing.assert_array_equal(x, y)
        assert a[4].keys() == b[4].keys()
        if "final_obs" in a[4]:
            for i in np.flatnonzero(a[4]["_final_obs"]):
                finals += 1
                np.testing.assert_array_equal(a[4]["final_obs"][i], b[4]["final_obs"][i])
                info_a, info_b = a[4]["final_info"], b[4]["final_info"]
                assert {k: v[i] for k, v in info_a.items()} == {k: v[i] for k, v in info_b.items()}
    assert finals >= 9


def test_caption_names_what_is_near_what_is_held_and_low_vitals_and_repeats(task):
    env = task.make_env(num_envs=1, seed=0)
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    captions = []
    for _ in range(300):
        obs, *_ = env.step(rng.integers(0, len(ACTIONS), size=1))
        captions.append(task.caption(np.asarray(obs)[0]))
    first = captions[0]
    assert first.startswith("You see: ") and "You have: " in first
    assert len(set(captions)) < len(captions) / 3  # coarse: captions recur
    state = np.zeros(task.obs_dim, np.float32)
    fields = {f.name: f for f in task.state_fields}
    state[fields["wood"].start] = 2
    state[fields["food"].start] = 1
    for name in ("health", "drink", "energy"):
        state[fields[name].start] = 9
    assert task.caption(state) == "You see: only grass. You have: wood. Low: food."


def test_default_caption_rounds_each_field_to_one_decimal():
    cartpole = make_task({"name": "cartpole"})
    caption = cartpole.caption(np.array([0.04, -0.26, 0.013, 1.249], np.float32))
    assert "0.0" in caption and "-0.3" in caption and "1.2" in caption
    assert cartpole.caption(np.array([0.04, -0.26, 0.013, 1.249])) == cartpole.caption(
        np.array([0.01, -0.31, 0.0, 1.2])
    )
