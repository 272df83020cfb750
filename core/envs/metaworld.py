"""MetaWorld (v3) manipulation tasks on the Sawyer arm; fitness = success rate.

Each env is ``gymnasium.make("Meta-World/MT1", env_name="<task>-v3", seed=...)``: one
task with a goal resampled from its 50 variations at every reset. An episode counts as a
success when ``info["success"]`` was set at any of its steps.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from core.envs.classic import FloatObservation, GymTask, SuccessInfo, success_fitness, vector_env
from core.envs.task import DerivedField, StateField
from core.errors import UserError
from core.records import Episode, Fitness


def metaworld_fields(obj: str, obj2: str) -> list[StateField]:
    """The 39 observation values: current frame (18), previous frame (18), goal (3)."""
    current = [
        (
            "hand_pos",
            3,
            "position x, y, z of the end effector (the hand body; the fingertips are about 4.5 cm lower)",
            "m",
        ),
        ("gripper_distance", 1, "normalised opening between the two gripper fingers: 1 open, 0 closed", ""),
        ("obj_pos", 3, f"position of the {obj}", "m"),
        ("obj_quat", 4, f"orientation quaternion (w, x, y, z) of the {obj}", ""),
        ("obj2_pos", 3, f"position of the {obj2} (zeros when the task has none)", "m"),
        ("obj2_quat", 4, f"orientation quaternion of the {obj2} (zeros when the task has none)", ""),
    ]
    fields, start = [], 0
    for prefix, text in (("", ""), ("prev_", " at the previous step")):
        for name, size, description, unit in current:
            shape = (size,) if size > 1 else ()
            fields.append(StateField(prefix + name, start, start + size, description + text, unit, shape))
            start += size
    fields.append(StateField("goal_pos", start, start + 3, "target position x, y, z the task must reach", "m", (3,)))
    return fields


#: the centre between the fingertips (where MetaWorld's success tests measure from) relative to the hand
#: body: the arm keeps the hand's orientation fixed, so the offset is constant to within about 6 mm
FINGERTIPS_OFFSET = (0.0, 0.0, -0.045)


def fingertips_pos(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return s["hand_pos"] + torch.tensor(FINGERTIPS_OFFSET, dtype=s["hand_pos"].dtype, device=s["hand_pos"].device)


def fingertips_goal_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(fingertips_pos(s) - s["goal_pos"], dim=-1)


def fingertips_obj_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(fingertips_pos(s) - s["obj_pos"], dim=-1)


def obj_goal_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(s["obj_pos"] - s["goal_pos"], dim=-1)


def obj_goal_x_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return (s["obj_pos"][..., 0] - s["goal_pos"][..., 0]).abs()


def obj_goal_y_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return (s["obj_pos"][..., 1] - s["goal_pos"][..., 1]).abs()


FINGERTIPS = DerivedField(
    "fingertips_pos",
    "x, y, z of the centre between the fingertips: hand_pos 4.5 cm lower (approximate, to about 6 mm)",
    fingertips_pos,
    "m",
    (3,),
)
TO_OBJ = DerivedField(
    "fingertips_obj_distance", "distance from fingertips_pos to obj_pos", fingertips_obj_distance, "m"
)


def _success_distance(
    name: str, what: str, compute: Callable[[dict[str, torch.Tensor]], torch.Tensor], threshold: float
) -> DerivedField:
    return DerivedField(name, f"{what}; the task succeeds when it is at most {threshold:g}", compute, "m")


class MetaWorldTask(GymTask):
    """A MetaWorld v3 task (``env_name``), e.g. ``reach-v3``."""

    env_id = "Meta-World/MT1"
    metaworld_name = ""
    obj, obj2 = "object", "second object"
    task_goal = ""
    sparse_text = (
        "1 on every step at which the task's own success test holds (info['success']), 0 otherwise (success only)."
    )

    def __init__(
        self,
        max_episode_steps: int = 500,
        terminate_on_success: bool = False,
        show_source: bool = False,
        reward: str = "human",
    ) -> None:
        self.terminate_on_success = terminate_on_success
        super().__init__(
            name=self.metaworld_name.removesuffix("-v3"),
            max_episode_steps=max_episode_steps,
            fitness_name="success_rate",
            goal=self.task_goal,
            state_fields=metaworld_fields(self.obj, self.obj2),
            description=(
                f"MetaWorld {self.metaworld_name}: a Sawyer robot arm with a two-finger gripper on a table. "
                f"{self.task_goal} The goal position is resampled from 50 variations at every reset. "
                "Observation (39 values, float32): hand_pos (3), gripper_distance (1), obj_pos (3), obj_quat (4), "
                "obj2_pos (3), obj2_quat (4); then the same 18 values at the previous step (named with the prefix "
                "prev_, e.g. prev_hand_pos); then goal_pos (3). "
                + ", ".join(d.name for d in self.derived)
                + " are computed from them. "
                "Positions are in metres in the world frame (x right, y forward away from the "
                "robot base, z up; the table top is near z = 0). "
                f"An episode counts as a success if info['success'] is set at any step; episodes last "
                f"{max_episode_steps} steps. Fitness: the success rate over evaluation episodes."
            ),
            action_description=(
                "Box(4,) in [-1, 1]: the first three move the end effector by (dx, dy, dz) (scaled to at most "
                "1 cm per step), the fourth closes (+1) or opens (-1) the gripper."
            ),
            show_source=show_source,
            reward=reward,
        )

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        return float(bool(info.get("success", 0.0)))

    def check_available(self) -> None:
        for module in ("metaworld", "mujoco"):
            if importlib.util.find_spec(module) is None:
                raise UserError(
                    f"The task '{self.name}' needs the '{module}' package, which is not installed. "
                    'Install it with: pip install "llm4rl[metaworld]" (metaworld 3.1.1, which pins mujoco 3.3.0).'
                )

    def _make_single(self, seed: int | None = None) -> gym.Env:
        import metaworld  # noqa: F401 - registers the Meta-World/* ids

        env = gym.make(
            self.env_id,
            env_name=self.metaworld_name,
            seed=seed,
            max_episode_steps=self.max_episode_steps,
            terminate_on_success=self.terminate_on_success,
            disable_env_checker=True,
        )
        env = FloatObservation(
            SuccessInfo(self.reward_wrap(env), lambda terminated, info: bool(info.get("success", 0.0)))
        )
        # MetaWorld declares bounds its own observations leave (e.g. the goal slots)
        env.observation_space = gym.spaces.Box(-np.inf, np.inf, env.observation_space.shape, np.float32)
        return env

    def make_env(self, num_envs: int, seed: int, params: Any = None) -> gym.vector.VectorEnv:
        if params:
            raise UserError(f"The task '{self.name}' has no controllable params; got {params}.")
        self.check_available()
        # every copy gets its own seed so the copies sample different goals
        return vector_env(lambda i: self._make_single(seed + i), num_envs, seed)

    def fitness(self, episodes: list[Episode]) -> Fitness:
        return success_fitness(self.fitness_name, episodes)

    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """MetaWorld's scripted policy for the task (``metaworld.policies``), row by row; None if absent."""
        camel = "".join(part.capitalize() for part in self.metaworld_name.removesuffix("-v3").split("-"))
        try:
            import metaworld.policies as policies
        except ImportError:
            return None
        cls = getattr(policies, f"Sawyer{camel}V3Policy", None)
        if cls is None:
            return None
        scripted = cls()

        def act(obs: np.ndarray) -> np.ndarray:
            return np.stack([np.clip(scripted.get_action(row.astype(np.float64)), -1.0, 1.0) for row in obs]).astype(
                np.float32
            )

        return act


class Reach(MetaWorldTask):
    metaworld_name = "reach-v3"
    obj, obj2 = "puck (unused in this task)", "second object"
    task_goal = (
        "Move the gripper's fingertips (`fingertips_pos`, 4.5 cm below `hand_pos`) to the goal position "
        "`goal_pos`; success when `fingertips_goal_distance` <= 0.05 m."
    )
    derived = (
        FINGERTIPS,
        _success_distance(
            "fingertips_goal_distance", "distance from fingertips_pos to goal_pos", fingertips_goal_distance, 0.05
        ),
    )


class Push(MetaWorldTask):
    metaworld_name = "push-v3"
    obj = "puck"
    task_goal = (
        "Push the puck (`obj_pos`) across the table to the goal position `goal_pos`; success when "
        "`obj_goal_distance` <= 0.05 m."
    )
    derived = (
        FINGERTIPS,
        TO_OBJ,
        _success_distance("obj_goal_distance", "distance from obj_pos to goal_pos", obj_goal_distance, 0.05),
    )


class PickPlace(MetaWorldTask):
    metaworld_name = "pick-place-v3"
    obj = "puck"
    task_goal = (
        "Grasp the puck (`obj_pos`), lift it and place it at the goal position `goal_pos`, which may be in the "
        "air; success when `obj_goal_distance` <= 0.07 m."
    )
    derived = (
        FINGERTIPS,
        TO_OBJ,
        _success_distance("obj_goal_distance", "distance from obj_pos to goal_pos", obj_goal_distance, 0.07),
    )


class DoorOpen(MetaWorldTask):
    metaworld_name = "door-open-v3"
    obj = "door handle"
    task_goal = (
        "Open the door by pulling its handle (`obj_pos`) around the hinge until the handle's x coordinate is "
        "within 8 cm of the goal's: success when `obj_goal_x_distance` <= 0.08 m."
    )
    derived = (
        FINGERTIPS,
        TO_OBJ,
        _success_distance("obj_goal_x_distance", "|x of obj_pos - x of goal_pos|", obj_goal_x_distance, 0.08),
    )


class DrawerOpen(MetaWorldTask):
    metaworld_name = "drawer-open-v3"
    obj = "drawer handle"
    task_goal = (
        "Pull the drawer open by its handle (`obj_pos`) until the handle reaches `goal_pos`; success when "
        "`obj_goal_distance` <= 0.03 m."
    )
    derived = (
        FINGERTIPS,
        TO_OBJ,
        _success_distance("obj_goal_distance", "distance from obj_pos to goal_pos", obj_goal_distance, 0.03),
    )


class ButtonPress(MetaWorldTask):
    metaworld_name = "button-press-v3"
    obj = "button"
    task_goal = (
        "Press the button (`obj_pos`) in along its axis (y) with the gripper until its y coordinate reaches "
        "the goal's: success when `obj_goal_y_distance` <= 0.02 m."
    )
    derived = (
        FINGERTIPS,
        TO_OBJ,
        _success_distance("obj_goal_y_distance", "|y of obj_pos - y of goal_pos|", obj_goal_y_distance, 0.02),
    )
