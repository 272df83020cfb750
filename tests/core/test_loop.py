from __future__ import annotations

from dataclasses import dataclass

from core.config import PluginConfig, Settings
from core.loop import combine
from core.records import Candidate, EnvConfig, RewardProgram, StateProgram


def _reward(i: int) -> RewardProgram:
    return RewardProgram(source=f"def compute_reward(s, a, n):\n    return {i}", entry="compute_reward", origin="t")


def test_no_proposal_gives_one_default_candidate():
    (only,) = combine(0, {}, None)
    assert only.reward is None and only.state is None and only.envs == [] and only.macros == []
    assert only.id == "it0-c0"


def test_candidates_are_the_product_of_the_roles_that_proposed():
    envs_a = [EnvConfig("a", {"coal": "rare"})]
    envs_b = [EnvConfig("b", {"coal": "common"})]
    candidates = combine(1, {"reward": [_reward(1), _reward(2), _reward(3)], "envs": [envs_a, envs_b]}, None)
    assert len(candidates) == 6
    assert {c.id for c in candidates} == {f"it1-c{i}" for i in range(6)}
    pairs = {(c.reward.source[-1], c.envs[0].name) for c in candidates}
    assert pairs == {(r, e) for r in "123" for e in "ab"}


def test_a_silent_role_keeps_the_previous_best_part():
    state = StateProgram(source="def revise_state(s):\n    return s", entry="revise_state")
    best = Candidate(id="it0-c3", iteration=0, reward=_reward(9), state=state)
    candidates = combine(1, {"reward": [_reward(1), _reward(2)]}, best)
    assert len(candidates) == 2
    assert all(c.state is state for c in candidates)
    assert [c.reward.source[-1] for c in candidates] == ["1", "2"]


@dataclass
class _Rounds(PluginConfig):
    samples: int = 4  # a plugin's own knob, not read by the core


def test_iterations_and_final_seeds_are_the_largest_plugin_settings():
    assert Settings.of({}).iterations == 1
    assert Settings.of({}, {"x": PluginConfig(iterations=0)}).iterations == 1  # a run has at least one round
    plugins = {"eureka": _Rounds(iterations=5), "envgen": PluginConfig(iterations=2), "x": PluginConfig()}
    assert Settings.of({}, plugins).iterations == 5
    assert Settings.of({"final_seeds": 2}, {"a": PluginConfig(final_seeds=3)}).final_seeds == 3
    assert Settings.of({"final_seeds": 4}, {"a": PluginConfig(final_seeds=3)}).final_seeds == 4
