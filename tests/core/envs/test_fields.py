"""What LLM code may read of a task: every name its texts use is a field, and derived fields compute.

A program reads a task's state by field name (``next_state.tip_height``), so a goal or a
description that names a quantity the state does not have (``theta1`` where only its sine and
cosine are fields) invites a program that reads a field that does not exist. Over every task
the project registers (``conf/env/*.yaml``, :data:`core.envs.BUILTIN_TASKS`):

- every identifier-like word of the goal, the description, the action description and the
  field descriptions (snake_case words, words mixing letters and digits, anything in
  backticks) is a field or a derived field, or on :data:`ALLOWED` with its reason;
- each derived field computes a finite float32 ``[B, *shape]`` tensor from a real batch of the
  task's env (and from made-up extreme states), with a module-level (picklable) function, and
  ``program_obs`` / ``split_state`` agree with :attr:`Task.program_fields`;
- a few values by hand: Acrobot's angles and tip height, Pendulum's angle, MountainCar's
  energy, LunarLander's distance, the MuJoCo torso tilt, Crafter's faced cell, MetaWorld's
  distances against the env's own.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import keyword
import math
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from core.envs import BUILTIN_TASKS, make_task, task_class
from core.envs.classic import without_reward_section
from core.envs.crafter import ACTIONS as CRAFTER_ACTIONS
from core.envs.task import Task

warnings.filterwarnings("ignore", message=".*(within the observation space|maximum and minimum).*")

CONF = Path(__file__).resolve().parents[3] / "conf" / "env"
#: the package each optional task needs; a task whose package is missing here is skipped (importorskip)
NEEDS = {"minedojo": "minedojo"}
#: a state is a dict: these names are its methods, never fields (``core.namecheck``)
DICT_METHODS = {"get", "keys", "values", "items"}
#: a derived field's description is one line of a prompt (a skeleton's comment)
DESCRIPTION_CHARS = 130

BACKTICKED = re.compile(r"`([^`]*)`")
SNAKE = re.compile(r"\b[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+\b")
LETTERS_DIGITS = re.compile(r"\b[A-Za-z]+[0-9][A-Za-z0-9]*\b")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: text left out of the check, with why: (pattern, reason)
IGNORED = [
    (re.compile(r"```.*?```", re.S), "the env's own source code, quoted verbatim (show_source)"),
    (re.compile(r"\b[A-Za-z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)*-v\d+\b"), "environment ids (CartPole-v1, reach-v3)"),
]
#: words that may appear though they are not fields: (words, tasks or None for all, reason)
ALLOWED: list[tuple[tuple[str, ...], tuple[str, ...] | None, str]] = [
    (("float32",), None, "the observation's dtype, not a quantity"),
    (("atan2",), None, "the math function a formula uses (torch.atan2), not a quantity"),
    (("Box2D",), ("lunarlander",), "the physics engine's name"),
    (
        tuple(CRAFTER_ACTIONS),
        ("minecraft", "crafter"),
        (
            "Crafter's own action names: the action description names each discrete action by them "
            "(test_crafter requires it)"
        ),
    ),
    (("harvest_milk",), ("minedojo",), "the MineDojo task id (env.task_id), quoted as the task's name"),
]


def _configs() -> dict[str, dict[str, Any]]:
    """Each registered task's config: its ``conf/env`` file, or (aliases) the config of the task it aliases."""
    files = {p.stem: OmegaConf.to_container(OmegaConf.load(p), resolve=True) for p in sorted(CONF.glob("*.yaml"))}
    out = {}
    for name, target in BUILTIN_TASKS.items():
        if name in files:
            out[name] = files[name]
        else:  # an alias: the same class as a task that has a config
            twin = next(n for n, t in BUILTIN_TASKS.items() if t == target and n in files)
            out[name] = {**files[twin], "name": name}
    return out


CONFIGS = _configs()
NAMES = sorted(CONFIGS)


def _needs(name: str) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])


def test_every_config_is_a_registered_task_and_every_task_has_one():
    names = {p.stem: OmegaConf.load(p)["name"] for p in CONF.glob("*.yaml")}
    assert all(stem == name and name in BUILTIN_TASKS for stem, name in names.items()), names
    assert set(CONFIGS) == set(BUILTIN_TASKS)


# -------------------------------------------------------------------------------------
# (a) the texts name fields only
# -------------------------------------------------------------------------------------


def _variants(name: str) -> list[dict[str, Any]]:
    """The task's config, and the configs whose texts differ from it (sparse reward, options)."""
    cfg = CONFIGS[name]
    out = [cfg]
    if task_class(name).sparse_text:
        out.append({**cfg, "reward": "sparse"})
    extra = {
        "lunarlander": {"continuous": True},
        "panda_reach": {"control_type": "joints"},
        "minecraft": {"pixels": True},
        "cartpole": {"show_source": True},
    }
    if name in extra:
        out.append({**cfg, **extra[name]})
    return out


def _texts(task: Task) -> dict[str, str]:
    texts = {"goal": task.goal, "description": task.description, "action_description": task.action_description}
    if task.name == "gym":  # the env class's own documentation, quoted as gymnasium wrote it
        doc = without_reward_section(inspect.getdoc(type(gym.make(task.env_id).unwrapped)) or "")
        assert doc and doc in task.description
        texts["description"] = task.description.replace(doc, "")
    for f in task.program_fields:
        texts[f"field {f.name}"] = f.description
    return texts


def unknown_names(text: str, known: set[str]) -> list[str]:
    """The identifier-like words of ``text`` that are not in ``known``."""
    for pattern, _ in IGNORED:
        text = pattern.sub(" ", text)
    bad = []
    for quoted in BACKTICKED.findall(text):
        if quoted not in known:
            bad.append(f"`{quoted}`")
    text = BACKTICKED.sub(" ", text)
    for pattern in (SNAKE, LETTERS_DIGITS):
        bad += [w for w in pattern.findall(text) if w not in known]
    return sorted(set(bad))


def test_the_checker_finds_made_up_names():
    known = {"cos_theta1", "theta1", "tip_height"}
    text = "The `tip_height` above theta1 and `theta2`; cos_theta1, sin_theta1 and x2 in CartPole-v1 ```a_b = c1```"
    assert unknown_names(text, known) == ["`theta2`", "sin_theta1", "x2"]


@pytest.mark.parametrize("name", NAMES)
def test_goal_and_descriptions_name_only_fields(name):
    allowed = {w for words, tasks, _ in ALLOWED if tasks is None or name in tasks for w in words}
    for cfg in _variants(name):
        task = make_task(cfg, check=False)
        known = set(task.field_names()) | allowed
        problems = {where: bad for where, text in _texts(task).items() if (bad := unknown_names(text, known))}
        assert not problems, f"{name} {cfg}: names that are not fields: {problems}"


# -------------------------------------------------------------------------------------
# (b) derived fields on real states
# -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def real_states(name: str) -> tuple[Task, np.ndarray, list[dict[str, Any]]]:
    """The task (built once), the observations of a reset and 3 random steps of 2 envs ``[8, obs_dim]``, the infos."""
    task = make_task(CONFIGS[name])
    env = task.make_env(2, 0)
    try:
        obs, _ = env.reset(seed=0)
        rows, infos = [obs], []
        for _ in range(3):
            obs, *_, info = env.step(env.action_space.sample())
            rows.append(obs)
            infos.append(info)
    finally:
        env.close()
    return task, np.concatenate(rows).astype(np.float32), infos


def _check_derived(task: Task, obs: torch.Tensor) -> None:
    base = task._base_fields(obs)
    for d in task.derived_fields:
        out = d.compute(base)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32, (
            d.name,
            type(out),
            getattr(out, "dtype", None),
        )
        assert tuple(out.shape) == (obs.shape[0], *d.shape), (d.name, tuple(out.shape))
        assert torch.isfinite(out).all(), (d.name, out)


@pytest.mark.parametrize("name", NAMES)
def test_derived_fields_are_well_formed(name):
    task = make_task(CONFIGS[name], check=False)
    names = task.field_names()
    assert len(set(names)) == len(names), names
    for d in task.derived_fields:
        assert IDENTIFIER.fullmatch(d.name) and not keyword.iskeyword(d.name) and d.name not in DICT_METHODS, d.name
        assert d.description and len(d.description) <= DESCRIPTION_CHARS, (d.name, len(d.description))
        assert all(isinstance(n, int) and n > 0 for n in d.shape), d.shape
        fn = d.compute  # tasks travel to other processes: a module-level function, never a lambda or closure
        assert "<" not in fn.__qualname__, (d.name, fn.__qualname__)
        assert getattr(importlib.import_module(fn.__module__), fn.__qualname__) is fn, d.name
    back = pickle.loads(pickle.dumps(task.derived_fields))
    assert [d.name for d in back] == [d.name for d in task.derived_fields]


@pytest.mark.parametrize("name", NAMES)
def test_derived_fields_compute_on_real_states(name):
    _needs(name)
    task, rows, _ = real_states(name)
    obs = torch.as_tensor(rows)
    _check_derived(task, obs)

    wide = task.program_obs(obs)
    assert wide.dtype == torch.float32
    assert wide.shape == (obs.shape[0], task.obs_dim + sum(d.size for d in task.derived_fields))
    assert torch.equal(wide[:, : task.obs_dim], obs[:, : task.obs_dim])
    assert task.program_fields[-1].stop == wide.shape[1]
    parts = task.split_state(obs)
    assert list(parts) == task.field_names()
    for f in task.program_fields:
        column = wide[:, f.start : f.stop]
        expected = column.reshape(obs.shape[0], *f.shape) if f.shape else column[:, 0]
        torch.testing.assert_close(parts[f.name], expected, msg=f.name)
    assert task.schema_text().count("\n") == len(task.program_fields) - 1


@pytest.mark.parametrize("name", NAMES)
def test_derived_fields_are_finite_for_any_state(name):
    task = make_task(CONFIGS[name], check=False)
    if not task.derived_fields:
        return
    gen = torch.Generator().manual_seed(0)
    for obs in (torch.zeros(3, task.obs_dim), 100.0 * torch.randn(3, task.obs_dim, generator=gen)):
        _check_derived(task, obs)


# -------------------------------------------------------------------------------------
# (c) values by hand
# -------------------------------------------------------------------------------------


def _state(task: Task, **values: Any) -> torch.Tensor:
    """One observation ``[1, obs_dim]`` with the named fields set (the rest 0)."""
    obs = torch.zeros(1, task.obs_dim)
    by_name = {f.name: f for f in task.state_fields}
    for key, value in values.items():
        f = by_name[key]
        obs[0, f.start : f.stop] = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    return obs


def test_acrobot_angles_and_tip_height():
    task = make_task({"name": "acrobot"})
    for t1, t2 in ((0.0, 0.0), (math.pi, 0.0), (0.7, -2.1), (-2.5, 1.3), (3.0, 3.0)):
        obs = _state(
            task, cos_theta1=math.cos(t1), sin_theta1=math.sin(t1), cos_theta2=math.cos(t2), sin_theta2=math.sin(t2)
        )
        s = task.split_state(obs)
        assert float(s["tip_height"][0]) == pytest.approx(-math.cos(t1) - math.cos(t1 + t2), abs=1e-5)
        assert float(s["theta1"][0]) == pytest.approx(math.atan2(math.sin(t1), math.cos(t1)), abs=1e-5)
        assert float(s["theta2"][0]) == pytest.approx(math.atan2(math.sin(t2), math.cos(t2)), abs=1e-5)
    hanging, up = (task.split_state(_state(task, cos_theta1=c, cos_theta2=1.0))["tip_height"] for c in (1.0, -1.0))
    assert float(hanging[0]) == pytest.approx(-2.0) and float(up[0]) == pytest.approx(2.0)


def test_pendulum_angle_is_zero_upright():
    task = make_task({"name": "pendulum"})

    def angle(theta: float) -> float:
        return float(task.split_state(_state(task, cos_theta=math.cos(theta), sin_theta=math.sin(theta)))["angle"][0])

    assert angle(0.0) == pytest.approx(0.0, abs=1e-6)
    assert abs(angle(math.pi)) == pytest.approx(math.pi, abs=1e-5)
    assert angle(0.4) == pytest.approx(0.4, abs=1e-5) and angle(-1.2) == pytest.approx(-1.2, abs=1e-5)


def test_mountaincar_energy_runs_from_the_valley_to_the_flag():
    for name, flag in (("mountaincar", 0.5), ("mountaincar_continuous", 0.45)):
        task = make_task({"name": name})
        s = lambda x, v=0.0: task.split_state(_state(task, car_position=x, car_velocity=v))  # noqa: E731
        assert float(s(-math.pi / 6)["mechanical_energy"][0]) == pytest.approx(0.0, abs=1e-5)
        assert float(s(flag)["mechanical_energy"][0]) == pytest.approx(1.0, abs=1e-5)
        assert float(s(-0.5, 0.05)["mechanical_energy"][0]) > float(s(-0.5)["mechanical_energy"][0])
        assert float(s(-math.pi / 6)["car_height"][0]) == pytest.approx(0.1, abs=1e-5)


def test_lunarlander_distance_and_speed():
    task = make_task({"name": "lunarlander"}, check=False)
    s = task.split_state(_state(task, x=0.3, y=0.4, x_velocity=-0.6, y_velocity=0.8))
    assert float(s["distance_to_pad"][0]) == pytest.approx(0.5) and float(s["speed"][0]) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["ant", "humanoid"])
def test_torso_upright_from_the_quaternion(name):
    task = make_task({"name": name}, check=False)

    def up(q: tuple[float, ...]) -> float:
        return float(
            task.split_state(_state(task, root_qw=q[0], root_qx=q[1], root_qy=q[2], root_qz=q[3]))["torso_upright"][0]
        )

    half = math.sqrt(0.5)
    assert up((1, 0, 0, 0)) == pytest.approx(1.0) and up((half, 0, 0, half)) == pytest.approx(1.0)  # yaw only
    assert up((0, 1, 0, 0)) == pytest.approx(-1.0) and up((half, half, 0, 0)) == pytest.approx(0.0, abs=1e-6)


def test_crafter_faced_cell_and_achievement_count():
    pytest.importorskip("crafter")
    task = make_task({"name": "minecraft"})
    view = np.full((9, 7), 2.0)  # grass
    view[5, 3], view[4, 2] = 6.0, 14.0  # a tree right of the player, a cow above
    right = task.split_state(
        _state(task, local_view=view, facing=(1, 0), achievement_collect_wood=1, achievement_wake_up=1)
    )
    above = task.split_state(_state(task, local_view=view, facing=(0, -1)))
    assert float(right["faced_cell"][0]) == 6.0 and float(above["faced_cell"][0]) == 14.0
    assert float(right["achievements_unlocked"][0]) == 2.0 and float(above["achievements_unlocked"][0]) == 0.0


@pytest.mark.parametrize(
    "name, field",
    [
        ("push", "obj_goal_distance"),
        ("pick-place", "obj_goal_distance"),
        ("drawer-open", "obj_goal_distance"),
        ("button-press", "obj_goal_y_distance"),
        ("reach", "fingertips_goal_distance"),
    ],
)
def test_metaworld_success_distances_are_the_envs_own(name, field):
    """The env reports the distance its success test compares (``info["obj_to_target"]``)."""
    pytest.importorskip("metaworld")
    task, rows, infos = real_states(name)
    computed = task.split_state(torch.as_tensor(rows[2:]))[field].numpy()  # the states after each step
    reported = np.concatenate([np.asarray(i["obj_to_target"], np.float64) for i in infos])
    tolerance = 0.007 if field.startswith("fingertips") else 1e-5  # the fingertips are the hand 4.5 cm lower, to ~6 mm
    np.testing.assert_allclose(computed, reported, atol=tolerance)
