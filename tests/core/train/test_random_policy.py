"""The random policy as a trainer: uniform actions from the task's own action space, nothing trained."""

from __future__ import annotations

from core.envs import make_task
from core.records import Candidate
from core.train import get_trainer
from core.train.random_policy import RandomConfig, train


def test_the_random_policy_scores_what_uniform_actions_score_and_trains_no_frame():
    task = make_task({"name": "cartpole"})
    result = train(task, Candidate(id="r", iteration=0), RandomConfig(frames=1000, eval_episodes=30), seed=0)
    assert result.ok, result.error
    assert result.frames == 0 and len(result.episodes) == 30
    # a uniformly random CartPole policy lasts about 22 steps; a fixed action about 9
    assert 12 < result.fitness.value < 40, result.fitness
    again = train(task, Candidate(id="r", iteration=0), RandomConfig(frames=1000, eval_episodes=30), seed=0)
    assert again.fitness.value == result.fitness.value  # seeded


def test_continuous_actions_are_drawn_inside_the_tasks_bounds():
    task = make_task({"name": "pendulum"})
    result = train(task, Candidate(id="r", iteration=0), RandomConfig(frames=1000, eval_episodes=4), seed=1)
    assert result.ok, result.error
    assert result.fitness.value < -600  # random torques never swing the pole up and hold it


def test_it_is_a_trainer_of_its_own_name_and_refuses_an_unknown_setting():
    _, cls = get_trainer("random")
    assert cls is RandomConfig
    try:
        cls.from_config({"frames": 10, "lr": 0.1})
    except ValueError as err:
        assert "lr" in str(err)
    else:
        raise AssertionError("an unknown setting was accepted")
