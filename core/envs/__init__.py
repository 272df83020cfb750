"""Tasks: look one up by its config name and build it from the Hydra ``env`` node.

Built-in tasks are listed in :data:`BUILTIN_TASKS` as ``module:Class`` strings so that
looking one up imports only its own module; heavy simulators (MuJoCo, MetaWorld,
Crafter, MineDojo) are imported only when an env is made, and
:meth:`core.envs.task.Task.check_available` names the extra to install when one is
missing. Plugins add tasks through the ``register_tasks`` hook (passed here as ``extra``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from core.envs.task import ParamSpec, StateField, Task
from core.errors import UserError, did_you_mean

#: config name -> "module:Class" of the built-in tasks
BUILTIN_TASKS: dict[str, str] = {
    "cartpole": "core.envs.classic:CartPole",
    "mountaincar": "core.envs.classic:MountainCar",
    "mountaincar_continuous": "core.envs.classic:MountainCarContinuous",
    "pendulum": "core.envs.classic:Pendulum",
    "acrobot": "core.envs.classic:Acrobot",
    "lunarlander": "core.envs.classic:LunarLander",
    "gym": "core.envs.classic:GymTask",
    "halfcheetah": "core.envs.mujoco:HalfCheetah",
    "hopper": "core.envs.mujoco:Hopper",
    "ant": "core.envs.mujoco:Ant",
    "humanoid": "core.envs.mujoco:Humanoid",
    "reach": "core.envs.metaworld:Reach",
    "push": "core.envs.metaworld:Push",
    "pick-place": "core.envs.metaworld:PickPlace",
    "door-open": "core.envs.metaworld:DoorOpen",
    "drawer-open": "core.envs.metaworld:DrawerOpen",
    "button-press": "core.envs.metaworld:ButtonPress",
    "minecraft": "core.envs.crafter:Crafter",
    "crafter": "core.envs.crafter:Crafter",
    "minedojo": "core.envs.minedojo:MineDojo",
    "kuka_grasp": "core.envs.pybullet_grasp:KukaGrasp",
    "panda_reach": "core.envs.panda:PandaReach",
    "panda_push": "core.envs.panda:PandaPush",
    "panda_pick_and_place": "core.envs.panda:PandaPickAndPlace",
}


def available_tasks(extra: Mapping[str, type[Task]] | None = None) -> list[str]:
    """Sorted config names of every task: the built-in ones and those in ``extra``."""
    return sorted(set(BUILTIN_TASKS) | set(extra or {}))


def task_class(name: str, extra: Mapping[str, type[Task]] | None = None) -> type[Task]:
    """The task class registered under ``name`` (plugin tasks win over built-in ones)."""
    if extra and name in extra:
        return extra[name]
    if name not in BUILTIN_TASKS:
        names = available_tasks(extra)
        raise UserError(
            f"Unknown task '{name}'.{did_you_mean(name, names)} Available tasks: {', '.join(names)}. "
            "Select one with env=<name>, or env=gym env.id=<gymnasium id> for any gymnasium environment."
        )
    module, _, cls = BUILTIN_TASKS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_task(env_cfg: Mapping[str, Any], extra: dict[str, type[Task]] | None = None, *, check: bool = True) -> Task:
    """Build the task named by ``env_cfg["name"]`` with the node's other keys as kwargs.

    :param env_cfg: the Hydra ``env`` node (a DictConfig or any mapping).
    :param extra: tasks contributed by plugins (``register_tasks``), by name.
    :param check: call :meth:`Task.check_available` so that a missing simulator is
        reported now, as a :class:`UserError` naming the extra to install.
    """
    cfg = _plain(env_cfg)
    name = cfg.pop("name", None)
    if not name:
        raise UserError(f"The env config has no 'name'. Available tasks: {', '.join(available_tasks(extra))}.")
    cls = task_class(str(name), extra)
    _check_kwargs(str(name), cls, cfg)
    task = cls(**cfg)
    if check:
        task.check_available()
    return task


def _plain(env_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A plain dict of the config node (resolves OmegaConf interpolations)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(env_cfg, DictConfig):
            return dict(OmegaConf.to_container(env_cfg, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - omegaconf is a base dependency
        pass
    return dict(env_cfg)


def _check_kwargs(name: str, cls: type[Task], kwargs: dict[str, Any]) -> None:
    """Reject config keys the task's constructor does not take, listing those it does."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise UserError(
            f"The task '{name}' does not take the option(s) {', '.join(unknown)}. "
            f"Its options are: {', '.join(accepted) or '(none)'}."
        )


__all__ = ["BUILTIN_TASKS", "ParamSpec", "StateField", "Task", "available_tasks", "make_task", "task_class"]
