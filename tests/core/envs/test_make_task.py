"""Task lookup: names, plugin tasks, config kwargs, clear errors."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from core.envs import BUILTIN_TASKS, available_tasks, make_task, task_class
from core.envs.classic import CartPole
from core.envs.task import StateField, Task
from core.errors import UserError
from core.resources import conf_dir


class Toy(Task):
    def __init__(self, size: int = 2) -> None:
        super().__init__("toy", "do nothing", [StateField("x", 0, size, "x", shape=(size,))], "a toy")


def test_available_tasks_lists_builtin_and_plugin_tasks():
    names = available_tasks({"toy": Toy})
    for name in (
        "cartpole",
        "mountaincar",
        "lunarlander",
        "gym",
        "halfcheetah",
        "reach",
        "minecraft",
        "minedojo",
        "toy",
    ):
        assert name in names
    assert names == sorted(names)


def test_make_task_from_dictconfig_passes_kwargs():
    task = make_task(OmegaConf.create({"name": "cartpole", "max_episode_steps": 123}))
    assert isinstance(task, CartPole) and task.max_episode_steps == 123


def test_plugin_task_is_built_from_extra():
    task = make_task({"name": "toy", "size": 3}, extra={"toy": Toy})
    assert isinstance(task, Toy) and task.obs_dim == 3


def test_unknown_task_lists_available_and_suggests():
    with pytest.raises(UserError) as err:
        make_task({"name": "cartpol"})
    message = str(err.value)
    assert "Unknown task 'cartpol'" in message and "Did you mean 'cartpole'" in message
    assert "mountaincar" in message and "minecraft" in message


def test_unknown_option_names_the_accepted_ones():
    with pytest.raises(UserError, match="does not take the option.*colour.*max_episode_steps"):
        make_task({"name": "cartpole", "colour": "red"})


def test_missing_name_is_a_user_error():
    with pytest.raises(UserError, match="no 'name'"):
        make_task({"max_episode_steps": 3})


def test_gym_task_needs_a_registered_id():
    with pytest.raises(UserError, match="not a registered gymnasium id"):
        make_task({"name": "gym", "id": "NoSuchEnv-v9"})


def test_every_builtin_class_imports_and_every_task_has_a_config():
    for name in BUILTIN_TASKS:
        assert issubclass(task_class(name), Task)
    configs = {p.stem for p in (conf_dir() / "env").glob("*.yaml")}
    assert set(BUILTIN_TASKS) - {"crafter"} <= configs  # crafter is an alias of minecraft


def test_every_env_config_key_has_a_comment_and_builds():
    for path in sorted((conf_dir() / "env").glob("*.yaml")):
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                assert "#" in line, f"{path.name}: key without a comment: {line}"
        cfg = OmegaConf.load(path)
        task = make_task(cfg, check=False)  # minedojo cannot run here; its check is tested apart
        assert task.name.replace("_", "-") in {cfg.name.replace("_", "-"), "gym"} or cfg.name == "minecraft"
