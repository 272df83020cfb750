"""Macro-actions on CartPole: the wrapped action space, running to the end, failures, usage counts."""

from __future__ import annotations

import numpy as np
import pytest

from core.records import Candidate, MacroAction, Program
from core.sandbox import SandboxError
from core.train.macros import MacroSet
from core.train.ppo import train

# push toward the side the pole leans to, until the pole is nearly upright
BALANCE = """
def balance(state):
    return int(state["pole_angle"][0] > 0)

def upright(state):
    return bool(abs(float(state["pole_angle"][0])) < 0.01)
"""
LEFT = "def left(state):\n    return 0\n"
BROKEN = "def broken(state):\n    return 1 / 0\n"
OUT_OF_RANGE = "def wrong(state):\n    return 5\n"


def _macro(name: str, source: str, max_steps: int = 8, done: str | None = None) -> MacroAction:
    return MacroAction(name=name, program=Program(source=source, entry=name), max_steps=max_steps, done_entry=done)


def test_macro_extends_the_action_space_and_runs_to_max_steps(task):
    macros = MacroSet.prepare([_macro("left", LEFT, max_steps=4)], task, probe=False)
    env = macros.wrap(task.make_env(2, 0))
    assert env.single_action_space.n == 3
    env.reset(seed=0)
    obs, reward, term, trunc, info = env.step(np.array([2, 1]))
    assert list(reward) == [4.0, 1.0]  # the macro ran 4 steps, one reward each
    assert list(info["env_steps"]) == [4, 1]
    assert macros.calls == {"left": 1} and macros.env_steps == 4


def test_macro_stops_at_the_end_of_the_episode(task):
    macros = MacroSet.prepare([_macro("left", LEFT, max_steps=500)], task, probe=False)
    env = macros.wrap(task.make_env(1, 0))
    env.reset(seed=0)
    _, reward, term, _, info = env.step(np.array([2]))
    assert term[0] and 5 <= reward[0] < 60
    assert info["final_info"]["env_steps"][0] == reward[0]


def test_done_entry_ends_the_macro_early(task):
    macros = MacroSet.prepare([_macro("balance", BALANCE, max_steps=200, done="upright")], task)
    env = macros.wrap(task.make_env(1, 0))
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([2]))
    assert 1 <= info["env_steps"][0] < 200


@pytest.mark.parametrize(
    ("source", "name", "kind"), [(BROKEN, "broken", "exception"), (OUT_OF_RANGE, "wrong", "invalid_value")]
)
def test_failing_macro_is_caught_by_the_probe(task, source, name, kind):
    with pytest.raises(SandboxError) as info:
        MacroSet.prepare([_macro(name, source)], task)
    assert info.value.report.kind == kind and name in info.value.report.message


def test_forbidden_macro_is_refused(task):
    with pytest.raises(SandboxError) as info:
        MacroSet.prepare([_macro("evil", "import os\ndef evil(state):\n    return 0\n")], task, probe=False)
    assert info.value.report.kind == "forbidden"


def test_training_with_a_macro_logs_its_usage(task, tiny_cfg):
    candidate = Candidate("m", 0, macros=[_macro("balance", BALANCE, max_steps=8, done="upright")])
    result = train(task, candidate, tiny_cfg, seed=0)
    assert result.ok, result.error
    assert result.metrics["macros/balance_calls"] > 0
    assert result.metrics["macros/env_steps"] >= result.metrics["macros/balance_calls"]
    assert result.fitness is not None and len(result.episodes) == tiny_cfg.eval_episodes


def test_macro_failing_during_training_fails_the_candidate(task, tiny_cfg):
    # valid on the probe state, raises once the cart has moved right
    source = (
        "def flaky(state):\n    if float(state['cart_velocity'][0]) > 0.3:\n"
        "        raise ValueError('cart too fast')\n    return 1\n"
    )
    candidate = Candidate("f", 0, macros=[_macro("flaky", source)])
    result = train(task, candidate, tiny_cfg, seed=0)
    assert not result.ok
    assert result.error_kind == "exception" and "cart too fast" in result.error and "flaky" in result.error
