"""core.plan: checkable goals, plan checks, and the plan follower on Crafter observations."""

from __future__ import annotations

import pytest
import torch

from core.envs import make_task
from core.plan import PlanFollower, achieved, check_plan, goal_names, match_goal, newly_achieved
from core.records import Candidate, Plan, PlanStep


@pytest.fixture(scope="module")
def task():
    return make_task({"name": "minecraft", "max_episode_steps": 60, "pixels": False})


def _obs(task, *goals: str) -> torch.Tensor:
    obs = torch.zeros(task.obs_dim)
    for f in task.state_fields:
        if f.name in {f"achievement_{g}" for g in goals}:
            obs[f.start] = 1.0
    return obs


def test_goals_are_the_achievement_fields(task):
    goals = goal_names(task)
    assert len(goals) == 22 and "collect_wood" in goals and "make_wood_pickaxe" in goals
    assert goal_names(make_task({"name": "cartpole"})) == []
    obs = torch.stack([_obs(task), _obs(task, "collect_wood")])
    got = achieved(task, obs)
    assert got.shape == (2, 22) and got[1, goals.index("collect_wood")] and not got[0].any()
    new = newly_achieved(task, obs[:1], obs[1:])
    assert new.sum() == 1


def test_match_goal_reads_free_text():
    goals = ["collect_wood", "place_table"]
    assert match_goal("Collect Wood", goals) == "collect_wood"
    assert match_goal(" place-table ", goals) == "place_table"
    assert match_goal("chop a tree", goals) is None


def test_check_plan_names_unknown_goals_and_skills(task):
    plan = Plan(
        [
            PlanStep("collect_wood", "skill", done="collect_wood"),
            PlanStep("mine_gold", "skill", done="collect_gold"),
            PlanStep("dance", "skill"),
        ]
    )
    errors = check_plan(plan, task, skills=["collect_wood"])
    assert len(errors) == 3
    assert "cannot check the goal 'collect_gold'" in errors[0] and "did you mean" in errors[0]
    assert "mine_gold" in errors[1] and "dance" in errors[2] and "unknown skill" in errors[2]
    assert check_plan(Plan([PlanStep("collect_wood", "skill", done="collect_wood")]), task) == []
    assert "no goals it can check" in check_plan(plan, make_task({"name": "cartpole"}))[0]


def test_plan_kinds_are_checked_and_text_is_made_from_steps():
    with pytest.raises(ValueError, match="kind"):
        Plan([PlanStep("x", "dance")])
    plan = Plan([PlanStep("collect_wood", "skill", "hit a tree", "collect_wood")])
    assert plan.text == "1. collect_wood [skill]: hit a tree" and str(plan) == plan.text
    assert Plan.of("free text").text == "free text" and Plan.of("") is None and Plan.of(None) is None
    assert Plan.of(plan) is plan and Candidate("c", 0, plan=plan).parts["plan"] is plan


def test_follower_advances_through_the_steps_with_no_state(task):
    plan = Plan(
        [
            PlanStep("collect_wood", "skill", done="collect_wood"),
            PlanStep("note", "goal"),
            PlanStep("place_table", "skill", done="place_table"),
        ]
    )
    follow = PlanFollower(plan, task)
    assert len(follow) == 2  # the unchecked step is not followed
    none, wood, both = _obs(task), _obs(task, "collect_wood"), _obs(task, "collect_wood", "place_table")
    table_only = _obs(task, "place_table")
    obs = torch.stack([none, wood, both, table_only])
    assert follow.active(obs).tolist() == [0, 1, 2, 0]
    assert follow.one_hot(obs).tolist()[1] == [0.0, 1.0, 0.0]
    # completing the active step counts; achieving a later step out of order does not
    before, after = torch.stack([none, wood, none, wood]), torch.stack([wood, both, table_only, wood])
    assert follow.completed(before, after).tolist() == [True, True, False, False]
    rl_only = PlanFollower(plan, task, kinds=["rl"])
    assert len(rl_only) == 0 and rl_only.completed(before, after).tolist() == [False] * 4


def test_training_reads_the_candidates_plan(task):
    from core.testing.fakes import make_train

    plan = Plan([PlanStep("collect_wood", "skill", done="collect_wood")], origin="x")
    assert make_train(task, candidate=Candidate("c", 0, plan=plan)).plan is plan
    assert make_train(task, candidate=Candidate("c", 0)).plan is None
