"""Reward vetting on reference trajectories (core.vetting) and the tasks' reference episodes."""

from __future__ import annotations

import numpy as np
import pytest

from core.envs import make_task
from core.records import RewardProgram
from core.sandbox import prepare_reward
from core.vetting import Verdict, reference_set, vet

ALIVE = """import torch

def compute_reward(state, action, next_state):
    return torch.ones_like(state["car_position"]), {}
"""

GOAL = """import torch

def compute_reward(state, action, next_state):
    reached = (next_state["car_position"] >= 0.5).float()
    return -1.0 + 100.0 * reached, {"reached": reached}
"""

HEIGHT = """def compute_reward(state, action, next_state):
    return next_state["car_position"]
"""

RAISES_LATER = """import torch

def compute_reward(state, action, next_state):
    if state["car_position"].shape[0] > 64:
        raise ValueError("too many rows")
    return torch.zeros_like(state["car_position"])
"""


@pytest.fixture(scope="module")
def mountaincar():
    task = make_task({"name": "mountaincar"})
    return task, reference_set(task, 4, seed=0)


def verdict_of(source: str, task, trajectories, **program) -> Verdict:
    program = RewardProgram(source=source, **program)
    fn = prepare_reward(program, task)
    try:
        return vet(fn, program, task, trajectories)
    finally:
        fn.close()


def test_reference_set_has_random_failures_and_controller_successes(mountaincar):
    task, trajectories = mountaincar
    random = [t for t in trajectories if t.source == "random"]
    controlled = [t for t in trajectories if t.source == "controller"]
    assert len(random) == len(controlled) == 4
    assert not any(t.success for t in random) and all(t.success and t.terminated for t in controlled)
    for t in trajectories:  # the reward program's state format: flat observations, one row per step
        assert t.obs.shape == t.next_obs.shape == (t.length, task.obs_dim) and len(t.env_reward) == t.length
        assert np.allclose(t.obs[1:], t.next_obs[:-1])
    assert all(t.next_obs[-1, 0] >= 0.5 for t in controlled)  # the true final state, not the reset one


def test_a_reward_paying_one_per_step_on_mountaincar_is_rejected_naming_both_problems(mountaincar):
    verdict = verdict_of(ALIVE, *mountaincar)
    assert not verdict.ok
    assert "ranks failure above success" in verdict.reason and "prolonging the episode" in verdict.reason
    assert verdict.figures["vetting/pair_accuracy"] == 0.0 and verdict.figures["vetting/step_reward"] == pytest.approx(
        1.0
    )
    assert verdict.figures["vetting/passed"] == 0.0
    assert "rejected" in verdict.text() and "vetting/pair_accuracy" in verdict.text()


def test_a_small_step_reward_beside_a_bonus_that_outweighs_it_passes(mountaincar):
    """Stalling for the 200-step limit earns 0.05 * 200 = 10; finishing earns about 0.05 * 120 + 100."""
    bonus = GOAL.replace("-1.0 + 100.0 * reached", "0.05 + 100.0 * reached")
    verdict = verdict_of(bonus, *mountaincar)
    assert verdict.ok, verdict.reason
    assert verdict.figures["vetting/step_reward"] == pytest.approx(0.05) and verdict.figures[
        "vetting/stall_return"
    ] == pytest.approx(10.0)


def test_a_positive_reward_near_the_goal_without_a_bonus_pays_for_stalling(mountaincar):
    """exp(-distance to the flag) is paid most just short of it: hovering there beats finishing."""
    near = (
        "import torch\n\ndef compute_reward(state, action, next_state):\n"
        "    return torch.exp(-torch.abs(0.5 - next_state['car_position']))\n"
    )
    verdict = verdict_of(near, *mountaincar)
    assert not verdict.ok and "prolonging the episode" in verdict.reason
    assert verdict.figures["vetting/stall_return"] >= verdict.figures["vetting/success_return"]


@pytest.mark.parametrize("source", [GOAL, HEIGHT], ids=["goal_bonus", "height"])
def test_a_reward_that_ranks_successes_above_failures_passes(mountaincar, source):
    verdict = verdict_of(source, *mountaincar)
    assert verdict.ok, verdict.reason
    assert verdict.reason == "" and verdict.figures["vetting/pair_accuracy"] == 1.0
    assert verdict.figures["vetting/success_return"] > verdict.figures["vetting/failure_return"]


def test_an_added_program_is_judged_with_the_env_reward_it_is_added_to(mountaincar):
    """mode=add: the env's -1 per step plus a small bonus is no longer a positive step reward."""
    bonus = ALIVE.replace("torch.ones_like", "0.5 * torch.ones_like")
    assert verdict_of(bonus, *mountaincar, mode="add").figures["vetting/step_reward"] == pytest.approx(-0.5)


def test_a_program_that_fails_on_the_reference_episodes_is_rejected_with_the_sandbox_report(mountaincar):
    verdict = verdict_of(RAISES_LATER, *mountaincar)
    assert not verdict.ok and "too many rows" in verdict.reason


def test_the_prolonging_check_applies_only_where_success_ends_the_episode():
    task = make_task({"name": "cartpole"})
    trajectories = reference_set(task, 3, seed=0)
    alive = (
        "import torch\n\ndef compute_reward(state, action, next_state):\n"
        "    return torch.ones_like(state['pole_angle'])\n"
    )
    verdict = verdict_of(alive, task, trajectories)
    assert verdict.ok and "vetting/step_reward" not in verdict.figures  # +1 per step is CartPole's own goal


def test_reference_episodes_are_cached_per_task_and_seed(tmp_path, monkeypatch):
    task = make_task({"name": "mountaincar"})
    first = reference_set(task, 2, seed=5, cache_dir=tmp_path)
    assert len(list((tmp_path / "reference").glob("mountaincar-*-s5-*.pkl"))) == 1
    monkeypatch.setattr(type(task), "reference_trajectories", lambda *a, **k: pytest.fail("not read from the cache"))
    again = reference_set(task, 2, seed=5, cache_dir=tmp_path)
    assert [t.length for t in again] == [t.length for t in first]
    assert np.array_equal(again[0].obs, first[0].obs)
    other = make_task({"name": "mountaincar", "max_episode_steps": 150})
    monkeypatch.undo()
    reference_set(other, 2, seed=5, cache_dir=tmp_path)  # another setting of the task: its own file
    assert len(list((tmp_path / "reference").glob("*.pkl"))) == 2


@pytest.mark.parametrize(
    "name", ["cartpole", "mountaincar", "mountaincar_continuous", "acrobot", "pendulum", "lunarlander"]
)
def test_each_classic_task_has_a_controller_that_succeeds(name):
    task = make_task({"name": name})
    trajectories = task.reference_trajectories(3, seed=1)
    controlled = [t for t in trajectories if t.source == "controller"]
    assert len(controlled) == 3 and all(t.success for t in controlled), [(t.length, t.ground_truth) for t in controlled]
    assert not all(t.success for t in trajectories if t.source == "random")


def test_tasks_whose_success_ends_the_episode_say_so():
    ends = {
        n: make_task({"name": n}).ends_on_success
        for n in ("cartpole", "mountaincar", "acrobot", "pendulum", "lunarlander")
    }
    assert ends == {"cartpole": False, "mountaincar": True, "acrobot": True, "pendulum": False, "lunarlander": True}


@pytest.mark.parametrize(
    "name",
    [
        "cartpole",
        "mountaincar",
        "mountaincar_continuous",
        "acrobot",
        "pendulum",
        "lunarlander",
        "halfcheetah",
        "hopper",
        "ant",
        "humanoid",
        "reach",
        "crafter",
    ],
)
def test_descriptions_state_goal_and_success_but_not_the_designers_reward(name):
    task = make_task({"name": name}, check=False)
    text = task.description
    assert "Reward:" not in text and "reward is" not in text.lower(), text
    for formula in (
        "-1 every step",
        "-1 each step",
        "+100",
        "sum(action^2)",
        "per step alive",
        "theta^2",
        "+-0.1 per health",
    ):
        assert formula not in text, (formula, text)
    assert task.goal
