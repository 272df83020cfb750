"""panda-gym 3.x tasks (Franka Panda on PyBullet, gymnasium API); fitness = success rate.

``env=panda_reach``, ``panda_push``, ``panda_pick_and_place`` make ``Panda<Task>-v3``
(``reward_type: sparse``) or ``Panda<Task>Dense-v3`` (``dense``: minus the distance of
the achieved goal to the desired one). The dict observation (``observation``,
``achieved_goal``, ``desired_goal``) is flattened in that order into named fields.
panda-gym ends an episode as soon as ``info["is_success"]`` holds; an episode counts as
a success when it was set at any step.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from core.envs.classic import SuccessInfo, success_fitness, vector_env
from core.envs.pybullet_grasp import quiet_native_output
from core.envs.task import DerivedField, StateField, Task
from core.errors import UserError
from core.records import Episode, Fitness

KEYS = ("observation", "achieved_goal", "desired_goal")

_EE = [
    ("ee_pos", 3, "position x, y, z of the end effector (between the fingertips)", "m"),
    ("ee_vel", 3, "velocity of the end effector", "m/s"),
]
_FINGERS = [("fingers_width", 1, "distance between the two fingers (0 closed, about 0.08 open)", "m")]
_OBJECT = [
    ("object_pos", 3, "position x, y, z of the object (a 4 cm cube) centre", "m"),
    ("object_rot", 3, "orientation of the object as Euler angles", "rad"),
    ("object_vel", 3, "linear velocity of the object", "m/s"),
    ("object_ang_vel", 3, "angular velocity of the object", "rad/s"),
]


def goal_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """panda-gym's own distance: achieved_goal to desired_goal."""
    return torch.linalg.vector_norm(s["achieved_goal"] - s["desired_goal"], dim=-1)


def ee_object_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(s["ee_pos"] - s["object_pos"], dim=-1)


_EE_TO_OBJECT = DerivedField("ee_object_distance", "distance from ee_pos to object_pos", ee_object_distance, "m")


class FlatGoalObservation(gym.ObservationWrapper):
    """Concatenate ``observation``, ``achieved_goal``, ``desired_goal`` into one float32 vector."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        size = sum(int(np.prod(env.observation_space[k].shape)) for k in KEYS)  # type: ignore[index, misc]
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (size,), np.float32)

    def observation(self, observation: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(observation[k], dtype=np.float32).ravel() for k in KEYS])


def panda_fields(robot: list[tuple[str, int, str, str]], achieved: str) -> list[StateField]:
    """Named slices: the robot (+ object) observation, then achieved and desired goal."""
    spec = robot + [
        ("achieved_goal", 3, achieved, "m"),
        ("desired_goal", 3, "target position x, y, z to bring the achieved goal to", "m"),
    ]
    fields, start = [], 0
    for name, size, text, unit in spec:
        fields.append(StateField(name, start, start + size, text, unit, (size,) if size > 1 else ()))
        start += size
    return fields


class PandaTask(Task):
    """A panda-gym 3.x task; subclasses set the task name, fields and goal text."""

    panda_name = ""  # Reach, Push, PickAndPlace
    robot_fields: list[tuple[str, int, str, str]] = []
    achieved_text = ""
    task_goal = ""
    ends_on_success = True  # reaching the goal terminates the episode
    actions = ""
    derived: tuple[DerivedField, ...] = ()

    def __init__(self, reward_type: str = "dense", control_type: str = "ee", max_episode_steps: int = 50) -> None:
        if reward_type not in ("dense", "sparse") or control_type not in ("ee", "joints"):
            raise UserError("panda tasks take reward_type: dense|sparse and control_type: ee|joints")
        self.reward_type, self.control_type = reward_type, control_type
        fields = panda_fields(self.robot_fields, self.achieved_text)
        names = ", ".join(f"{f.name} ({f.size})" for f in fields)
        computed = ", ".join(d.name for d in self.derived)
        super().__init__(
            name="panda_" + _snake(self.panda_name),
            goal=self.task_goal,
            state_fields=fields,
            description=(
                f"panda-gym {self.panda_name} (PyBullet): a Franka Panda arm on a table. {self.task_goal} "
                f"Observation ({len(fields)} fields, {fields[-1].stop} values, float32): {names}; {computed} "
                f"{'is' if len(self.derived) == 1 else 'are'} computed from them. Positions are in "
                "metres in the world frame (z up; the table top is at z = 0, the robot base at x = -0.6). "
                "The episode terminates as soon as achieved_goal is within 5 cm of desired_goal "
                f"(goal_distance < 0.05, success) and is truncated after {max_episode_steps} steps. "
                "Fitness: the success rate over evaluation episodes."
            ),
            action_description=self.actions
            if control_type == "ee"
            else "Box(7 or 8,) in [-1, 1]: joint target offsets (and finger width).",
            fitness_name="success_rate",
            max_episode_steps=max_episode_steps,
            derived_fields=list(self.derived),
        )

    @property
    def env_id(self) -> str:
        dense = "Dense" if self.reward_type == "dense" else ""
        joints = "Joints" if self.control_type == "joints" else ""
        return f"Panda{self.panda_name}{joints}{dense}-v3"

    def check_available(self) -> None:
        for module in ("panda_gym", "pybullet"):
            if importlib.util.find_spec(module) is None:
                raise UserError(
                    f"The task '{self.name}' needs the Python package '{module}', which is not installed. "
                    'Install it with: pip install "llm4rl[pybullet]" (panda-gym 3.0.7 and pybullet 3.2.7).'
                )

    def make_single(self) -> gym.Env:
        import panda_gym  # noqa: F401 - registers the Panda*-v3 ids

        with quiet_native_output():  # PyBullet prints its connection options
            env = gym.make(self.env_id, max_episode_steps=self.max_episode_steps, disable_env_checker=True)
        env = SuccessInfo(env, lambda terminated, info: bool(info.get("is_success", False)))
        return FlatGoalObservation(env)

    def make_env(self, num_envs: int, seed: int, params: Any = None) -> gym.vector.VectorEnv:
        if params:
            raise UserError(f"The task '{self.name}' has no controllable params; got {params}.")
        self.check_available()
        return vector_env(lambda i: self.make_single(), num_envs, seed)

    def fitness(self, episodes: list[Episode]) -> Fitness:
        return success_fitness(self.fitness_name, episodes)


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


_EE_ACTIONS = "Box(3,) in [-1, 1]: move the end effector by (dx, dy, dz), at most 5 cm per step."


class PandaReach(PandaTask):
    panda_name = "Reach"
    robot_fields = _EE
    achieved_text = "the achieved position: equal to ee_pos"
    task_goal = (
        "Move the end effector (`ee_pos`) to the target position `desired_goal`; success when `goal_distance` < 0.05 m."
    )
    actions = _EE_ACTIONS
    derived = (
        DerivedField(
            "goal_distance",
            "distance from achieved_goal (= ee_pos) to desired_goal; success when below 0.05",
            goal_distance,
            "m",
        ),
    )


class PandaPush(PandaTask):
    panda_name = "Push"
    robot_fields = _EE + _OBJECT
    achieved_text = "the achieved position: equal to object_pos"
    task_goal = (
        "Push the cube (`object_pos`) across the table to the target `desired_goal` (on the table) with the "
        "closed gripper; success when `goal_distance` < 0.05 m."
    )
    actions = _EE_ACTIONS + " The fingers stay closed."
    derived = (
        _EE_TO_OBJECT,
        DerivedField(
            "goal_distance",
            "distance from achieved_goal (= object_pos) to desired_goal; success when below 0.05",
            goal_distance,
            "m",
        ),
    )


class PandaPickAndPlace(PandaTask):
    panda_name = "PickAndPlace"
    robot_fields = _EE + _FINGERS + _OBJECT
    achieved_text = "the achieved position: equal to object_pos"
    task_goal = (
        "Grasp the cube (`object_pos`), lift it and carry it to the target `desired_goal` (on the table or "
        "in the air); success when `goal_distance` < 0.05 m."
    )
    derived = (
        _EE_TO_OBJECT,
        DerivedField(
            "goal_distance",
            "distance from achieved_goal (= object_pos) to desired_goal; success when below 0.05",
            goal_distance,
            "m",
        ),
    )
    actions = (
        "Box(4,) in [-1, 1]: move the end effector by (dx, dy, dz), at most 5 cm per step, and change the "
        "finger width (positive opens, negative closes)."
    )
