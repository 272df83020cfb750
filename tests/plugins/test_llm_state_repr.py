"""llm_state_repr (LESR): pair extraction, validation on real states, Lipschitz feedback, hooks."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from core.config import SandboxConfig, typed
from core.context import StepBatch
from core.envs import make_task
from core.errors import UserError
from core.records import Candidate, Fitness, IterationResult, StateProgram, TrainResult
from core.testing.cli import run_cli
from core.testing.fakes import ScriptedLLM, make_run, make_train, plugin_object, texts_of
from plugins import llm_state_repr as lesr

GOOD = """```python
import torch

def revise_state(state):
    angle = torch.atan2(state["sin_theta"], state["cos_theta"])
    return torch.stack([angle.abs(), state["angular_velocity"] ** 2], dim=-1)

def intrinsic_reward(state, features):
    return -0.1 * features[:, 0]
```"""
NAN = GOOD.replace("-0.1 * features[:, 0]", "features[:, 0] / 0.0 * 0.0")
PROSE_ONLY = "I would add the angle and its speed as features."
HUGE = GOOD.replace("-0.1 * features[:, 0]", "1e6 + features[:, 0]")
NO_REWARD = """```python
import torch

def revise_state(state):
    return state["cos_theta"]
```"""


@pytest.fixture(scope="module")
def task():
    return make_task({"name": "pendulum", "max_episode_steps": 50})


@pytest.fixture(scope="module")
def probe(task):
    from core.sandbox import probe_batch

    obs, action, nxt = probe_batch(task, num_envs=2, steps=4)
    return task.split_state(obs), action, task.split_state(nxt)


def cfg(**overrides) -> lesr.Config:
    """The plugin's validated config: its defaults and ``overrides``."""
    return plugin_object(lesr, **overrides).cfg


SANDBOX = SandboxConfig()  # math, numpy, torch; the default limits


def test_extract_pair_needs_both_functions():
    source, error = lesr.extract_pair(GOOD)
    assert "def revise_state" in source and "def intrinsic_reward" in source and error == ""
    source, error = lesr.extract_pair(NO_REWARD)
    assert source == "" and "intrinsic_reward" in error


def test_extract_pair_refuses_own_compute_reward():
    _, error = lesr.extract_pair(GOOD[:-3] + "\ndef compute_reward(s, a, n):\n    return 0\n```")
    assert "compute_reward" in error


def test_check_pair_accepts_good_code(probe):
    source, _ = lesr.extract_pair(GOOD)
    report = lesr.check_pair(source, probe, cfg(), SANDBOX)
    assert report.ok, report.message


@pytest.mark.parametrize("reply,kind", [(NAN, "nonfinite"), (HUGE, "output")])
def test_check_pair_rejects_nonfinite_and_unbounded(probe, reply, kind):
    source, _ = lesr.extract_pair(reply)
    report = lesr.check_pair(source, probe, cfg(reward_bound=100.0), SANDBOX)
    assert not report.ok and kind in (
        report.kind,
        report.data.get("check"),
    )  # the kind, or the finer check of a value kind


STACK_MISMATCH = GOOD.replace('state["angular_velocity"] ** 2', "torch.ones(1)")


def test_shape_error_gets_a_hint_in_the_retry(task):
    plugin, run = make(task, [STACK_MISMATCH, GOOD], samples=1, retries=1)
    programs = plugin.propose_state_reprs(run, 0)
    assert len(programs) == 1
    retry = run.llm.calls[1].last
    assert "stack expects each tensor" in retry and "must have shape [B]" in retry


def test_cut_off_reply_is_resampled_from_the_first_prompt(task):
    cut = GOOD[: GOOD.index("dim=-1)")]
    plugin, run = make(task, [cut, GOOD], samples=1, retries=1)
    assert len(plugin.propose_state_reprs(run, 0)) == 1
    first, second = run.llm.calls
    assert (
        second.messages == first.messages and second.seed != first.seed
    )  # a fresh sample, not the cut-off reply repeated


def test_hint_for_unknown_field_lists_the_fields():
    assert "cos_theta, sin_theta" in lesr.hint_for("KeyError: 'theta'", ["cos_theta", "sin_theta"])
    assert "cut off" in lesr.hint_for("SyntaxError in code block 1, line 34: '[' was never closed", ["x"])
    assert lesr.hint_for("something else", ["x"]) == ""


def test_the_prompt_binds_every_field_of_the_task_and_no_made_up_one(task):
    _, run = make(task, [], config={"sandbox": {"allowed_imports": ["math", "torch"]}})
    prompt = lesr.messages(run, cfg(), [])[-1]["content"]
    assert "def revise_state(state):" in prompt and "def intrinsic_reward(state, features):" in prompt
    for name in task.field_names():  # derived fields included
        assert re.search(rf"^    {name} = state\.{name} +# \[B\]$", prompt, re.MULTILINE), name
    read = set(re.findall(r"state\.(\w+)", prompt)) | set(re.findall(r"state\[\"(\w+)\"\]", prompt))
    assert read == set(task.field_names())  # every field read in the prompt is the task's: no example of another task
    assert not re.search(r"\b(vx|vy)\b", prompt) and "made-up" not in prompt and "{" not in prompt.split("```")[0]
    assert "You may import only: math, torch." in prompt  # the run's sandbox settings
    assert prompt.endswith("Reply with both functions in one ```python block and nothing after it.")


def test_the_earlier_prompt_shows_a_worked_example_and_the_schema(task):
    _, run = make(task, [], config={"sandbox": {"allowed_imports": ["math", "torch"]}, "code": {"interface": "dict"}})
    prompt = lesr.messages(run, cfg(), [])[-1]["content"]
    assert "def revise_state(state)" in prompt and "torch.stack([distance, speed, approach], dim=-1)" in prompt
    assert "angular_velocity" in prompt and "{" not in prompt.split("```")[0]  # formatted, no stray braces
    assert prompt.endswith("You may import only: math, torch.")  # the run's sandbox settings


UNKNOWN_FIELD = GOOD.replace('state["angular_velocity"]', "state.pole_velocity")


def test_a_pair_reading_an_unknown_field_is_refused_with_the_fields_before_it_runs(task, monkeypatch):
    ran = []
    monkeypatch.setattr(
        lesr, "check_pair", lambda source, *a, **k: ran.append(source) or lesr.SandboxReport(True, "ok", "")
    )
    plugin, run = make(task, [UNKNOWN_FIELD, UNKNOWN_FIELD], samples=1, retries=1)
    (program,) = plugin.propose_state_reprs(run, 0)
    assert ran == []  # neither reply reached the sandbox
    assert program.rejected and program.meta["rejected_kind"] == "names"
    assert "`pole_velocity` is not a field of this task" in program.rejected
    assert "The state has exactly these fields: " + ", ".join(task.field_names()) in program.rejected
    repair = run.llm.calls[1]  # the retry: the core's short repair request with the error and the fields
    assert "pole_velocity" in repair.last and all(name in repair.last for name in task.field_names())
    assert "revise_state and intrinsic_reward" in repair.last


def test_a_unique_close_field_is_renamed_and_recorded(task):
    plugin, run = make(task, [GOOD.replace('state["angular_velocity"]', "state.angular_velocty")], samples=1, retries=0)
    (program,) = plugin.propose_state_reprs(run, 0)
    assert not program.rejected and "state.angular_velocity" in program.source
    assert "angular_velocty" in program.meta["fixes"][0]


def test_with_the_earlier_interface_names_are_not_checked_and_a_retry_continues_the_conversation(task):
    plugin, run = make(
        task, [UNKNOWN_FIELD, GOOD], config={"code": {"interface": "dict"}}, samples=1, retries=1, temperature=0.5
    )
    (program,) = plugin.propose_state_reprs(run, 0)
    assert not program.rejected
    first, second = run.llm.calls
    assert "pole_velocity" in second.last and "failed a check on real states" in second.last  # it ran, then went back
    assert second.messages[:2] == first.messages and second.temperature == 0.5


def test_lipschitz_of_a_linear_and_a_constant_dimension():
    x = np.linspace(0, 1, 50)
    values = np.stack([x, np.ones_like(x), x**2], -1)
    reward = 3 * x
    est = lesr.lipschitz(values, reward)
    assert est[0] == pytest.approx(3.0) and est[1] == 0.0
    assert est[2] > 3.0  # r = 3 sqrt(s): steep near 0


def test_lipschitz_is_not_blown_up_by_noise():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, 20_000)
    reward = 2 * x + rng.normal(0, 0.1, x.shape)  # noisy but 2-Lipschitz in the mean
    est = lesr.lipschitz(x[:, None], reward)
    assert 1.0 < est[0] < 10.0


def test_dimension_names(task):
    names = lesr.dimension_names(task, 2)
    assert names[-2:] == ["feature_0", "feature_1"] and len(names) == task.obs_dim + 2


def make(task, replies, config=None, **overrides):
    """A plugin object and its run on ``task``; the LLM answers ``replies`` in order."""
    run = make_run(task, ScriptedLLM(list(replies)), plugin=lesr.NAME, module=lesr, overrides=overrides, config=config)
    return lesr.Plugin(run.plugin_config(lesr.NAME)), run


def test_propose_retries_failed_samples_with_feedback(task):
    plugin, run = make(
        task,
        [GOOD, NAN, GOOD],
        samples=2,
        retries=1,
        temperature=0.5,
        max_tokens=300,
        config={"code": {"repair_temperature": 0.1, "repair_max_tokens": 400}},
    )
    programs = plugin.propose_state_reprs(run, 0)
    assert len(programs) == 2 and all(p.origin == "llm_state_repr" for p in programs)
    assert len(run.llm.calls) == 3 and "NaN or infinite" in run.llm.calls[2].last  # the retry saw the error
    samples, repair = run.llm.calls[:2], run.llm.calls[2]
    assert {(c.temperature, c.max_tokens) for c in samples} == {(0.5, 300)}
    assert (repair.temperature, repair.max_tokens) == (0.1, 400)  # the short repair request, at the run's code settings
    assert (
        "features[:, 0] / 0.0 * 0.0" in repair.last and "Task goal" in repair.last
    )  # the failing pair, not the conversation
    assert all(c.stop == ["\n```\n"] for c in run.llm.calls)  # every reply ends at its code block
    assert "def compute_reward" in programs[0].meta["intrinsic"] and programs[0].meta["weight"] == 0.1


def test_the_temperature_by_default_follows_the_number_of_samples(task):
    from core.prompting import sampling_temperature

    plugin, run = make(task, [GOOD], samples=3, retries=0)
    plugin.propose_state_reprs(run, 0)
    assert {c.temperature for c in run.llm.calls} == {sampling_temperature(3)}


def test_no_valid_sample_is_logged_and_proposed_rejected_with_its_reason(task):
    plugin, run = make(task, [NAN, PROSE_ONLY], samples=2, retries=1)
    programs = plugin.propose_state_reprs(run, 0)
    assert [p.meta["sample"] for p in programs] == [0, 1] and all(p.rejected for p in programs)
    nan, prose = programs
    assert "NaN or infinite" in nan.rejected and nan.reply == NAN and nan.meta["attempts"] == 2
    assert prose.meta["rejected_kind"] == "no_code" and len(prose.meta["errors"]) == 1
    assert (
        "NaN or infinite" in texts_of(run)["llm_state_repr/it0-no-valid-sample.txt"]
    )  # the last error, for the record
    results = [TrainResult(f"it0-c{i}", False, error=p.rejected, error_kind="rejected") for i, p in enumerate(programs)]
    text = plugin.reflect(
        run, IterationResult(0, [Candidate(f"it0-c{i}", 0, state=p) for i, p in enumerate(programs)], results)
    )
    assert (
        text.startswith("### Iteration 0: 2 sampled, 0 usable, 0 trained")
        and "- `it0-c1` (reply 1): rejected (no_code)" in text
    )
    assert plugin.attempts == []  # rejected samples were retried with their error already


def _pair_candidate(cid: str, weight: float) -> Candidate:
    source, _ = lesr.extract_pair(GOOD)
    program = StateProgram(
        source,
        "revise_state",
        origin="llm_state_repr",
        meta={"intrinsic": lesr.intrinsic_program(source, weight).source, "weight": weight},
    )
    return Candidate(cid, 0, state=program)


def _batch(task, n: int = 8) -> StepBatch:
    obs = torch.rand(n, task.obs_dim)
    return StepBatch(obs, torch.zeros(n, 1), obs, torch.rand(n), torch.zeros(n), torch.zeros(n, dtype=torch.bool), task)


def test_training_hooks_add_intrinsic_reward_and_measure_lipschitz(task, probe):
    train = make_train(task, plugin=lesr.NAME, module=lesr, candidate=_pair_candidate("it0-c0", 0.5), total_frames=10)
    plugin = lesr.Plugin(train.plugin_config(lesr.NAME))
    plugin.on_train_start(train)
    assert isinstance(train.state[lesr.NAME], lesr.Training)  # per-training objects live on the context
    batch = _batch(task)
    extra = plugin.compute_reward(train, batch)
    angle = torch.atan2(batch.obs[:, 1], batch.obs[:, 0]).abs()
    assert torch.allclose(extra, -0.05 * angle, atol=1e-5)
    assert train.metrics["llm_state_repr/intrinsic_reward"]
    result = TrainResult("it0-c0", True)
    plugin.on_train_end(train, result)
    assert (
        "llm_state_repr/lipschitz/feature_0" in result.metrics
        and len([k for k in result.metrics if "lipschitz" in k]) == task.obs_dim + 2
    )
    assert lesr.NAME not in train.state  # gone with the training


def test_interleaved_trainings_keep_their_own_reward_and_samples(task):
    """A population method trains several candidates at once in one process, one plugin object."""
    plugin = plugin_object(lesr, lipschitz_samples=8)
    a = make_train(task, plugin=lesr.NAME, module=lesr, candidate=_pair_candidate("a", 0.5))
    b = make_train(task, plugin=lesr.NAME, module=lesr, candidate=_pair_candidate("b", 2.0))
    plugin.on_train_start(a)
    plugin.on_train_start(b)
    batch = _batch(task)
    extra_a, extra_b, _ = (
        plugin.compute_reward(a, batch),
        plugin.compute_reward(b, batch),
        plugin.compute_reward(b, batch),
    )
    assert torch.allclose(extra_b, 4 * extra_a)  # each training its own weight
    assert a.state[lesr.NAME].kept == 8 and b.state[lesr.NAME].kept == 8  # b's second batch is past lipschitz_samples
    result_a = TrainResult("a", True)
    plugin.on_train_end(a, result_a)
    assert result_a.metrics and lesr.NAME in b.state and lesr.NAME not in a.state


def test_training_hooks_ignore_candidates_without_a_pair(task):
    train = make_train(task, plugin=lesr.NAME, module=lesr, candidate=Candidate("c", 0))
    plugin = lesr.Plugin(train.plugin_config(lesr.NAME))
    plugin.on_train_start(train)
    assert plugin.compute_reward(train, _batch(task)) is None and train.state == {}


def test_reflect_reports_scores_and_lipschitz(task):
    plugin, run = make(task, [])
    cand = Candidate("it0-c0", 0, state=StateProgram("def revise_state(state): ...", origin="llm_state_repr"))
    res = TrainResult(
        "it0-c0", True, fitness=Fitness("return", -150.0), metrics={"llm_state_repr/lipschitz/feature_0": 2.5}
    )
    text = plugin.reflect(run, IterationResult(0, [cand], [res]))
    assert "- `it0-c0`: score -150" in text and "feature_0: 2.5" in text
    assert "### `it0-c0`, the best of this iteration" in text and "```python\ndef revise_state(state): ...\n```" in text
    prompt = lesr.messages(run, cfg(), plugin.attempts)[-1]["content"]
    assert "Score: -150" in prompt and "Lipschitz" in prompt
    assert "Score:" not in lesr.messages(run, cfg(history=0), plugin.attempts)[-1]["content"]  # history 0 shows none
    assert make(task, [])[0].attempts == []  # another run starts without them


def test_config_defaults_are_the_yaml_file():
    yaml = OmegaConf.load(Path(__file__).parents[2] / "conf/plugins/llm_state_repr.yaml")
    assert typed(lesr.Config, yaml, "plugins.llm_state_repr") == lesr.Config() == cfg()


@pytest.mark.parametrize(
    "key,value", [("samples", 0), ("retries", -1), ("reward_bound", 0.0), ("lipschitz_samples", -1), ("max_tokens", 0)]
)
def test_config_refuses_values_that_cannot_work(key, value):
    with pytest.raises(UserError, match=key):
        cfg(**{key: value})


@pytest.mark.slow
def test_end_to_end_halfcheetah(tmp_path):
    # Two samples, one retry each: 2-4 calls. On HalfCheetah's 17 fields the 1.5B model often
    # lists every field until it reaches max_tokens=700 (a cut-off reply, so the cap stays), which
    # is ~1 min per call on CI's shared core; a third sample added a whole pair's worth of calls to
    # what is asserted (each sample accounted for, the retry path included) without adding a path.
    samples = 2
    args = [
        "+plugins=[llm_state_repr]",
        "env=halfcheetah",
        "env.max_episode_steps=100",
        "plugins.llm_state_repr.iterations=1",
        f"plugins.llm_state_repr.samples={samples}",
        "plugins.llm_state_repr.retries=1",
        "trainer.frames=1024",
        "trainer.num_envs=4",
        "trainer.rollout_steps=64",
        "trainer.epochs=2",
        "trainer.eval_episodes=2",
        "trainer.eval_every=0",
        "progress=false",
        "executor=inprocess",
    ]
    out = run_cli(tmp_path, *args, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    children = [r for r in runs if "candidate" in r.data.tags]
    assert children, out.stdout[-2000:]
    # Every sample of the embedded model is accounted for: a pair that trained has its features'
    # Lipschitz constants measured, one that failed its checks and retries is recorded as rejected
    # with its reason. (The 1.5B model's pairs often raise; the used-in-training path with a
    # scripted model: test_the_llms_state_features_and_intrinsic_reward_are_used_in_training below.)
    measured = [r for r in children if any(k.startswith("llm_state_repr/lipschitz/") for k in r.data.metrics)]
    rejected = [r for r in children if r.data.tags.get("status") == "rejected" and r.data.tags.get("rejected")]
    assert len(measured) + len(rejected) >= samples, [(r.info.run_name, r.data.tags.get("status")) for r in children]
    assert all(r.data.tags.get("ok") == "True" for r in measured)


# -- end to end: the LLM's state features train (plumbing), and a run whose every pair fails ----------------------


def _run_lesr(make_config, overrides):
    """One in-process LESR run on CartPole with a tiny PPO; (summary, recorder)."""
    from core.loop import run_experiment
    from core.testing.contract import PPO_TINY, SMOKE_BASE, Recorder

    recorder = Recorder()
    cfg = make_config(
        [
            "+plugins=[llm_state_repr]",
            "env=cartpole",
            "plugins.llm_state_repr.iterations=1",
            "plugins.llm_state_repr.samples=1",
            "plugins.llm_state_repr.lipschitz_samples=512",
            *SMOKE_BASE,
            *PPO_TINY,
            *overrides,
        ]
    )
    return run_experiment(cfg, extra_plugins=(recorder,)), recorder


def test_the_llms_state_features_and_intrinsic_reward_are_used_in_training(make_config, monkeypatch):
    """Plumbing, not the model: the shared fake LLM (:func:`fakes.install_fake_litellm`)
    answers through the real client; the candidate trains with the ``revise_state`` /
    ``intrinsic_reward`` pair extracted from its reply: the intrinsic reward is logged on
    training steps and the Lipschitz constants of both LLM features were measured."""
    from core.testing import fakes

    llm = fakes.install_fake_litellm(monkeypatch)
    summary, recorder = _run_lesr(make_config, [])
    assert llm.count("def revise_state") >= 1
    ((candidate, result),) = recorder.trained
    assert candidate.state is not None and candidate.state.origin == "llm_state_repr"
    assert fakes.MARK in candidate.state.source and candidate.state.extra_dim == 2
    assert result.ok and result.frames > 0 and summary.failed == 0, recorder.report()
    intrinsic = [v for _, v in result.series["llm_state_repr/intrinsic_reward"]]
    assert intrinsic and any(v != 0.0 for v in intrinsic)  # 0.1 * tanh(feature 0): the LLM's reward ran
    assert {"llm_state_repr/lipschitz/feature_0", "llm_state_repr/lipschitz/feature_1"} <= set(result.metrics)


BROKEN_PAIR = """```python
import torch


def revise_state(state):
    return torch.stack([state["no_such_field"], state["no_such_field"]], dim=-1)


def intrinsic_reward(state, features):
    return features[:, 0]
```"""


def test_a_run_whose_every_pair_fails_records_each_failure(make_config, monkeypatch):
    """Failure handling (the fake LLM keeps writing a pair that reads a field CartPole
    lacks): no state program trains, the sample is recorded as a candidate that did not
    train with the reason, and the retry was sent the error."""
    from core.testing import fakes

    llm = fakes.install_fake_litellm(monkeypatch, reply=lambda messages: BROKEN_PAIR)
    summary, recorder = _run_lesr(make_config, ["plugins.llm_state_repr.retries=1"])
    mine = [(c, r) for c, r in recorder.trained if c.state is not None]
    assert mine and summary.failed >= len(mine), recorder.report()
    assert all(not r.ok and r.frames == 0 and "no_such_field" in r.error for _, r in mine), recorder.report()
    assert len(llm.calls) >= 2 and all("no_such_field" in c["messages"][-1]["content"] for c in llm.calls[1:])
