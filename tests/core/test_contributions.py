"""The end-of-run summary's account of what each plugin's LLM put into the run."""

from __future__ import annotations

from core.contributions import contributions
from core.records import Candidate, EnvConfig, RewardProgram, TrainResult


def _reward(origin: str, rejected: str = "") -> RewardProgram:
    return RewardProgram(
        source="def compute_reward(s, a, n): ...", origin=origin, reply="```python ...```", rejected=rejected
    )


def test_reward_programs_that_never_trained_are_nothing_and_say_what_trained_instead():
    rejected = Candidate("it0-c0", 0, reward=_reward("eureka", rejected="SyntaxError"))
    failed = Candidate("it0-c1", 0, reward=_reward("eureka"))
    baseline = Candidate("base", 0)
    pairs = [
        (rejected, TrainResult("c", ok=False)),
        (failed, TrainResult("c", ok=False)),
        (baseline, TrainResult("c", ok=True)),
    ]
    (part,) = contributions(["eureka"], pairs, best=pairs[2])
    assert part.nothing and part.role == "reward"
    assert part.text == (
        "2 LLM program(s), 1 usable, none trained: the LLM contributed nothing; "
        "the chosen candidate trained on the task's own reward"
    )


def test_an_in_training_plugin_is_measured_by_the_share_of_steps_its_llm_changed():
    best = (Candidate("c0", 0), TrainResult("c", ok=True, metrics={"llm/changed_share": 0.0}))
    (part,) = contributions(["saycan"], [best], best)
    assert part.nothing and "changed 0.0% of the chosen training's steps" in part.text
    best[1].metrics["llm/changed_share"] = 0.63
    assert not contributions(["saycan"], [best], best)[0].nothing


def test_worlds_are_credited_to_the_plugins_that_generate_them_and_silence_is_not_nothing():
    world = Candidate("c0", 0, envs=[EnvConfig("easy", {"trees": 0.9})])
    pairs = [(world, TrainResult("c", ok=True))]
    env, quiet = contributions(["envgen", "other"], pairs, pairs[0], env_writers=frozenset({"envgen"}))
    assert (
        env.role == "environment"
        and env.text == "1 candidate(s) with LLM-written worlds, 1 trained"
        and not env.nothing
    )
    assert quiet.text == "logged no measure of its LLM's part" and not quiet.nothing
