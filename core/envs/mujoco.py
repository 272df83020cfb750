"""MuJoCo locomotion (gymnasium v5): halfcheetah, hopper, ant, humanoid.

State fields name every joint position and velocity (the model's own joint names);
Ant and Humanoid add their per-body blocks (contact forces, inertia, velocities).
Fitness is the mean return; the mean forward velocity of each episode is logged too.
"""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from core.envs.classic import GymTask
from core.envs.task import DerivedField, StateField, ground_truth_return
from core.errors import UserError
from core.records import Episode, Fitness

_FREE_POS = ("x", "y", "z", "qw", "qx", "qy", "qz")
_FREE_VEL = ("vx", "vy", "vz", "wx", "wy", "wz")


def joint_fields(joints: list[tuple[str, str]], skip_positions: int) -> list[StateField]:
    """Fields for ``qpos[skip_positions:]`` followed by ``qvel``.

    ``joints`` lists (name, kind) in model order; kind is ``free``, ``slide`` or ``hinge``.
    A free joint contributes 7 positions (xyz + quaternion) and 6 velocities.
    """
    positions: list[tuple[str, str, str]] = []
    velocities: list[tuple[str, str, str]] = []
    for name, kind in joints:
        if kind == "free":
            for axis in _FREE_POS:
                unit = "m" if axis in "xyz" else ""
                positions.append(
                    (
                        f"{name}_{axis}",
                        unit,
                        f"{name} body {'position ' + axis if axis in 'xyz' else 'orientation quaternion ' + axis[1]} "
                        "in the world frame",
                    )
                )
            for axis in _FREE_VEL:
                unit = "m/s" if axis.startswith("v") else "rad/s"
                kind_text = "linear velocity" if axis.startswith("v") else "angular velocity"
                velocities.append((f"{name}_{axis}", unit, f"{name} body {kind_text} along {axis[1]}"))
        else:
            unit_pos, unit_vel = ("m", "m/s") if kind == "slide" else ("rad", "rad/s")
            words = re.sub(
                r"(?<=[a-z])(?=\d)", " ", name.replace("_", " ")
            )  # the joint's name in words (right shoulder 1)
            positions.append(
                (f"{name}_pos", unit_pos, f"{'position' if kind == 'slide' else 'angle'} of the {kind} joint {words}")
            )
            velocities.append((f"{name}_vel", unit_vel, f"velocity of the {kind} joint {words}"))
    fields = []
    for i, (name, unit, text) in enumerate(positions[skip_positions:] + velocities):
        fields.append(StateField(name, i, i + 1, text, unit))
    return fields


def torso_upright(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """The world z component of the torso's own z axis, from its quaternion ``root_qw .. root_qz``.

    ``(w^2 - x^2 - y^2 + z^2) / |q|^2``: 1 upright, 0 on its side, -1 upside down (0 for a zero quaternion).
    """
    w, x, y, z = s["root_qw"], s["root_qx"], s["root_qy"], s["root_qz"]
    norm = (w * w + x * x + y * y + z * z).clamp_min(1e-12)
    return (w * w - x * x - y * y + z * z) / norm


#: the torso's tilt, for the free-joint robots (Ant, Humanoid)
TORSO_UPRIGHT = DerivedField(
    "torso_upright",
    "cosine of the torso's tilt from vertical, from root_qw..root_qz: 1 upright, 0 on its side, -1 upside down",
    torso_upright,
)


def block(name: str, start: int, shape: tuple[int, ...], description: str, unit: str = "") -> StateField:
    """A multi-dimensional field starting at ``start``."""
    return StateField(name, start, start + int(np.prod(shape)), description, unit, shape)


class ForwardVelocityInfo(gym.Wrapper):
    """Add ``info["mean_forward_velocity"]``: the episode's mean ``x_velocity`` so far."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self._sum, self._count = 0.0, 0

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self._sum, self._count = 0.0, 0
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._sum += float(info.get("x_velocity", 0.0))
        self._count += 1
        info["mean_forward_velocity"] = self._sum / self._count
        return obs, reward, terminated, truncated, info


class MujocoTask(GymTask):
    """Base of the locomotion tasks: check for mujoco, log forward velocity."""

    requires = ("mujoco", "mujoco")
    sparse_text = (
        "+1 each time the torso first gets another whole metre forward of the origin (its x position, which "
        "the observation leaves out, reaches 1, 2, 3, ... m), 0 on every other step (no alive bonus, velocity or "
        "control terms)."
    )

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        metres = int(np.floor(float(info.get("x_position", 0.0))))
        gained = max(0, metres - episode.get("metres", 0))
        episode["metres"] = max(metres, episode.get("metres", 0))
        return float(gained)

    def check_available(self) -> None:
        import importlib.util

        if importlib.util.find_spec("mujoco") is None:
            raise UserError(
                f"The task '{self.name}' needs MuJoCo, which is not installed. "
                'Install it with: pip install "llm4rl[mujoco]"'
            )
        if importlib.util.find_spec("packaging") is None:
            raise UserError(
                f"The task '{self.name}' needs 'packaging' (gymnasium's MuJoCo module imports it): "
                'pip install "llm4rl[mujoco]"'
            )

    def wrap(self, env: gym.Env) -> gym.Env:
        return ForwardVelocityInfo(env)

    def episode_info(self, final_info: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
        _, info = super().episode_info(final_info)
        if "mean_forward_velocity" in final_info:
            info["mean_forward_velocity"] = float(final_info["mean_forward_velocity"])
        if "x_position" in final_info:
            info["final_x_position"] = float(final_info["x_position"])
        return None, info

    def fitness(self, episodes: list[Episode]) -> Fitness:
        value = float(np.mean([ground_truth_return(e) for e in episodes])) if episodes else float("nan")
        velocities = [e.info["mean_forward_velocity"] for e in episodes if "mean_forward_velocity" in e.info]
        details = {"mean_forward_velocity": float(np.mean(velocities))} if velocities else {}
        return Fitness(self.fitness_name, value, details)


_PLANAR_NOTE = (
    "rootx, rootz and rooty are the torso's slide (forward, up) and hinge (pitch) joints: rootx_vel is the "
    "torso's forward velocity and rooty_pos its pitch angle; the forward position (joint rootx) is left out of "
    "the observation, so the policy is position invariant."
)


class HalfCheetah(MujocoTask):
    """HalfCheetah-v5: run forward as fast as possible."""

    env_id = "HalfCheetah-v5"
    joints = [("rootx", "slide"), ("rootz", "slide"), ("rooty", "hinge")] + [
        (j, "hinge") for j in ("bthigh", "bshin", "bfoot", "fthigh", "fshin", "ffoot")
    ]

    def __init__(self, max_episode_steps: int = 1000, show_source: bool = False, reward: str = "human") -> None:
        super().__init__(
            name="halfcheetah",
            max_episode_steps=max_episode_steps,
            goal="Make the two-legged planar cheetah run forward (+x, `rootx_vel` > 0) as fast as possible.",
            state_fields=joint_fields(self.joints, skip_positions=1),
            description=(
                "HalfCheetah-v5 (gymnasium MuJoCo). A planar cheetah with a torso, a back leg (bthigh, bshin, "
                "bfoot) and a front leg (fthigh, fshin, ffoot). Observation (17 values): joint positions "
                "qpos[1:] then joint velocities qvel, named <joint>_pos and <joint>_vel. "
                + _PLANAR_NOTE
                + " rootz_pos is the torso's height relative to where it starts (0.7 m above the ground)."
                + f" No termination; truncated after {max_episode_steps} steps. Fitness: the env's own return, higher "
                "the faster the torso moves forward with little control effort; the mean forward velocity is logged."
            ),
            action_description=(
                "Box(6,) in [-1, 1]: torques on the back thigh, shin, foot and front thigh, shin, foot "
                "hinges (the joints of bthigh_pos, bshin_pos, bfoot_pos, fthigh_pos, fshin_pos, ffoot_pos)."
            ),
            show_source=show_source,
            reward=reward,
        )


class Hopper(MujocoTask):
    """Hopper-v5: hop forward without falling."""

    env_id = "Hopper-v5"
    ends_on_failure = True  # the episode terminates when the body is unhealthy (falls)
    joints = [
        ("rootx", "slide"),
        ("rootz", "slide"),
        ("rooty", "hinge"),
        ("thigh_joint", "hinge"),
        ("leg_joint", "hinge"),
        ("foot_joint", "hinge"),
    ]

    def __init__(self, max_episode_steps: int = 1000, show_source: bool = False, reward: str = "human") -> None:
        super().__init__(
            name="hopper",
            max_episode_steps=max_episode_steps,
            goal=(
                "Make the one-legged hopper hop forward (+x, `rootx_vel` > 0) as fast as possible without falling over "
                "(torso height `rootz_pos` above 0.7, pitch `rooty_pos` within +-0.2 rad)."
            ),
            state_fields=joint_fields(self.joints, skip_positions=1),
            description=(
                "Hopper-v5 (gymnasium MuJoCo). A planar one-legged robot: torso, thigh, leg, foot. Observation "
                "(11 values): qpos[1:] then qvel, named <joint>_pos and <joint>_vel. "
                + _PLANAR_NOTE
                + " rootz_pos is the torso's height above the ground (1.25 m at the start). "
                "The episode terminates when unhealthy: torso height rootz_pos <= 0.7, |rooty_pos| >= 0.2 rad, or "
                f"any other state value beyond +-100; truncated after {max_episode_steps} steps. Fitness: the env's "
                "own return, higher the longer the hopper stays healthy and the faster it moves forward, with "
                "little control effort."
            ),
            action_description=(
                "Box(3,) in [-1, 1]: torques on the thigh, leg and foot hinges (the joints of "
                "thigh_joint_pos, leg_joint_pos, foot_joint_pos)."
            ),
            show_source=show_source,
            reward=reward,
        )


def _body_names(kind: str) -> str:
    return {
        "ant": (
            "torso, front left leg, aux 1, front-left foot, front right leg, aux 2, front-right foot, "
            "back leg, aux 3, back-left foot, right back leg, aux 4, back-right foot"
        ),
        "humanoid": (
            "torso, lwaist, pelvis, right thigh, right shin, right foot, left thigh, left shin, left foot, "
            "right upper arm, right lower arm, left upper arm, left lower arm"
        ),
    }[kind]


class Ant(MujocoTask):
    """Ant-v5: walk forward with the four-legged ant."""

    env_id = "Ant-v5"
    ends_on_failure = True  # the episode terminates when the body is unhealthy (falls)
    derived = (TORSO_UPRIGHT,)
    joints = [("root", "free")] + [(f"{p}_{i}", "hinge") for i in range(1, 5) for p in ("hip", "ankle")]

    def __init__(self, max_episode_steps: int = 1000, show_source: bool = False, reward: str = "human") -> None:
        fields = joint_fields(self.joints, skip_positions=2)
        fields.append(
            block(
                "contact_forces",
                fields[-1].stop,
                (13, 6),
                (
                    "external contact force and torque (6 values) on each body except the world: "
                    f"{_body_names('ant')}; clipped to [-1, 1]"
                ),
                "N",
            )
        )
        super().__init__(
            name="ant",
            max_episode_steps=max_episode_steps,
            goal=(
                "Make the four-legged ant walk forward (+x, `root_vx` > 0) as fast as possible without flipping over "
                "(`torso_upright` near 1, torso height `root_z` within [0.2, 1.0])."
            ),
            state_fields=fields,
            description=(
                "Ant-v5 (gymnasium MuJoCo). A torso with four legs; each leg has a hip and an ankle hinge, whose "
                "angles are hip_1_pos/ankle_1_pos (front left), hip_2_pos/ankle_2_pos (front right), "
                "hip_3_pos/ankle_3_pos (back left), hip_4_pos/ankle_4_pos (back right). Observation (105 values): "
                "qpos[2:] (root_z torso height, root_qw..root_qz torso orientation quaternion, 8 joint angles), "
                "qvel (root_vx..root_wz torso linear and angular velocity in the world frame, root_vx forward; 8 "
                "joint velocities), then contact_forces (13 bodies x 6); torso_upright is computed from the "
                "quaternion. The torso x, y position is left out. The episode terminates when root_z leaves "
                f"[0.2, 1.0]; truncated after {max_episode_steps} steps. Fitness: the env's own return, higher the "
                "longer the ant stays upright and the faster it moves forward, with little control effort and few "
                "hard contacts."
            ),
            action_description=(
                "Box(8,) in [-1, 1]: torques, in the model's actuator order, on the hinges of hip_4_pos, "
                "ankle_4_pos, hip_1_pos, ankle_1_pos, hip_2_pos, ankle_2_pos, hip_3_pos, ankle_3_pos."
            ),
            show_source=show_source,
            reward=reward,
        )


class Humanoid(MujocoTask):
    """Humanoid-v5: walk forward without falling."""

    env_id = "Humanoid-v5"
    ends_on_failure = True  # the episode terminates when the body is unhealthy (falls)
    derived = (TORSO_UPRIGHT,)
    joints = [("root", "free")] + [
        (j, "hinge")
        for j in (
            "abdomen_z",
            "abdomen_y",
            "abdomen_x",
            "right_hip_x",
            "right_hip_z",
            "right_hip_y",
            "right_knee",
            "left_hip_x",
            "left_hip_z",
            "left_hip_y",
            "left_knee",
            "right_shoulder1",
            "right_shoulder2",
            "right_elbow",
            "left_shoulder1",
            "left_shoulder2",
            "left_elbow",
        )
    ]

    def __init__(self, max_episode_steps: int = 1000, show_source: bool = False, reward: str = "human") -> None:
        fields = joint_fields(self.joints, skip_positions=2)
        bodies = _body_names("humanoid")
        start = fields[-1].stop
        for name, shape, text, unit in (
            ("body_inertia", (13, 10), f"mass and inertia of each body (com-based), bodies: {bodies}", ""),
            ("body_velocity", (13, 6), f"com-based angular and linear velocity of each body: {bodies}", ""),
            ("actuator_forces", (17,), "generalised actuator forces on the 17 hinge joints, in joint order", "N"),
            ("contact_forces", (13, 6), f"external contact force and torque on each body: {bodies}", "N"),
        ):
            fields.append(block(name, start, shape, text, unit))
            start = fields[-1].stop
        super().__init__(
            name="humanoid",
            max_episode_steps=max_episode_steps,
            goal=(
                "Make the humanoid walk forward (+x, `root_vx` > 0) as fast as possible without falling (torso height "
                "`root_z` within [1.0, 2.0], `torso_upright` near 1)."
            ),
            state_fields=fields,
            description=(
                "Humanoid-v5 (gymnasium MuJoCo). A 3D bipedal robot with 17 hinge joints (abdomen, hips, knees, "
                "shoulders, elbows). Observation (348 values): qpos[2:] (root_z torso height, root_qw..root_qz "
                "orientation quaternion, 17 joint angles <joint>_pos), qvel (root_vx..root_wz torso linear and "
                "angular velocity in the world frame, root_vx forward; 17 joint velocities <joint>_vel), then "
                "body_inertia (13x10), body_velocity (13x6), actuator_forces (17) and contact_forces (13x6); "
                "torso_upright is computed from the quaternion. The torso x, y position is left out. The episode "
                f"terminates when root_z leaves [1.0, 2.0]; truncated after {max_episode_steps} steps. Fitness: the "
                "env's own return, higher the longer the humanoid stays up and the faster its centre of mass moves "
                "forward (the observation has no centre-of-mass velocity; root_vx is the torso's), with little "
                "control effort."
            ),
            action_description="Box(17,) in [-0.4, 0.4]: torques, in actuator order, on the hinges of "
            + ", ".join(
                f"{j}_pos"
                for j in (
                    "abdomen_y",
                    "abdomen_z",
                    "abdomen_x",
                    "right_hip_x",
                    "right_hip_z",
                    "right_hip_y",
                    "right_knee",
                    "left_hip_x",
                    "left_hip_z",
                    "left_hip_y",
                    "left_knee",
                    "right_shoulder1",
                    "right_shoulder2",
                    "right_elbow",
                    "left_shoulder1",
                    "left_shoulder2",
                    "left_elbow",
                )
            )
            + ".",
            show_source=show_source,
            reward=reward,
        )
