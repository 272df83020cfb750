"""Gymnasium classic-control and Box2D tasks, and ``gym``: any gymnasium id as a task.

:class:`GymTask` is the building block the other gymnasium-backed families
(:mod:`core.envs.mujoco`, :mod:`core.envs.metaworld`) reuse: it makes a
``SyncVectorEnv`` in SAME_STEP autoreset mode over ``gymnasium.make(id)`` with a flat
float32 observation, and adds episode-level info (success flags) through small wrappers.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from types import SimpleNamespace
from typing import Any, Callable, cast

import gymnasium as gym
import numpy as np
import torch

from core.envs.task import DerivedField, StateField, Task, ground_truth_return
from core.errors import UserError
from core.records import Episode, Fitness

# -------------------------------------------------------------------------------------
# Wrappers shared by the gymnasium-backed tasks
# -------------------------------------------------------------------------------------


class FloatObservation(gym.ObservationWrapper):
    """Flatten the observation into a float32 vector (the contract of :meth:`Task.make_env`)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self._flatten = not (
            isinstance(env.observation_space, gym.spaces.Box) and len(env.observation_space.shape) == 1
        )
        # a Box either way: flatten_space gives one for every space but Graph and Sequence
        space = cast(
            gym.spaces.Box,
            gym.spaces.flatten_space(env.observation_space) if self._flatten else env.observation_space,
        )
        self.observation_space = gym.spaces.Box(
            low=space.low.astype(np.float32), high=space.high.astype(np.float32), dtype=np.float32
        )

    def observation(self, observation: Any) -> np.ndarray:
        if self._flatten:
            observation = gym.spaces.flatten(self.env.observation_space, observation)
        return np.asarray(observation, dtype=np.float32)


class SuccessInfo(gym.Wrapper):
    """Write ``info["success"]``: whether the episode has succeeded at any step so far.

    ``judge(terminated, info)`` says whether this step is a success; the flag then stays
    set until the episode ends, so the last step's info answers "succeeded at any step".
    """

    def __init__(self, env: gym.Env, judge: Callable[[bool, dict[str, Any]], bool]) -> None:
        super().__init__(env)
        self._judge = judge
        self._succeeded = False

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self._succeeded = False
        obs, info = self.env.reset(**kwargs)
        info["success"] = False
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._succeeded = self._succeeded or bool(self._judge(bool(terminated), info))
        info["success"] = self._succeeded
        return obs, reward, terminated, truncated, info


class PotentialShaping(gym.Wrapper):
    """Potential-based reward shaping (Ng, Harada & Russell, ICML 1999).

    Adds ``F = gamma * potential(s') - potential(s)`` to the env reward, with the potential
    of a terminal state taken as 0. With ``gamma`` equal to the agent's discount, every
    policy's return changes by the same ``-potential(s_0)``, so the optimal policy does not
    change; only how fast it is found. ``info["env_reward"]`` keeps the unshaped reward.
    """

    def __init__(self, env: gym.Env, potential: Callable[[np.ndarray], float], gamma: float) -> None:
        super().__init__(env)
        self._potential, self._gamma = potential, float(gamma)
        self._last = 0.0

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self._last = self._potential(obs)
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        now = 0.0 if terminated else self._potential(obs)
        info["env_reward"] = reward
        shaped = float(reward) + self._gamma * now - self._last
        self._last = now
        return obs, shaped, terminated, truncated, info


class SparseReward(gym.Wrapper):
    """Pay the task's sparse reward instead of the env's own (``env.reward=sparse``).

    ``rule(obs, reward, terminated, truncated, info, episode)`` gives a step's sparse reward
    from the env's step (``reward`` is the designers' reward of that step; ``episode`` is a
    dict the rule may keep memory in, emptied at reset). ``info["human_return"]`` carries
    the episode's return under the designers' reward so far, so the task's fitness, computed
    from it, is the same whichever reward trained the agent.
    """

    def __init__(self, env: gym.Env, rule: Callable[..., float]) -> None:
        super().__init__(env)
        self._rule = rule
        self._episode: dict[str, Any] = {}
        self._human_return = 0.0

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self._episode, self._human_return = {}, 0.0
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._human_return += float(reward)
        info["human_return"] = self._human_return
        sparse = self._rule(obs, float(reward), bool(terminated), bool(truncated), info, self._episode)
        return obs, float(sparse), terminated, truncated, info


def mountaincar_energy_potential(obs: np.ndarray) -> float:
    """Mechanical energy of the car relative to resting at the flag, in units of 1/10 of
    the valley-to-flag energy gap: about -10 at rest in the valley, 0 at rest at the flag.

    From the dynamics ``v' = v + 0.001 * force - 0.0025 * cos(3 x)``: potential energy
    ``0.0025 / 3 * sin(3 x)`` plus kinetic ``v ** 2 / 2``. Pumping energy is exactly what
    the car has to learn, so this potential guides it without hand-coding the swing.
    """
    x, v = float(obs[0]), float(obs[1])
    energy = 0.0025 / 3.0 * np.sin(3.0 * x) + 0.5 * v * v
    at_flag = 0.0025 / 3.0 * np.sin(3.0 * 0.5)
    return float(10.0 * (energy - at_flag) / (2.0 * at_flag))


def terminated_is_success(terminated: bool, info: dict[str, Any]) -> bool:
    """Success judge for envs that terminate only on reaching the goal (MountainCar)."""
    return terminated


def vector_env(make_one: Callable[[int], gym.Env], num_envs: int, seed: int) -> gym.vector.VectorEnv:
    """A seeded ``SyncVectorEnv`` (SAME_STEP autoreset) of ``make_one(index)`` envs."""
    env = gym.vector.SyncVectorEnv(
        [lambda i=i: make_one(i) for i in range(num_envs)],  # type: ignore[misc]
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


def require(module: str, extra: str, what: str) -> None:
    """Raise a :class:`UserError` naming the extra to install when ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        raise UserError(
            f"{what} needs the Python package '{module}', which is not installed. "
            f'Install it with: pip install "llm4rl[{extra}]"'
        )


def without_reward_section(doc: str) -> str:
    """An env class's documentation without its reward section: the designers' reward is
    never shown to an LLM that writes rewards (it would copy it rather than design one)."""
    return re.sub(r"\n#+ *Rewards?\b.*?(?=\n#+ |\Z)", "", doc, flags=re.DOTALL | re.IGNORECASE)


def observation_source(env_id: str) -> str:
    """The source of the env's observation code, as Eureka shows it (best effort, '' if unavailable)."""
    try:
        cls = type(gym.make(env_id).unwrapped)
    except Exception:  # an optional dependency may be missing
        return ""
    parts = []
    for name in ("_get_obs", "step"):
        method = getattr(cls, name, None)
        if method is not None:
            try:
                parts.append(inspect.getsource(method))
            except (OSError, TypeError):
                continue
    return "\n".join(parts)


# -------------------------------------------------------------------------------------
# The generic gymnasium task
# -------------------------------------------------------------------------------------


class GymTask(Task):
    """A task over a gymnasium id: flat float32 observation, SAME_STEP autoreset vector env.

    Subclasses pass the fields; used directly (config name ``gym``) it takes any ``id``
    and names the flattened observation ``obs_0 .. obs_{n-1}``, with the env class's own
    documentation as the description.
    """

    #: the gymnasium id subclasses run; ``gym`` takes it from the config
    env_id: str = ""
    #: module that must be importable (with the extra naming it), checked by check_available
    requires: tuple[str, str] | None = None
    #: the task's derived fields (:class:`core.envs.task.DerivedField`), passed to ``Task``
    derived: tuple[DerivedField, ...] = ()

    def __init__(
        self,
        id: str | None = None,  # the config key users write is env.id
        max_episode_steps: int | None = None,
        name: str = "gym",
        goal: str = "",
        state_fields: list[StateField] | None = None,
        description: str = "",
        fitness_name: str = "return",
        action_description: str = "",
        make_kwargs: dict[str, Any] | None = None,
        show_source: bool = False,
        reward: str = "human",
    ) -> None:
        self.env_id = id or self.env_id
        if not self.env_id:
            raise UserError("env=gym needs a gymnasium id, e.g. env=gym env.id=Acrobot-v1")
        self.make_kwargs = dict(make_kwargs or {})
        if state_fields is None:  # generic: probe the env for its observation size
            self.check_available()
            probe = FloatObservation(gym.make(self.env_id, **self.make_kwargs))
            size = int(probe.observation_space.shape[0])  # type: ignore[index]
            doc = without_reward_section(inspect.getdoc(type(probe.unwrapped)) or "")
            limit = probe.spec.max_episode_steps if probe.spec else None
            action_description = action_description or f"Action space: {probe.action_space}."
            probe.close()
            state_fields = [
                StateField(f"obs_{i}", i, i + 1, f"observation component {i} of {self.env_id}") for i in range(size)
            ]
            names = ", ".join(f.name for f in state_fields)
            description = description or (
                f"Gymnasium environment {self.env_id}. Observation (float32, {size} values, the env's observation "
                f"flattened in order, so obs_0 is entry 0 of the observation table below, obs_1 entry 1, and so on): "
                f"{names}. The documentation below is gymnasium's own: the names it gives the observation's "
                f"entries are not fields of the state; read the obs_<i> fields.\n\n{doc}"
            )
            goal = goal or f"Maximise the return of the gymnasium environment {self.env_id}."
            max_episode_steps = max_episode_steps or limit or 1000
        if show_source:
            source = observation_source(self.env_id)
            if source:
                description += f"\n\nObservation and step code of the environment:\n```python\n{source}```"
        super().__init__(
            name=name,
            goal=goal,
            state_fields=state_fields,
            description=description,
            fitness_name=fitness_name,
            max_episode_steps=int(max_episode_steps or 500),
            action_description=action_description,
            reward=reward,
            derived_fields=list(self.derived),
        )
        if any(f.name not in self.description for f in self.state_fields):
            # the LLM writes code against these names: list every one of them
            computed = ", ".join(d.name for d in self.derived_fields)
            self.description += (
                "\n\nObservation fields, in order"
                + (f" (then the fields computed from them: {computed})" if computed else "")
                + ":\n"
                + self.schema_text()
            )

    # -- construction ---------------------------------------------------------------
    def check_available(self) -> None:
        if self.requires is not None:
            require(self.requires[0], self.requires[1], f"The task '{self.name}'")
        if self.env_id and self.env_id not in gym.registry:
            raise UserError(
                f"'{self.env_id}' is not a registered gymnasium id. Examples: CartPole-v1, Acrobot-v1, LunarLander-v3."
            )

    def wrap(self, env: gym.Env) -> gym.Env:
        """Task-specific wrappers around one env (success flags, extra info)."""
        return env

    def reward_wrap(self, env: gym.Env) -> gym.Env:
        """The env paying the reward ``reward`` names (innermost wrapper: the rule sees the env's own step)."""
        return SparseReward(env, self.sparse_reward) if self.reward == "sparse" else env

    def _make_single(self) -> gym.Env:
        env = gym.make(self.env_id, max_episode_steps=self.max_episode_steps, **self.make_kwargs)
        return FloatObservation(self.wrap(self.reward_wrap(env)))

    def make_env(
        self, num_envs: int, seed: int, params: dict[str, Any] | list[dict[str, Any]] | None = None
    ) -> gym.vector.VectorEnv:
        if params:
            raise UserError(f"The task '{self.name}' has no controllable params; got {params}.")
        self.check_available()
        return vector_env(lambda i: self._make_single(), num_envs, seed)


# -------------------------------------------------------------------------------------
# Classic control
# -------------------------------------------------------------------------------------


class CartPole(GymTask):
    """CartPole-v1: keep a pole upright on a cart; fitness = mean return (max 500)."""

    env_id = "CartPole-v1"
    ends_on_failure = True  # the pole falling or the cart leaving the track ends the episode
    success_return = 475.0  # gymnasium's own "solved" threshold
    sparse_text = (
        "+1 once, on the step the episode reaches its time limit with the pole still up (the whole "
        "episode balanced), 0 on every other step. The env's own +1 per step is a survival count, "
        "dense in time; this is its success-only form."
    )

    def __init__(self, max_episode_steps: int = 500, show_source: bool = False, reward: str = "human") -> None:
        super().__init__(
            name="cartpole",
            max_episode_steps=max_episode_steps,
            goal=(
                "Balance the pole upright (`pole_angle` near 0) on the moving cart for as long as possible "
                "while keeping "
                "the cart near the centre of the track (`cart_position` near 0)."
            ),
            state_fields=[
                StateField(
                    "cart_position",
                    0,
                    1,
                    "cart position along the track, 0 is the centre; the episode ends beyond +-2.4",
                    "m",
                ),
                StateField("cart_velocity", 1, 2, "cart velocity, positive to the right", "m/s"),
                StateField(
                    "pole_angle",
                    2,
                    3,
                    "pole angle from upright, positive leaning right; the episode ends beyond +-0.2095 (12 degrees)",
                    "rad",
                ),
                StateField("pole_angular_velocity", 3, 4, "angular velocity of the pole", "rad/s"),
            ],
            description=(
                "CartPole-v1 (gymnasium classic control). A pole is attached by an unactuated joint to a cart "
                "that moves along a frictionless track. Observation (float32, 4 values): cart_position, "
                "cart_velocity, pole_angle, pole_angular_velocity. "
                "The episode terminates when |pole_angle| > 0.2095 rad or |cart_position| > 2.4 m, and is "
                f"truncated after {max_episode_steps} steps. Fitness: how many steps the pole stays up "
                f"({max_episode_steps} at most)."
            ),
            action_description="Discrete(2): 0 pushes the cart to the left, 1 pushes it to the right (force 10 N).",
            show_source=show_source,
            reward=reward,
        )

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        return 1.0 if truncated and not terminated else 0.0

    def describe_segment(self, obs: np.ndarray, ended: bool) -> str:
        steps, x, angle = len(obs), float(obs[-1, 0]), float(obs[-1, 2])
        if ended:
            why = "the cart left the track" if abs(x) > 2.4 else "the pole fell past 12 degrees"
            return f"The agent kept the pole up for {steps} steps, then {why} and the episode ended in failure."
        return (
            f"The agent kept the pole up for all {steps} steps; at the end the pole leans "
            f"{abs(np.degrees(angle)):.0f} degrees to the {'right' if angle > 0 else 'left'} and the cart is "
            f"{abs(x):.1f} m {'right' if x > 0 else 'left'} of the centre."
        )

    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray]:
        """A PD controller on the pole angle (with a little cart centring): keeps it up for 500 steps."""

        def act(obs: np.ndarray) -> np.ndarray:
            x, v, angle, spin = obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3]
            return (10.0 * angle + 2.0 * spin + 0.1 * x + 0.3 * v > 0).astype(np.int64)

        return act


def _mountaincar_height(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """The track's height under the car, as gymnasium draws it (``MountainCarEnv._height``)."""
    return 0.45 * torch.sin(3.0 * s["car_position"]) + 0.55


def _scaled_energy(s: dict[str, torch.Tensor], flag: float) -> torch.Tensor:
    """``0.0025 / 3 * sin(3 x) + v ** 2 / 2`` (about constant while the engine does nothing),
    scaled to 0 at rest at the valley bottom and 1 at rest at ``flag``."""
    unit = 0.0025 / 3.0
    energy = torch.sin(3.0 * s["car_position"]) + 0.5 * s["car_velocity"] ** 2 / unit  # in units of 0.0025 / 3
    return (energy + 1.0) / (float(np.sin(3.0 * flag)) + 1.0)


def _mountaincar_energy(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return _scaled_energy(s, 0.5)


def _mountaincar_continuous_energy(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return _scaled_energy(s, 0.45)


class MountainCar(GymTask):
    """MountainCar-v0: sparse reward; fitness = success rate of reaching the flag."""

    env_id = "MountainCar-v0"
    _goal_position = 0.5
    ends_on_success = True
    sparse_text = "+1 on the step the car reaches the flag, 0 on every other step (success only)."
    derived = (
        DerivedField(
            "car_height",
            "track height at the car, 0.45 * sin(3 * car_position) + 0.55: 0.1 at the valley bottom, 1.0 at the flag",
            _mountaincar_height,
        ),
        DerivedField(
            "mechanical_energy",
            "the car's energy under the dynamics, scaled: 0 at rest at the valley bottom, 1 at rest at the flag",
            _mountaincar_energy,
        ),
    )

    def __init__(
        self,
        max_episode_steps: int = 200,
        show_source: bool = False,
        shaped: bool = False,
        shaping_gamma: float = 0.98,
        reward: str = "human",
    ) -> None:
        self.shaped, self.shaping_gamma = bool(shaped), float(shaping_gamma)
        super().__init__(
            name="mountaincar",
            max_episode_steps=max_episode_steps,
            fitness_name="success_rate",
            goal=(
                "Drive the under-powered car up the right hill to reach the flag at `car_position` 0.5; it must build "
                "momentum by rocking back and forth, which raises its `mechanical_energy`."
            ),
            state_fields=_mountaincar_fields(),
            description=(
                "MountainCar-v0 (gymnasium classic control). A car sits in a valley between two hills and its "
                "engine is too weak to climb the right hill directly. Observation (float32, 2 values): "
                "car_position in [-1.2, 0.6] (the valley bottom is near -0.52, the flag at 0.5) and car_velocity "
                "in [-0.07, 0.07]; car_height and mechanical_energy = "
                "(sin(3 * car_position) + 600 * car_velocity**2 + 1) "
                "/ (sin(1.5) + 1) are computed from them. Dynamics, each step: "
                "car_velocity += (action - 1) * 0.001 - 0.0025 * cos(3 * car_position), then car_position += "
                "car_velocity (both clipped to their ranges; at the left edge the car stops). The episode "
                "terminates when car_position >= 0.5 with car_velocity >= 0 (success) and is truncated after "
                f"{max_episode_steps} steps. Fitness is the success rate: the share of evaluation episodes that "
                "reach the flag."
            ),
            action_description="Discrete(3): 0 accelerates left, 1 does nothing, 2 accelerates right.",
            show_source=show_source,
            reward=reward,
        )

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        return 1.0 if terminated else 0.0  # terminates only at the flag

    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray]:
        """Push in the direction the car moves (pumps energy): reaches the flag in about 100-130 steps."""
        return lambda obs: np.where(obs[:, 1] >= 0, 2, 0).astype(np.int64)

    def wrap(self, env: gym.Env) -> gym.Env:
        env = SuccessInfo(env, terminated_is_success)
        if self.shaped:
            env = PotentialShaping(env, mountaincar_energy_potential, self.shaping_gamma)
        return env

    def fitness(self, episodes: list[Episode]) -> Fitness:
        return success_fitness(self.fitness_name, episodes)


class MountainCarContinuous(MountainCar):
    """MountainCarContinuous-v0: continuous force; fitness = success rate of reaching the flag."""

    env_id = "MountainCarContinuous-v0"

    def __init__(self, max_episode_steps: int = 999, show_source: bool = False, reward: str = "human") -> None:
        self.shaped, self.shaping_gamma = False, 1.0  # its own reward is already dense near the flag
        GymTask.__init__(
            self,
            name="mountaincar_continuous",
            max_episode_steps=max_episode_steps,
            fitness_name="success_rate",
            goal=(
                "Drive the under-powered car up the right hill to reach the flag at `car_position` 0.45 "
                "using as little "
                "engine force as possible; it must build momentum by rocking back and forth, which raises its "
                "`mechanical_energy`."
            ),
            state_fields=_mountaincar_fields(),
            description=(
                "MountainCarContinuous-v0 (gymnasium classic control). A car sits in a valley between two hills "
                "and its engine is too weak to climb the right hill directly. Observation (float32, 2 values): "
                "car_position in [-1.2, 0.6] (the valley bottom is near -0.52, the flag at 0.45) and car_velocity "
                "in [-0.07, 0.07]; car_height and mechanical_energy = "
                "(sin(3 * car_position) + 600 * car_velocity**2 + 1) "
                "/ (sin(1.35) + 1) are computed from them. Dynamics, each step: "
                "car_velocity += force * 0.0015 - 0.0025 * cos(3 * car_position), with force the action clipped "
                "to [-1, 1], then car_position += car_velocity (both clipped to their ranges; at the left edge the "
                "car stops). The episode terminates at the flag (car_position >= 0.45 with car_velocity >= 0, "
                f"success) and is truncated after {max_episode_steps} steps. Fitness is the success rate."
            ),
            action_description="Box(1,) in [-1, 1]: the engine force, negative pushes left, positive pushes right.",
            show_source=show_source,
            reward=reward,
        )

    derived = (
        DerivedField(
            "car_height",
            "track height at the car, 0.45 * sin(3 * car_position) + 0.55: 0.1 at the valley bottom, 0.99 at the flag",
            _mountaincar_height,
        ),
        DerivedField(
            "mechanical_energy",
            "the car's energy under the dynamics, scaled: 0 at rest at the valley bottom, 1 at rest at the flag",
            _mountaincar_continuous_energy,
        ),
    )

    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray]:
        """Full force in the direction the car moves."""
        return lambda obs: np.where(obs[:, 1:2] >= 0, 1.0, -1.0).astype(np.float32)


def _mountaincar_fields() -> list[StateField]:
    return [
        StateField(
            "car_position",
            0,
            1,
            "horizontal position of the car; valley bottom near -0.52, flag at 0.5 (0.45 continuous)",
            "m",
        ),
        StateField("car_velocity", 1, 2, "horizontal velocity of the car, positive to the right", "m/step"),
    ]


def _pendulum_angle(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.atan2(s["sin_theta"], s["cos_theta"])


class Pendulum(GymTask):
    """Pendulum-v1: swing up and hold an inverted pendulum; fitness = mean return."""

    env_id = "Pendulum-v1"
    success_return = -400.0  # swung up and held: a random policy scores about -1200
    upright_rad = 0.2  # the sparse reward's "upright": within this angle of vertical (about 11 degrees)
    sparse_text = (
        "+1 on every step the pendulum is within 0.2 rad (about 11 degrees) of upright, 0 otherwise "
        "(no torque or velocity terms)."
    )
    derived = (
        DerivedField(
            "angle",
            "angle theta from upright, atan2(sin_theta, cos_theta): 0 upright, +-pi hanging down; "
            "positive torque raises it",
            _pendulum_angle,
            "rad",
        ),
    )

    def __init__(self, max_episode_steps: int = 200, show_source: bool = False, reward: str = "human") -> None:
        super().__init__(
            name="pendulum",
            max_episode_steps=max_episode_steps,
            goal=(
                "Swing the pendulum up and keep it balanced upright (`angle` 0) and still (`angular_velocity` 0) with "
                "as little torque as possible."
            ),
            state_fields=[
                StateField(
                    "cos_theta",
                    0,
                    1,
                    "cosine of the pendulum's angle from upright; 1 when upright, -1 hanging down",
                    "",
                ),
                StateField(
                    "sin_theta", 1, 2, "sine of the pendulum's angle from upright; 0 when upright or hanging down", ""
                ),
                StateField(
                    "angular_velocity",
                    2,
                    3,
                    "angular velocity of the pendulum (rate of change of angle), in [-8, 8]",
                    "rad/s",
                ),
            ],
            description=(
                "Pendulum-v1 (gymnasium classic control). A pendulum is attached at one end to a fixed point; "
                "its angle from upright is angle = atan2(sin_theta, cos_theta), 0 upright, +-pi hanging down. "
                "Observation (float32, 3 values): cos_theta, sin_theta, angular_velocity; angle is computed from "
                f"them. The episode never terminates; it is truncated after {max_episode_steps} steps. Fitness: "
                "the env's own return, higher the more of the episode the pendulum spends upright and still, "
                "with little torque."
            ),
            action_description="Box(1,) in [-2, 2]: the torque applied to the free end.",
            show_source=show_source,
            reward=reward,
        )

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        angle = float(np.arctan2(obs[1], obs[0]))  # 0 upright
        return 1.0 if abs(angle) <= self.upright_rad else 0.0

    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray]:
        """Energy-based swing-up (torque along the motion until the energy reaches the upright
        one), then a PD controller near the top."""

        def act(obs: np.ndarray) -> np.ndarray:
            angle, spin = np.arctan2(obs[:, 1], obs[:, 0]), obs[:, 2]
            energy = 0.5 * spin**2 / 15.0 + (obs[:, 0] - 1.0)  # 0 at rest upright (g = 10, l = 1: 3g/2l = 15)
            pump = np.where(energy < 0, 2.0, -2.0) * np.where(spin >= 0, 1.0, -1.0)
            hold = np.clip(-(10.0 * angle + 2.0 * spin), -2.0, 2.0)
            return np.where(obs[:, 0] > 0.85, hold, pump)[:, None].astype(np.float32)

        return act


def _acrobot_theta1(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.atan2(s["sin_theta1"], s["cos_theta1"])


def _acrobot_theta2(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.atan2(s["sin_theta2"], s["cos_theta2"])


def _acrobot_tip_height(s: dict[str, torch.Tensor]) -> torch.Tensor:
    """``-cos(theta1) - cos(theta1 + theta2)``, from the sines and cosines (the env's success test)."""
    c1, s1, c2, s2 = s["cos_theta1"], s["sin_theta1"], s["cos_theta2"], s["sin_theta2"]
    return -c1 - (c1 * c2 - s1 * s2)


class Acrobot(GymTask):
    """Acrobot-v1: swing the two-link chain's tip above the bar; fitness = mean return."""

    env_id = "Acrobot-v1"
    ends_on_success = True
    sparse_text = (
        "+1 on the step the tip rises above the bar (the episode's success), 0 on every other step. "
        "The env's own -1 per step is already sparse; this is its success-only form."
    )
    derived = (
        DerivedField(
            "theta1",
            "angle of the first link from pointing straight down, atan2(sin_theta1, cos_theta1), in [-pi, pi]",
            _acrobot_theta1,
            "rad",
        ),
        DerivedField(
            "theta2",
            "angle of the second link relative to the first, atan2(sin_theta2, cos_theta2), in "
            "[-pi, pi]; 0 when the chain is straight",
            _acrobot_theta2,
            "rad",
        ),
        DerivedField(
            "tip_height",
            "height of the free end above the pivot, -cos(theta1) - cos(theta1 + theta2), in [-2, 2]; success above 1",
            _acrobot_tip_height,
            "m",
        ),
    )

    def __init__(self, max_episode_steps: int = 500, show_source: bool = False, reward: str = "human") -> None:
        super().__init__(
            name="acrobot",
            max_episode_steps=max_episode_steps,
            goal=(
                "Swing the free end of the two-link chain up so that the tip's height `tip_height` rises above the bar "
                "(`tip_height` > 1, one link length above the pivot) as fast as possible."
            ),
            state_fields=[
                StateField("cos_theta1", 0, 1, "cosine of theta1, the first link's angle (0: pointing down)", ""),
                StateField("sin_theta1", 1, 2, "sine of theta1, the first link's angle", ""),
                StateField("cos_theta2", 2, 3, "cosine of theta2, the second link's angle relative to the first", ""),
                StateField("sin_theta2", 3, 4, "sine of theta2, the second link's angle relative to the first", ""),
                StateField("theta1_velocity", 4, 5, "angular velocity of the first link, in [-4pi, 4pi]", "rad/s"),
                StateField("theta2_velocity", 5, 6, "angular velocity of the second link, in [-9pi, 9pi]", "rad/s"),
            ],
            description=(
                "Acrobot-v1 (gymnasium classic control). Two links of 1 m hang from a fixed pivot; only the joint "
                "between them is actuated. Observation (float32, 6 values): cos_theta1, sin_theta1, cos_theta2, "
                "sin_theta2, theta1_velocity, theta2_velocity; the angles theta1 and theta2 and the tip's height "
                "tip_height = -cos(theta1) - cos(theta1 + theta2) are computed from them. The episode terminates "
                f"when tip_height > 1 (success) and is truncated after {max_episode_steps} steps. Fitness: the env's "
                "own return, higher the fewer steps the tip takes to rise above the bar."
            ),
            action_description="Discrete(3): torque on the middle joint: 0 is -1, 1 is 0, 2 is +1.",
            show_source=show_source,
            reward=reward,
        )

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        return 1.0 if terminated else 0.0  # terminates only at the goal

    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray]:
        """Torque against the first link's angular velocity, which pumps energy into the swing
        (reaches the bar in about 70-150 steps)."""
        return lambda obs: np.where(obs[:, 4] >= 0, 0, 2).astype(np.int64)

    def wrap(self, env: gym.Env) -> gym.Env:
        return SuccessInfo(env, terminated_is_success)


def _lunar_distance_to_pad(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(s["x"] ** 2 + s["y"] ** 2)


def _lunar_speed(s: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(s["x_velocity"] ** 2 + s["y_velocity"] ** 2)


class LunarLander(GymTask):
    """LunarLander-v3 (Box2D): land softly on the pad; fitness = mean return (200 solves it)."""

    env_id = "LunarLander-v3"
    requires = ("Box2D", "box2d")
    ends_on_success = True  # coming to rest ends the episode
    ends_on_failure = True  # so does crashing or flying off the screen
    success_return = 200.0  # the env's own "solved" threshold
    sparse_text = (
        "only the outcome the env pays at the end: +100 on the step the lander comes to rest, -100 on the "
        "step it crashes or flies off screen, 0 on every other step (no distance, speed, tilt, leg or fuel terms)."
    )
    derived = (
        DerivedField(
            "distance_to_pad",
            "distance from the pad centre, sqrt(x**2 + y**2), in the scaled units of x and y; 0 on the pad",
            _lunar_distance_to_pad,
        ),
        DerivedField(
            "speed",
            "speed of the lander, sqrt(x_velocity**2 + y_velocity**2), scaled as those; near 0 for a soft landing",
            _lunar_speed,
        ),
    )

    def __init__(
        self, max_episode_steps: int = 1000, continuous: bool = False, show_source: bool = False, reward: str = "human"
    ) -> None:
        actions = (
            (
                "Box(2,) in [-1, 1]: main engine throttle (off below 0, 50-100% from 0 to 1) "
                "and lateral engine (left below -0.5, right above 0.5)."
            )
            if continuous
            else (
                "Discrete(4): 0 does nothing, 1 fires the left orientation engine, 2 fires the main engine, "
                "3 fires the right orientation engine."
            )
        )
        super().__init__(
            name="lunarlander",
            max_episode_steps=max_episode_steps,
            make_kwargs={"continuous": continuous},
            goal=(
                "Land the lander gently (`speed` near 0) on the landing pad between the two flags (`distance_to_pad` "
                "0, at x = 0, y = 0), upright (`angle` near 0) and on both legs (`left_leg_contact` and "
                "`right_leg_contact` 1), firing the engines as little as possible (each firing spends fuel, "
                "which is not observed)."
            ),
            state_fields=[
                StateField(
                    "x",
                    0,
                    1,
                    "horizontal position relative to the pad centre, scaled so the screen edges are about +-1",
                    "",
                ),
                StateField("y", 1, 2, "height above the pad, scaled (about 1.4 at the start)", ""),
                StateField("x_velocity", 2, 3, "horizontal velocity, scaled", ""),
                StateField("y_velocity", 3, 4, "vertical velocity, scaled, negative when falling", ""),
                StateField("angle", 4, 5, "lander angle, 0 upright", "rad"),
                StateField("angular_velocity", 5, 6, "angular velocity, scaled", ""),
                StateField("left_leg_contact", 6, 7, "1 if the left leg touches the ground, else 0", ""),
                StateField("right_leg_contact", 7, 8, "1 if the right leg touches the ground, else 0", ""),
            ],
            description=(
                "LunarLander-v3 (gymnasium Box2D). Observation (float32, 8 values): x, y, x_velocity, "
                "y_velocity, angle, angular_velocity, left_leg_contact, right_leg_contact; the pad is at "
                "x = 0, y = 0; distance_to_pad and speed are computed from them. The lander starts near the top "
                "of the screen (y about 1.4) with a random push. Fuel is not observed: what spends it is the "
                "action, each step that fires an engine. The episode "
                "terminates on a crash (the lander's body touches the ground), flying off screen (|x| >= 1) or "
                f"coming to rest, and is truncated after {max_episode_steps} steps. Fitness: the env's own return, "
                "higher for a landing on the pad that is soft, upright, on both legs and fires the engines little; "
                "200 counts as solved."
            ),
            action_description=actions,
            show_source=show_source,
            reward=reward,
        )

    def sparse_reward(
        self, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict[str, Any], episode: dict[str, Any]
    ) -> float:
        return reward if terminated else 0.0  # the env sets a terminal step's reward to exactly +100 or -100

    def reference_policy(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """Gymnasium's own heuristic lander (``lunar_lander.heuristic``), row by row."""
        try:
            from gymnasium.envs.box2d.lunar_lander import heuristic
        except ImportError:  # Box2D missing: no controller
            return None
        mode = SimpleNamespace(continuous=bool(self.make_kwargs.get("continuous")))
        mode.unwrapped = mode  # the heuristic reads env.unwrapped.continuous

        def act(obs: np.ndarray) -> np.ndarray:
            return np.stack([np.asarray(heuristic(mode, row)) for row in obs])

        return act

    def check_available(self) -> None:
        if importlib.util.find_spec("Box2D") is None:
            raise UserError(
                "The task 'lunarlander' needs Box2D, which is not installed. Install it with: "
                'pip install "llm4rl[box2d]" (the box2d wheel; building it from source needs swig).'
            )


def success_fitness(name: str, episodes: list[Episode]) -> Fitness:
    """Share of episodes whose ``success`` flag is set (NaN without episodes)."""
    flags = [bool(e.success) for e in episodes]
    value = float(np.mean(flags)) if flags else float("nan")
    returns = [ground_truth_return(e) for e in episodes]
    details = {"mean_return": float(np.mean(returns))} if returns else {}
    return Fitness(name, value, details)
