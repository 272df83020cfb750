"""MineDojo (real Minecraft) behind the optional ``[minedojo]`` extra.

MineDojo 0.1 needs ``gym==0.21``, ``numpy<2``, a JDK 8 and a Gradle build that
downloads Minecraft on first launch. :meth:`MineDojo.check_available` finds what is
missing before any env is made and says how to install it. The adapter turns a
MineDojo task (old gym API, dict observation, multi-discrete action) into a gymnasium
env with a flat float32 symbolic observation and a small discrete action set.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from typing import Any

import gymnasium as gym
import numpy as np

from core.envs.classic import vector_env
from core.envs.task import StateField, Task
from core.errors import UserError

INSTALL_RECIPE = (
    "MineDojo needs: (1) a JDK 8 on PATH (e.g. apt-get install openjdk-8-jdk; 'java -version' must report 1.8); "
    "(2) the package, built against the old gym: pip install setuptools==65.5.0 wheel==0.38.4 && "
    'pip install --no-build-isolation gym==0.21.0 && pip install "numpy<2" "llm4rl[minedojo]"; '
    "(3) network access on first launch, when MineDojo's Gradle build downloads Minecraft. "
    "Use env=minecraft (Crafter) for a Minecraft-like task that runs offline."
)

#: (name, MineDojo multi-discrete action): move/strafe, jump, camera pitch/yaw, functional
ACTIONS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("noop", (0, 0, 0, 12, 12, 0, 0, 0)),
    ("forward", (1, 0, 0, 12, 12, 0, 0, 0)),
    ("back", (2, 0, 0, 12, 12, 0, 0, 0)),
    ("left", (0, 1, 0, 12, 12, 0, 0, 0)),
    ("right", (0, 2, 0, 12, 12, 0, 0, 0)),
    ("jump_forward", (1, 0, 1, 12, 12, 0, 0, 0)),
    ("look_up", (0, 0, 0, 10, 12, 0, 0, 0)),
    ("look_down", (0, 0, 0, 14, 12, 0, 0, 0)),
    ("turn_left", (0, 0, 0, 12, 10, 0, 0, 0)),
    ("turn_right", (0, 0, 0, 12, 14, 0, 0, 0)),
    ("use", (0, 0, 0, 12, 12, 1, 0, 0)),
    ("attack", (0, 0, 0, 12, 12, 3, 0, 0)),
)
LIFE = ("life", "oxygen", "armor", "food", "saturation")
LOCATION = ("pos", "yaw", "pitch")
INVENTORY_SLOTS = 36


def java_version() -> str | None:
    """The version string ``java -version`` reports ("1.8.0_392"), or None without java."""
    java = shutil.which("java")
    if java is None:
        return None
    try:
        done = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'version "([^"]+)"', done.stderr + done.stdout)
    return match.group(1) if match else ""


def minedojo_fields() -> list[StateField]:
    fields, at = [], 0
    for name in LIFE:
        fields.append(StateField(name, at, at + 1, f"player {name} (from MineDojo's life stats)"))
        at += 1
    fields.append(StateField("position", at, at + 3, "player position x, y, z (y is height)", "blocks", (3,)))
    at += 3
    fields.append(StateField("yaw", at, at + 1, "horizontal view angle", "deg"))
    fields.append(StateField("pitch", at + 1, at + 2, "vertical view angle", "deg"))
    at += 2
    fields.append(
        StateField(
            "inventory_quantity",
            at,
            at + INVENTORY_SLOTS,
            "item count in each of the 36 inventory slots",
            "count",
            (INVENTORY_SLOTS,),
        )
    )
    return fields


class MineDojoEnv(gym.Env):
    """One MineDojo task through the gymnasium API with the symbolic observation."""

    def __init__(
        self, task_id: str, image_size: tuple[int, int], max_episode_steps: int, seed: int | None = None
    ) -> None:
        import minedojo

        self._env = minedojo.make(task_id=task_id, image_size=tuple(image_size), seed=seed)
        self._limit = max_episode_steps
        self._steps = 0
        size = minedojo_fields()[-1].stop
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (size,), np.float32)
        self.action_space = gym.spaces.Discrete(len(ACTIONS))

    @staticmethod
    def flatten(obs: dict[str, Any]) -> np.ndarray:
        life = obs.get("life_stats", {})
        location = obs.get("location_stats", {})
        parts = [np.asarray(life.get(k, 0.0), np.float32).reshape(-1)[:1] for k in LIFE]
        parts.append(np.asarray(location.get("pos", np.zeros(3)), np.float32).reshape(3))
        parts += [np.asarray(location.get(k, 0.0), np.float32).reshape(-1)[:1] for k in ("yaw", "pitch")]
        quantity = np.zeros(INVENTORY_SLOTS, np.float32)
        counts = np.asarray(obs.get("inventory", {}).get("quantity", []), np.float32).reshape(-1)[:INVENTORY_SLOTS]
        quantity[: len(counts)] = counts
        parts.append(quantity)
        return np.concatenate(parts).astype(np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._steps = 0
        return self.flatten(self._env.reset()), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, done, info = self._env.step(np.array(ACTIONS[int(action)][1]))
        self._steps += 1
        truncated = not done and self._steps >= self._limit
        out = {"success": bool(info.get("success", False))} if isinstance(info, dict) else {}
        return self.flatten(obs), float(reward), bool(done), truncated, out

    def close(self) -> None:
        self._env.close()


class MineDojo(Task):
    """A MineDojo task (``task_id``, e.g. ``harvest_wool_with_shears_and_sheep``); fitness = success rate."""

    def __init__(
        self,
        task_id: str = "harvest_milk",
        image_size: tuple[int, int] | list[int] = (160, 256),
        max_episode_steps: int = 1000,
    ) -> None:
        self.task_id = task_id
        self.image_size = tuple(image_size)
        fields = minedojo_fields()
        super().__init__(
            name="minedojo",
            goal=f"Complete the MineDojo task '{task_id}' in Minecraft.",
            state_fields=fields,
            description=(
                f"MineDojo task '{task_id}' (real Minecraft through MineDojo). Observation: a symbolic summary of "
                "MineDojo's dict observation: " + ", ".join(f.name for f in fields) + ". Episodes succeed when "
                "MineDojo's info['success'] is set. Fitness: the success rate."
            ),
            fitness_name="success_rate",
            max_episode_steps=max_episode_steps,
            action_description=f"Discrete({len(ACTIONS)}): "
            + ", ".join(f"{i} {name.replace('_', ' ')}" for i, (name, _) in enumerate(ACTIONS)),
        )

    def check_available(self) -> None:
        if importlib.util.find_spec("minedojo") is None:
            raise UserError(
                "The task 'minedojo' needs the 'minedojo' package, which is not installed. " + INSTALL_RECIPE
            )
        version = java_version()
        if version is None:
            raise UserError(
                "The task 'minedojo' needs a Java runtime (JDK 8), but 'java' was not found on PATH. " + INSTALL_RECIPE
            )
        if not (version.startswith("1.8") or version == "8" or version.startswith("8.")):
            raise UserError(
                f"The task 'minedojo' needs JDK 8, but 'java -version' reports {version or 'an unknown version'}. "
                + INSTALL_RECIPE
            )

    def make_env(self, num_envs: int, seed: int, params: Any = None) -> gym.vector.VectorEnv:
        self.check_available()
        if params:
            raise UserError(f"The task 'minedojo' has no controllable params; got {params}.")
        return vector_env(
            lambda i: MineDojoEnv(self.task_id, self.image_size, self.max_episode_steps, seed + i),  # type: ignore[arg-type]
            num_envs,
            seed,
        )

    def fitness(self, episodes: list[Any]) -> Any:
        from core.envs.classic import success_fitness

        return success_fitness(self.fitness_name, episodes)
