"""PyBullet's Kuka grasping env (``KukaGymEnv``) as a task; fitness = grasp success rate.

The env is PyBullet's own ``pybullet_envs.bullet.kukaGymEnv.KukaGymEnv``, adapted rather
than rewritten. Three things stand in its way and are worked around here:

- ``pybullet_envs/__init__.py`` breaks on gym 0.26 (``registry.env_specs``), so the two
  modules needed (``kuka.py``, ``kukaGymEnv.py``) are loaded from their files under a
  private package name, without that ``__init__``.
- The env calls the module-level ``pybullet`` API, i.e. one shared physics server per
  process. Each env copy gets its own copy of the two modules whose ``p`` is a
  :class:`BulletClient` bound to a private DIRECT server (and whose ``random`` is a
  seeded ``random.Random``), so several copies step side by side in one vector env.
- It speaks the old gym API (4-tuple steps, no seeding of its block placement);
  :class:`KukaGraspEnv` speaks gymnasium's.

The agent moves the gripper in x/y and turns it while the arm descends by itself; when the
gripper touches the tray the env closes the fingers and lifts by itself (up to 1,100
physics steps inside that one env step).

The original ``step`` lowers the arm's inverse-kinematics target 2 mm per physics step
(0.48 m/s). The arm follows at about 1 mm per step at best, so within ~200 steps the
target is tens of centimetres below the arm and below the tray; the IK solution for that
unreachable target swings the gripper 10-30 cm off in x-y and the fingers hit the tray
at speed. With that descent no policy reaches the block: a scripted controller that reads
the block position and steers onto it closed 17-38 cm from it in every episode. (The
same trajectories come out of the original env on the module-level ``pybullet`` server,
so this is the env's own dynamics, not the per-copy client.) The adapter therefore builds
the env's low-level action ``[dx, dy, dz, da, finger]`` itself and calls the env's own
``step2`` (as PyBullet's ``kukaGymEnvTest.py`` does): ``dx, dy, da`` are the original
scaling of the agent's action; ``dz`` is ``descent`` while the arm is high and
``approach_descent`` below ``approach_z``, and the target is never let more than
``max_lead`` below the arm. With the defaults a scripted controller grasps most blocks. The
adapter then holds the block for ``hold_steps`` physics steps, records facts about the
episode (closest approach, how far
the gripper was from the block when it closed, highest and final block height) and
classifies each evaluation episode into a failure mode (:func:`classify_episode`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import math
import os
import random
import sys
import types
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import gymnasium as gym
import numpy as np
import torch

from core.envs.classic import success_fitness, vector_env
from core.envs.task import DerivedField, StateField, Task
from core.errors import UserError
from core.records import Episode, Fitness

#: world z of the table top (from the table's collision box; the tray floor is ~3 cm higher)
TABLE_TOP_Z = -0.194
#: the original env's success test: block centre above this world z (its reward's +10000)
SUCCESS_Z = 0.2
#: a block lifted less than this above where it rested was never picked up (m)
LIFT_EPS = 0.02
#: the gripper closed farther than this from the block centre in x-y: it never reached it (m)
REACH_TOL = 0.05
_FINGER_A, _FINGER_B = 8, 11  # finger joints of kuka_with_gripper2.sdf
_TIPS = (10, 13)  # finger-tip links

# failure modes, in the order they are reported: key -> text shown to the LLM
FAILURE_MODES: dict[str, str] = {
    "timed_out": "timed out: the gripper never descended to the tray, so no grasp was attempted",
    "never_reached": "never reached the block: the fingertips closed more than 5 cm (x-y) away from it",
    "missed_grasp": "missed the grasp: the gripper closed near the block but the block never left the tray",
    "slipped": "grasp slipped: the block rose a little, then slid out of the fingers before the success height",
    "dropped": "dropped after lift: the block was lifted above the success height, then fell during the hold",
    "success": "success: the block was lifted above the success height and held",
}


# -------------------------------------------------------------------------------------
# Loading the original env
# -------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_native_output() -> Iterator[None]:
    """Silence stdout/stderr at the file-descriptor level (PyBullet's C code prints)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


class BulletClient:
    """The ``pybullet`` module API bound to one private DIRECT physics server.

    Functions are bound with ``physicsClientId`` on first use and cached. ``loadURDF``
    also takes the legacy positional form ``(file, x, y, z, qx, qy, qz, qw)`` the env
    uses; ``connect`` is a no-op (the server exists already) and ``disconnect`` is
    idempotent. ``on_step`` (if set) is called after every ``stepSimulation``, so that
    the block can be watched during the env's internal grasp-and-lift loop.
    """

    def __init__(self) -> None:
        import pybullet

        self._pb = pybullet
        self.client_id = pybullet.connect(pybullet.DIRECT)
        self.on_step: Any = None

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._pb, name)
        if callable(attribute):
            attribute = functools.partial(attribute, physicsClientId=self.client_id)
            setattr(self, name, attribute)  # later lookups skip __getattr__
        return attribute

    def loadURDF(self, path: str, *args: Any, **kwargs: Any) -> int:  # pybullet's name
        if len(args) > 2:  # legacy form: x, y, z[, qx, qy, qz, qw]
            args = (list(args[:3]), list(args[3:7]) or [0.0, 0.0, 0.0, 1.0])
        return self._pb.loadURDF(path, *args, physicsClientId=self.client_id, **kwargs)

    def stepSimulation(self) -> None:  # pybullet's name
        self._pb.stepSimulation(physicsClientId=self.client_id)
        if self.on_step is not None:
            self.on_step()

    def connect(self, *args: Any, **kwargs: Any) -> int:
        return self.client_id

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        if self.client_id >= 0 and self._pb.isConnected(self.client_id):
            self._pb.disconnect(physicsClientId=self.client_id)
        self.client_id = -1


def _load_module(name: str, path: str, package: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_COPIES = 0


def load_kuka_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """A fresh copy of ``(kuka, kukaGymEnv)`` from ``pybullet_envs/bullet``, skipping its ``__init__``.

    Each call gives new module objects, so each env can bind its own client to ``p``.
    """
    global _COPIES
    spec = importlib.util.find_spec("pybullet_envs")
    if spec is None or spec.origin is None:
        raise UserError('env=kuka_grasp needs pybullet. Install it with: pip install "llm4rl[pybullet]"')
    folder = os.path.join(os.path.dirname(spec.origin), "bullet")
    _COPIES += 1
    package = f"_llm4rl_kuka{_COPIES}"
    pkg = types.ModuleType(package)
    pkg.__path__ = [folder]
    sys.modules[package] = pkg
    saved_path = list(sys.path)  # both modules prepend their folders to sys.path
    stub = None
    if importlib.util.find_spec("pkg_resources") is None:
        # kukaGymEnv imports parse_version from pkg_resources, gone from new setuptools
        from packaging.version import parse

        stub = types.ModuleType("pkg_resources")
        stub.parse_version = parse  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = stub
    try:
        with quiet_native_output():  # the module prints its folder; gym warns about NumPy 2
            kuka = _load_module(f"{package}.kuka", os.path.join(folder, "kuka.py"), package)
            gym_env = _load_module(f"{package}.kukaGymEnv", os.path.join(folder, "kukaGymEnv.py"), package)
    finally:
        sys.path[:] = saved_path
        if stub is not None and sys.modules.get("pkg_resources") is stub:
            del sys.modules["pkg_resources"]
        for name in (package, f"{package}.kuka", f"{package}.kukaGymEnv"):
            sys.modules.pop(name, None)  # the env keeps its own references
    return kuka, gym_env


# -------------------------------------------------------------------------------------
# The gymnasium env
# -------------------------------------------------------------------------------------

#: the original env's action scaling (``KukaGymEnv.step``): metres and radians per unit action
MOVE_SCALE, TURN_SCALE, FINGER_OPEN = 0.005, 0.05, 0.3


@dataclass(frozen=True)
class Descent:
    """How the arm's IK target descends each step (the original: 2 mm always, unbounded)."""

    descent: float = 0.002  #: m per step while the arm is high (the original's rate)
    approach_descent: float = 0.0005  #: m per step once the arm is below ``approach_z``
    approach_z: float = 0.2  #: world z of the arm's end link (link 6) where the slow approach starts
    max_lead: float = 0.1  #: the target never gets more than this far below the arm (m)

    def target_z(self, target: float, arm: float) -> float:
        """The next IK target height given the current target and the arm's actual height."""
        step = self.descent if arm >= self.approach_z else self.approach_descent
        return max(target - step, arm - self.max_lead)


class KukaGraspEnv(gym.Env):
    """One ``KukaGymEnv`` behind the gymnasium API, with named extra state and episode facts.

    Observation (17 float32): the env's own 9 values (gripper position and Euler angles,
    block x-y and yaw in the gripper frame), then block position (3), block height above
    the table (1), gripper opening (1) and the fingertips' mean position (3) (the gripper
    base is ~0.22 m above the tips and tilts, so only the tips say where the grasp lands).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        max_episode_steps: int = 1000,
        hold_steps: int = 60,
        seed: int | None = None,
        descent: Descent | None = None,
    ) -> None:
        self.max_episode_steps = int(max_episode_steps)
        self.hold_steps = int(hold_steps)
        self.descent = descent or Descent()
        kuka, module = load_kuka_modules()
        self.client = BulletClient()
        self._rng = random.Random(seed)
        for m in (kuka, module):
            m.p = self.client  # type: ignore[attr-defined]
        module.random = self._rng  # type: ignore[attr-defined]  # block placement draws from it
        module.print = lambda *a, **k: None  # type: ignore[attr-defined]  # "successfully grasped a block!!!"
        module.kuka = kuka  # type: ignore[attr-defined]
        # the env's own step counter ends episodes after maxSteps; the time limit is ours
        with warnings.catch_warnings():  # gym warns that its float64 Box bounds become float32
            warnings.simplefilter("ignore")
            self.env = module.KukaGymEnv(renders=False, isDiscrete=False, maxSteps=self.max_episode_steps + 10)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (17,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self._steps = 0
        self._facts: dict[str, float] = {}

    # -- state ------------------------------------------------------------------------
    def _block_pos(self) -> np.ndarray:
        return np.asarray(self.client.getBasePositionAndOrientation(self.env.blockUid)[0], dtype=np.float64)

    def _fingertips(self) -> np.ndarray:
        uid = self.env._kuka.kukaUid
        return np.mean([self.client.getLinkState(uid, i)[0] for i in _TIPS], axis=0)

    def _opening(self) -> float:
        uid = self.env._kuka.kukaUid
        a = self.client.getJointState(uid, _FINGER_A)[0]
        b = self.client.getJointState(uid, _FINGER_B)[0]
        return float((b - a) / 2.0)

    def _observe(self, native: Any) -> np.ndarray:
        block = self._block_pos()
        extra = [*block, block[2] - TABLE_TOP_Z, self._opening(), *self._fingertips()]
        return np.asarray([*list(native)[:9], *extra], dtype=np.float32)

    def _watch_block(self) -> None:
        if not self.env.terminated:  # only the grasp-and-lift loop can raise the block
            return
        self._facts["max_block_height"] = max(
            self._facts["max_block_height"], float(self._block_pos()[2] - TABLE_TOP_Z)
        )

    def _xy_distance(self) -> float:
        return float(np.linalg.norm(self._fingertips()[:2] - self._block_pos()[:2]))

    # -- gymnasium API ----------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self._rng.seed(seed)
        self.client.on_step = None
        native = self.env.reset()
        self._steps = 0
        rest = float(self._block_pos()[2] - TABLE_TOP_Z)
        self._facts = {"rest_height": rest, "max_block_height": rest, "min_xy_distance": self._xy_distance()}
        return self._observe(native), {}

    def _low_level(self, action: np.ndarray) -> list[float]:
        """The env's ``[dx, dy, dz, da, finger]`` for an agent action, with the bounded descent.

        ``applyAction`` adds ``dz`` to the target, so ``dz`` is the gap to the next target height.
        """
        kuka = self.env._kuka
        arm_z = float(self.client.getLinkState(kuka.kukaUid, kuka.kukaEndEffectorIndex)[0][2])
        target_z = float(kuka.endEffectorPos[2])
        dz = self.descent.target_z(target_z, arm_z) - target_z
        return [
            float(action[0]) * MOVE_SCALE,
            float(action[1]) * MOVE_SCALE,
            dz,
            float(action[2]) * TURN_SCALE,
            FINGER_OPEN,
        ]

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        action = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        xy_before = self._xy_distance()  # where the gripper is if this step starts the grasp
        self.client.on_step = self._watch_block
        native, reward, done, _ = self.env.step2(self._low_level(action))
        self._steps += 1
        facts = self._facts
        attempted = bool(self.env.terminated)
        if attempted:
            facts["grasp_xy_distance"] = xy_before
            for _ in range(self.hold_steps):  # keep the fingers closed and the arm still
                self.env._kuka.applyAction([0.0, 0.0, 0.0, 0.0, 0.0])
                self.client.stepSimulation()
            native = self.env.getExtendedObservation()
        self.client.on_step = None
        facts["min_xy_distance"] = min(facts["min_xy_distance"], self._xy_distance())
        if not attempted:  # the block settles from where it was dropped at reset
            facts["rest_height"] = facts["max_block_height"] = float(self._block_pos()[2] - TABLE_TOP_Z)
        obs = self._observe(native)
        terminated = attempted
        truncated = not terminated and (bool(done) or self._steps >= self.max_episode_steps)
        final_height = float(obs[12])
        info = {
            "success": bool(terminated and final_height > SUCCESS_Z - TABLE_TOP_Z),
            "grasp_attempted": attempted,
            "final_block_height": final_height,
            **facts,
        }
        return obs, float(reward), terminated, truncated, info

    def close(self) -> None:
        self.client.disconnect()


# -------------------------------------------------------------------------------------
# Failure modes
# -------------------------------------------------------------------------------------


def classify_episode(info: dict[str, Any]) -> str:
    """The failure mode (a key of :data:`FAILURE_MODES`) of one episode's facts."""
    threshold = SUCCESS_Z - TABLE_TOP_Z
    if info.get("success"):
        return "success"
    if not info.get("grasp_attempted"):
        return "timed_out"
    if float(info.get("grasp_xy_distance", math.inf)) > REACH_TOL:
        return "never_reached"
    rise = float(info.get("max_block_height", 0.0)) - float(info.get("rest_height", 0.0))
    if rise < LIFT_EPS:
        return "missed_grasp"
    if float(info.get("max_block_height", 0.0)) > threshold:
        return "dropped"
    return "slipped"


def summarize_failures(infos: list[dict[str, Any]]) -> str:
    """Counts of each mode over episodes, with the numbers that explain them, as text."""
    if not infos:
        return ""
    modes = [classify_episode(i) for i in infos]
    counts = Counter(modes)
    lines = [f"Outcome of {len(infos)} evaluation episodes:"]
    for key, text in FAILURE_MODES.items():
        if counts[key]:
            lines.append(f"- {counts[key]}/{len(infos)} {text}")
    reached = [i["grasp_xy_distance"] for i in infos if "grasp_xy_distance" in i]
    if reached:
        lines.append(
            "Fingertip-to-block x-y distance when the gripper closed: "
            f"mean {np.mean(reached):.3f} m, min {np.min(reached):.3f} m."
        )
    rises = [float(i.get("max_block_height", 0.0)) - float(i.get("rest_height", 0.0)) for i in infos]
    lines.append(
        f"Highest block lift: mean {np.mean(rises):.3f} m, max {np.max(rises):.3f} m "
        f"(success needs {SUCCESS_Z - TABLE_TOP_Z - float(np.mean([i.get('rest_height', 0.0) for i in infos])):.2f} m)."
    )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------
# The task
# -------------------------------------------------------------------------------------

#: names of the per-episode facts copied from the last step's info into Episode.info
EPISODE_FACTS = (
    "grasp_attempted",
    "grasp_xy_distance",
    "min_xy_distance",
    "rest_height",
    "max_block_height",
    "final_block_height",
)


def kuka_fields() -> list[StateField]:
    """The 17 observation values of :class:`KukaGraspEnv`."""
    spec = [
        (
            "gripper_pos",
            3,
            "position x, y, z of the gripper base (world frame; the fingertips are ~0.25 m below it)",
            "m",
        ),
        ("gripper_euler", 3, "orientation of the gripper as roll, pitch, yaw Euler angles", "rad"),
        (
            "block_rel_xy",
            2,
            "x, y position of the block in the gripper's frame: (0, 0) means the gripper is right above it",
            "m",
        ),
        (
            "block_rel_yaw",
            1,
            "yaw of the block relative to the gripper (fingers align with the block's short side near 0 or pi)",
            "rad",
        ),
        ("block_pos", 3, "position x, y, z of the block centre (world frame)", "m"),
        (
            "block_height",
            1,
            (
                "height of the block centre above the table top; about 0.019 at rest in the tray, "
                f"success above {SUCCESS_Z - TABLE_TOP_Z:.3f}"
            ),
            "m",
        ),
        (
            "gripper_opening",
            1,
            (
                "finger opening angle: about 0.3 open (the agent's whole approach), "
                "0 closed (during the env's automatic grasp)"
            ),
            "rad",
        ),
        (
            "fingertips_pos",
            3,
            (
                "mean position x, y, z of the two fingertips (world frame): "
                "the grasp lands where these are when the gripper reaches the tray"
            ),
            "m",
        ),
    ]
    fields, start = [], 0
    for name, size, text, unit in spec:
        if size > 1:  # small models index the batch dimension by mistake (block_pos[2])
            text += f"; a [B, {size}] tensor whose values, in the order named, are " + ", ".join(
                f"[:, {i}]" for i in range(size)
            )
        fields.append(StateField(name, start, start + size, text, unit, (size,) if size > 1 else ()))
        start += size
    return fields


def fingertips_block_xy_distance(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """Horizontal distance of the fingertips' mean position from the block centre (what :data:`REACH_TOL` judges)."""
    return torch.linalg.vector_norm(s["fingertips_pos"][..., :2] - s["block_pos"][..., :2], dim=-1)


def fingertips_height(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """Height of the fingertips' mean position above the table top (the reference of ``block_height``)."""
    return s["fingertips_pos"][..., 2] - TABLE_TOP_Z


def kuka_derived() -> list[DerivedField]:
    return [
        DerivedField(
            "fingertips_block_xy_distance",
            "x-y distance from fingertips_pos to block_pos: 0 right above "
            f"the block; a grasp that closes beyond {REACH_TOL:g} misses it",
            fingertips_block_xy_distance,
            "m",
        ),
        DerivedField(
            "fingertips_height",
            "height of fingertips_pos above the table top, as block_height is; about "
            "0.05 when the gripper reaches the tray",
            fingertips_height,
            "m",
        ),
    ]


class KukaGrasp(Task):
    """Kuka iiwa with a two-finger gripper picks up a block from a tray (PyBullet)."""

    def __init__(
        self,
        max_episode_steps: int = 1000,
        hold_steps: int = 60,
        descent: float = 0.002,
        approach_descent: float = 0.0005,
        approach_z: float = 0.2,
        max_lead: float = 0.1,
    ) -> None:
        self.hold_steps = int(hold_steps)
        self.descent = Descent(float(descent), float(approach_descent), float(approach_z), float(max_lead))
        threshold = SUCCESS_Z - TABLE_TOP_Z
        super().__init__(
            name="kuka_grasp",
            goal=(
                "Pick up the block with the Kuka arm's gripper and lift it: steer the descending gripper so that "
                "its fingertips are right above the block (`fingertips_block_xy_distance` near 0) and turned to fit "
                "it (`block_rel_yaw` near 0 or pi) when it reaches the tray, so that the automatic grasp lifts the "
                f"block above `block_height` {threshold:.3f} m and holds it."
            ),
            state_fields=kuka_fields(),
            description=(
                "PyBullet KukaGymEnv: a Kuka iiwa arm with a two-finger gripper above a tray on a table; a block "
                "(10 x 4 x 4 cm) lies at a random position and yaw in the tray. Positions are metres in the world "
                "frame (z up; the table top is at z = -0.194). Observation (17 values, float32): gripper_pos (3), "
                "gripper_euler (3), block_rel_xy (2), block_rel_yaw (1) (these 9 are the env's own observation), "
                "then block_pos (3), block_height (1), gripper_opening (1) and fingertips_pos (3); "
                "fingertips_block_xy_distance and fingertips_height are computed from them. Each step the gripper "
                "moves by (dx, dy) and turns, while the arm descends by itself (quickly while high, slowly over the "
                "last ~25 cm). When the gripper touches the tray (after roughly 500 steps) the env closes the "
                "fingers and lifts the arm on its own within that one step, then holds the block; the episode ends "
                f"there (terminated) or after {max_episode_steps} steps (truncated). An episode is a success if "
                f"block_height > {threshold:.3f} m at its end. Fitness: the success rate over evaluation episodes. "
                "Evaluation episodes are classified as success, timed out, never reached the block, missed the "
                "grasp, grasp slipped or dropped after lift."
            ),
            action_description=(
                "Box(3,) in [-1, 1]: move the gripper by 5 mm x action[0] in x and 5 mm x action[1] in y, and "
                "turn it by 0.05 rad x action[2]. The descent and the grasp are automatic."
            ),
            fitness_name="success_rate",
            max_episode_steps=max_episode_steps,
            derived_fields=kuka_derived(),
        )

    def check_available(self) -> None:
        for module, package in (("pybullet", "pybullet"), ("gym", "gym (0.26.2)")):
            if importlib.util.find_spec(module) is None:
                raise UserError(
                    f"The task 'kuka_grasp' needs the Python package {package}, which is not installed. "
                    'Install it with: pip install "llm4rl[pybullet]" (pybullet 3.2.7 and gym 0.26.2).'
                )

    def make_single(self, seed: int | None = None) -> KukaGraspEnv:
        return KukaGraspEnv(self.max_episode_steps, self.hold_steps, seed=seed, descent=self.descent)

    def make_env(self, num_envs: int, seed: int, params: Any = None) -> gym.vector.VectorEnv:
        if params:
            raise UserError(f"The task '{self.name}' has no controllable params; got {params}.")
        self.check_available()
        return vector_env(lambda i: self.make_single(seed + i), num_envs, seed)

    def episode_info(self, final_info: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
        facts = {k: _plain(final_info[k]) for k in EPISODE_FACTS if k in final_info}
        facts["failure_mode"] = classify_episode({**facts, "success": bool(final_info.get("success", False))})
        return bool(final_info.get("success", False)), facts

    def fitness(self, episodes: list[Episode]) -> Fitness:
        fit = success_fitness(self.fitness_name, episodes)
        modes = Counter(e.info.get("failure_mode", "unknown") for e in episodes)
        for key in FAILURE_MODES:
            fit.details[f"mode_{key}"] = modes[key] / max(1, len(episodes))
        return fit

    def failure_modes(self, episodes: list[Episode]) -> str:
        """Failure-mode summary of evaluation episodes, for the LLM's feedback."""
        infos = [{**e.info, "success": bool(e.success)} for e in episodes if "rest_height" in e.info]
        return summarize_failures(infos)


def _plain(value: Any) -> Any:
    """A numpy scalar as a Python one (episode info is logged and pickled)."""
    return (
        value.item() if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0) else value
    )
