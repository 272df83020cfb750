"""Prompt pieces: the shapes the prompt states are the shapes training passes, on every task family."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from core.envs import make_task
from core.prompting import (
    Shapes,
    action_text,
    batch_shapes,
    candidate_line,
    fence,
    reply_counts,
    reward_interface,
    state_interface,
    task_description,
)
from core.records import Candidate, Fitness, RewardProgram, TrainResult

#: one task per family: classic discrete / continuous, MuJoCo, MetaWorld, Crafter, Kuka (PyBullet)
FAMILIES = ["cartpole", "pendulum", "halfcheetah", "reach", "crafter", "kuka_grasp"]
FAST = {"cartpole", "pendulum"}


def stated_shapes(prompt: str) -> tuple[str, tuple[int, ...], dict[str, tuple[int, ...]]]:
    """``(action dtype, action dims, field -> dims)`` as the prompt's text states them."""

    def dims(text: str | None) -> tuple[int, ...]:
        return tuple(int(d) for d in text.split(",")) if text else ()

    action = re.search(r"`action` is an? (\w+) tensor of shape \[B(?:, ([\d, ]+))?\]", prompt)
    assert action, prompt
    fields = {
        m.group(1): dims(m.group(2)) for m in re.finditer(r"^- (\w+) \(\[B(?:, ([\d, ]+))?\]", prompt, re.MULTILINE)
    }
    return action.group(1), dims(action.group(2)), fields


def test_cartpole_says_its_action_is_one_index_per_env():
    """The issue: the prompt said [B, ...] and a candidate called action.squeeze(1) on CartPole's [B]."""
    task = make_task({"name": "cartpole"})
    shapes = batch_shapes(task)
    assert shapes.action == () and shapes.action_dtype == "int64" and shapes.actions == 2
    assert set(shapes.fields) == set(task.field_names()) and set(shapes.fields.values()) == {()}
    prompt = reward_interface(task, shapes=shapes)
    assert "[B, ...]" not in prompt
    assert "`action` is an int64 tensor of shape [B] (one action index per env, 0..1; no trailing dimension)" in prompt
    assert "- pole_angle ([B], unit rad)" in prompt


def test_a_continuous_action_has_its_trailing_dimension_and_bounds():
    task = make_task({"name": "pendulum"})
    shapes = batch_shapes(task)
    assert shapes.action == (1,) and shapes.action_dtype == "float32" and shapes.actions == 0
    text = action_text(task, shapes)
    assert text.startswith("`action` is a float32 tensor of shape [B, 1]") and "within [-2, 2]" in text
    assert "[B]" in state_interface(task, shapes=shapes) and "[B, ...]" not in state_interface(task, shapes=shapes)


def test_vector_fields_are_stated_with_their_shape():
    shapes = Shapes(action=(4,), action_dtype="float32", fields={"hand_pos": (3,), "gap": ()})
    task = SimpleNamespace(
        state_fields=[
            SimpleNamespace(name="hand_pos", unit="m", description="the hand"),
            SimpleNamespace(name="gap", unit="", description="the gap"),
        ]
    )
    from core.prompting import fields_text

    assert fields_text(task, shapes) == "- hand_pos ([B, 3], unit m): the hand\n- gap ([B]): the gap"
    assert Shapes.text(()) == "[B]" and Shapes.text((2, 3)) == "[B, 2, 3]"


CHECK = """
import torch


def compute_reward(state, action, next_state):
    expected_action, expected_fields, integer = {action!r}, {fields!r}, {integer!r}
    got = tuple(action.shape[1:])
    if got != expected_action or action.is_floating_point() == integer:
        raise ValueError(f"action: the prompt said {{expected_action}} (integer: {{integer}}), "
                         f"training passed {{got}} {{action.dtype}}")
    for name, dims in expected_fields.items():
        for which in (state, next_state):
            if tuple(which[name].shape[1:]) != dims or which[name].shape[0] != action.shape[0]:
                raise ValueError(f"{{name}}: the prompt said {{dims}}, training passed {{tuple(which[name].shape)}}")
    if set(state) != set(expected_fields):
        raise ValueError(f"fields: the prompt named {{sorted(expected_fields)}}, training passed {{sorted(state)}}")
    ones = torch.ones(action.shape[0])
    return 0.0 * ones, {{"checked": ones}}
"""


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in FAMILIES])
def test_the_prompts_shapes_are_what_training_passes(name: str):
    """A reward program that raises unless ``action`` and every field have the shapes the
    prompt states trains through PPO's real path (env, collector, sandboxed program)."""
    from core.train import ppo

    task = make_task({"name": name})
    dtype, action, fields = stated_shapes(reward_interface(task))
    assert set(fields) == set(task.field_names())  # derived fields included
    source = CHECK.format(action=action, fields=fields, integer=dtype.startswith("int"))
    candidate = Candidate("shapes", 0, reward=RewardProgram(source=source))
    cfg = ppo.PPOConfig(frames=32, num_envs=2, rollout_steps=16, epochs=1, minibatch=16, hidden=[8], eval_episodes=0)
    result = ppo.train(task, candidate, cfg, seed=0)
    assert result.ok, result.error
    assert result.components["checked"] and result.frames == 32  # the checks ran on the collected batches


# -- reflections as markdown ----------------------------------------------------------------------


def test_a_fence_is_longer_than_any_backtick_run_inside():
    text = "a reply with a block:\n```python\nx = 1\n```"
    block = fence(text, "text")
    assert block.startswith("````text\n") and block.endswith("\n````") and text in block
    assert fence("plain") == "```\nplain\n```"


def test_counts_and_candidate_lines_say_why_a_candidate_did_not_train():
    usable = RewardProgram(
        source="def compute_reward(s, a, n): ...", meta={"sample": 0, "renamed_from": "improved_compute_reward"}
    )
    rejected = RewardProgram(
        source="",
        rejected="No function named `compute_reward`.\nmore",
        meta={"sample": 1, "rejected_kind": "no_function"},
    )
    pairs = [
        (Candidate("it0-c0", 0, reward=usable), TrainResult("it0-c0", True, fitness=Fitness("return", 12.5))),
        (Candidate("it0-c1", 0, reward=rejected), TrainResult("it0-c1", False, error="x", error_kind="rejected")),
        (
            Candidate("it0-c2", 0, reward=RewardProgram(source="y")),
            TrainResult("it0-c2", False, error="Traceback\nKeyError: 'x'", error_kind="exception"),
        ),
    ]
    assert reply_counts(pairs) == "3 sampled, 2 usable, 1 trained"
    lines = [candidate_line(c, r, c.reward) for c, r in pairs]
    assert (
        lines[0] == "- `it0-c0` (reply 0): return 12.5 (function `improved_compute_reward` renamed to `compute_reward`)"
    )
    assert lines[1] == "- `it0-c1` (reply 1): rejected (no_function), not trained: No function named `compute_reward`."
    assert lines[2] == "- `it0-c2`: failed (exception): KeyError: 'x'"


# -- the interface built from the task -------------------------------------------------------------


@pytest.mark.parametrize("name", ["cartpole", "mountaincar", "acrobot", "pendulum"])
def test_the_skeleton_binds_every_field_of_the_task_and_no_other(name: str):
    task = make_task({"name": name})
    prompt = reward_interface(task)
    bound = re.findall(r"^    (\w+) = next_state\.(\w+)", prompt, re.MULTILINE)
    assert [a for a, _ in bound] == task.field_names() and all(a == b for a, b in bound)
    assert '["x"]' not in prompt and "made-up task" not in prompt and "closeness" not in prompt
    assert "def compute_reward(state, action, next_state):" in prompt


def test_a_task_with_many_fields_gets_a_skeleton_without_the_full_bindings():
    """Crafter's 45 bindings were about three quarters of each reply (docs/scaling/first_run.json)."""
    import copy

    from core.namecheck import check_names
    from core.prompting import SKELETON_MAX_FIELDS

    task = make_task({"name": "crafter"})
    assert len(task.field_names()) > SKELETON_MAX_FIELDS
    prompt, short = reward_interface(task), state_interface(task)
    assert re.findall(r"^    (\w+) = next_state\.\w+", prompt, re.MULTILINE) == ["health", "achievements_unlocked"]
    assert re.findall(r"^    (\w+) = state\.\w+", short, re.MULTILINE) == ["health", "achievements_unlocked"]
    unnamed = copy.copy(task)
    unnamed.goal = "Survive and unlock achievements."  # a goal that names no field
    assert not re.findall(r"^    \w+ = (?:next_)?state\.\w+", reward_interface(unnamed), re.MULTILINE)
    assert "# bind only the fields you use, one line each, e.g. health = next_state.health" in reward_interface(unnamed)
    assert "no fields but those listed above" in prompt and "no fields but those listed above" in short
    assert all(f"- {name} ([B" in prompt for name in task.field_names())  # every field still listed, with its meaning
    # the names a program then binds are still checked before anything runs
    source = "def compute_reward(state, action, next_state):\n    wod = next_state.wod\n    return wod, {}\n"
    assert check_names(source, task.field_names()).fixes  # one close field: mended to `wood`
    source = "def compute_reward(state, action, next_state):\n    gold = next_state.gold\n    return gold, {}\n"
    assert check_names(source, task.field_names()).errors


def test_a_task_with_many_fields_lists_them_once():
    """The description's own field list is dropped where the interface lists the fields with their shapes."""
    from core.prompting import POINTER, task_description

    task = make_task({"name": "crafter"})
    short = task_description(task, "fields")
    assert len(short) < 0.6 * len(task.description)
    for f in task.program_fields:  # every field once in the whole prompt's field lines
        assert f"- {f.name}: {f.description}" in task.description and f"- {f.name}: " not in short
        assert (short + reward_interface(task)).count(f"- {f.name} (") == 1
    assert short.count(POINTER) == 2  # the state fields and the computed ones, one pointer each
    assert "Rules: the world is a 64x64 grid" in short and "Fitness: the Crafter score" in short  # the rest stays
    assert task_description(task, "dict") == task.description


@pytest.mark.parametrize("name", ["cartpole", "mountaincar", "lunarlander", "hopper", "reach"])
def test_a_task_with_few_fields_keeps_its_description(name: str):
    task = make_task({"name": name})
    assert task_description(task, "fields") == task.description


@pytest.mark.parametrize(
    ("name", "named"),
    [("crafter", ["health", "achievements_unlocked"]), ("humanoid", ["root_vx", "root_z", "torso_upright"])],
)
def test_a_many_field_skeleton_binds_the_fields_its_goal_names(name: str, named: list[str]):
    """The model binds what the skeleton binds: the goal's backticked fields, not the listing's first 39."""
    from core.prompting import goal_fields, skeleton_bindings

    task = make_task({"name": name})
    assert goal_fields(task) == named
    bound = re.findall(r"^    (\w+) = next_state\.\w+", skeleton_bindings(task), re.MULTILINE)
    assert sorted(bound) == sorted(named)  # in the listing's order
    assert "# bind another field only if a term needs it, the same way: name = next_state.name" in reward_interface(
        task
    )


def test_a_task_with_few_fields_keeps_every_binding_in_its_skeleton():
    task = make_task({"name": "reach"})
    bound = re.findall(r"^    (\w+) = next_state\.\w+", reward_interface(task), re.MULTILINE)
    assert bound == task.field_names()
    assert "Delete the bindings you do not use." in reward_interface(task)


def test_the_sign_rule_follows_how_the_task_ends():
    from core.prompting import sign_rule

    assert "negative or zero on average until the goal is reached" in sign_rule(make_task({"name": "mountaincar"}))
    assert "a long episode is the success" in sign_rule(make_task({"name": "cartpole"}))
    assert "always run to their time limit" in sign_rule(make_task({"name": "pendulum"}))
    assert "Sign rule" in reward_interface(make_task({"name": "acrobot"}))


def test_the_earlier_interface_is_kept_for_comparison():
    task = make_task({"name": "cartpole"})
    assert "made-up task with fields `x` and `y`" in reward_interface(task, interface="dict")
    assert "state: dict of field name" in state_interface(task, interface="dict")


def test_the_temperature_falls_with_fewer_samples():
    from core.prompting import sampling_temperature

    assert sampling_temperature(16) == 1.0 and sampling_temperature(32) == 1.0
    assert sampling_temperature(1) < sampling_temperature(4) < sampling_temperature(8) < 1.0


def test_a_repair_request_is_short_and_says_the_fields_the_function_the_error_and_the_rule():
    from core.prompting import repair_messages

    task = make_task({"name": "mountaincar"})
    source = "def compute_reward(state, action, next_state):\n    return state.car_position * 0 + 1\n"
    msgs = repair_messages(task, source, "It pays for prolonging the episode.", "vetting")
    assert len(msgs) == 2 and msgs[1]["role"] == "user"
    text = msgs[1]["content"]
    assert source.strip() in text and "It pays for prolonging the episode." in text
    assert "- car_position ([B])" in text and "- car_velocity ([B])" in text and task.goal in text
    assert "Sign rule: reaching the goal ends this task's episode" in text
    names = repair_messages(task, source, "`x` is not a field", "names")[1]["content"]
    assert "Read only the task's fields listed above" in names and "Sign rule" not in names
