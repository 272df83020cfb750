"""Kuka grasp task: state schema against real PyBullet states, episode facts, failure modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.envs import make_task
from core.envs.pybullet_grasp import FAILURE_MODES, TABLE_TOP_Z, KukaGrasp, classify_episode, summarize_failures
from core.records import Episode
from core.train.evaluate import evaluate

THRESHOLD = 0.2 - TABLE_TOP_Z

# facts of finished episodes: the first two were recorded from real episodes of the env
# (zero actions; random actions), the others are the facts each remaining mode implies
RECORDED = {
    "never_reached": {"success": False, "grasp_attempted": True, "final_block_height": 0.019, "rest_height": 0.019,
                      "max_block_height": 0.019, "min_xy_distance": 0.023, "grasp_xy_distance": 0.316},
    "timed_out": {"success": False, "grasp_attempted": False, "final_block_height": 0.019, "rest_height": 0.019,
                  "max_block_height": 0.019, "min_xy_distance": 0.12},
    "missed_grasp": {"success": False, "grasp_attempted": True, "final_block_height": 0.019, "rest_height": 0.019,
                     "max_block_height": 0.025, "min_xy_distance": 0.01, "grasp_xy_distance": 0.03},
    "slipped": {"success": False, "grasp_attempted": True, "final_block_height": 0.02, "rest_height": 0.019,
                "max_block_height": 0.15, "min_xy_distance": 0.0, "grasp_xy_distance": 0.01},
    "dropped": {"success": False, "grasp_attempted": True, "final_block_height": 0.02, "rest_height": 0.019,
                "max_block_height": THRESHOLD + 0.03, "min_xy_distance": 0.0, "grasp_xy_distance": 0.01},
    "success": {"success": True, "grasp_attempted": True, "final_block_height": THRESHOLD + 0.02, "rest_height": 0.019,
                "max_block_height": THRESHOLD + 0.03, "min_xy_distance": 0.0, "grasp_xy_distance": 0.005},
}


def test_schema_and_fields_match_the_simulation(schema_check):
    task = make_task({"name": "kuka_grasp"})
    assert isinstance(task, KukaGrasp) and task.obs_dim == 14 and task.fitness_name == "success_rate"
    schema_check(task, num_envs=2, steps=3)
    env = task.make_single(seed=0)
    try:
        obs, _ = env.reset(seed=0)
        for _ in range(5):
            obs, *_ = env.step(np.array([0.5, -0.5, 0.0], np.float32))
        parts = task.split_state(torch.as_tensor(obs)[None])
        c, inner = env.client, env.env
        block = np.asarray(c.getBasePositionAndOrientation(inner.blockUid)[0])
        gripper = np.asarray(c.getLinkState(inner._kuka.kukaUid, inner._kuka.kukaGripperIndex)[0])
        np.testing.assert_allclose(parts["block_pos"][0].numpy(), block, atol=1e-5)
        np.testing.assert_allclose(parts["gripper_pos"][0].numpy(), gripper, atol=1e-5)
        np.testing.assert_allclose(obs[:9], np.asarray(inner.getExtendedObservation(), np.float32), atol=1e-5)
        assert float(parts["block_height"][0]) == pytest.approx(block[2] - TABLE_TOP_Z, abs=1e-5)
        assert 0.25 < float(parts["gripper_opening"][0]) < 0.35  # open during the approach
    finally:
        env.close()


def test_copies_in_one_process_have_their_own_physics():
    task = KukaGrasp()
    a, b = task.make_single(seed=3), task.make_single(seed=3)
    try:
        oa, _ = a.reset(seed=3)
        ob, _ = b.reset(seed=3)
        np.testing.assert_array_equal(oa, ob)  # same seed, same block placement
        for _ in range(10):
            oa, *_ = a.step(np.array([1.0, 0.0, 0.0], np.float32))
        ob2, _ = b.reset(seed=3)  # stepping a must not have moved b's arm
        np.testing.assert_array_equal(ob, ob2)
        assert not np.allclose(oa[:3], ob2[:3])
        c, _ = a.reset(seed=4)
        assert not np.allclose(c[9:11], ob[9:11])  # another seed, another placement
    finally:
        a.close()
        b.close()


def test_a_real_episode_reports_its_facts_and_mode():
    task = KukaGrasp(max_episode_steps=1000)
    episodes = evaluate(task, lambda obs: torch.zeros(obs.shape[0], 3), episodes=1, seed=0)
    (episode,) = episodes
    assert episode.success is False and episode.info["grasp_attempted"] is True
    assert episode.info["failure_mode"] == classify_episode({**episode.info, "success": False})
    assert episode.info["failure_mode"] in FAILURE_MODES
    assert 0.0 < episode.info["rest_height"] < 0.05 and "grasp_xy_distance" in episode.info
    text = task.failure_modes(episodes)
    assert text.startswith("Outcome of 1 evaluation episodes") and "1/1" in text


def test_time_limit_gives_timed_out_episodes():
    task = KukaGrasp(max_episode_steps=5)
    episodes = evaluate(task, lambda obs: torch.zeros(obs.shape[0], 3), episodes=2, seed=1)
    assert [e.length for e in episodes] == [5, 5]
    assert all(e.info["failure_mode"] == "timed_out" and e.success is False for e in episodes)
    fit = task.fitness(episodes)
    assert fit.value == 0.0 and fit.details["mode_timed_out"] == 1.0
    assert "2/2 timed out" in task.failure_modes(episodes)


@pytest.mark.parametrize("mode", list(RECORDED))
def test_classifier_names_each_mode(mode):
    assert classify_episode(RECORDED[mode]) == mode


def test_summary_counts_modes_and_explains_them():
    infos = [RECORDED["never_reached"]] * 3 + [RECORDED["dropped"], RECORDED["success"]]
    text = summarize_failures(infos)
    assert "3/5 never reached the block" in text
    assert "1/5 dropped after lift" in text and "1/5 success" in text
    assert "slipped" not in text
    assert "x-y distance when the gripper closed: mean" in text
    assert summarize_failures([]) == ""


def test_failure_modes_go_through_episode_info():
    task = KukaGrasp()
    episodes = []
    for mode, facts in RECORDED.items():
        success, info = task.episode_info({**facts, "irrelevant": 1})
        assert info["failure_mode"] == mode and "irrelevant" not in info
        episodes.append(Episode(0.0, 10, success, info))
    text = task.failure_modes(episodes)
    for mode in RECORDED:
        assert FAILURE_MODES[mode] in text
    assert task.fitness(episodes).value == pytest.approx(1 / len(RECORDED))
