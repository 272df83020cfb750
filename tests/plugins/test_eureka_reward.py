"""eureka plugin: prompt building, parsing of replies, reflection text, selection, context policy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from core.envs import make_task
from core.records import Candidate, CurvePoint, Episode, Fitness, IterationResult, RewardProgram, TrainResult
from core.testing import fakes
from core.testing.fakes import ScriptedLLM, plugin_object
from plugins import eureka_reward as eureka

GOOD = """Here is the reward:
```python
import torch

def compute_reward(state, action, next_state):
    height = next_state["car_position"]
    speed = torch.abs(next_state["car_velocity"])
    speed_temperature = 0.05
    bonus = torch.exp(speed / speed_temperature) - 1.0
    reward = height + bonus
    return reward, {"height": height, "bonus": bonus}
```"""

NO_FUNCTION = "I would reward the car for going fast."


def make_run(texts: list[str], **cfg):
    """(the plugin object, a run context) as a run makes them, with a scripted LLM."""
    overrides = {"iterations": 2, "samples": 3, "temperature": 1.0, "max_tokens": 256, **cfg}
    run = fakes.make_run(
        make_task({"name": "mountaincar"}),
        ScriptedLLM(texts),
        plugin="eureka",
        module=eureka,
        overrides=overrides,
        seed=3,
    )
    return plugin_object(eureka, **overrides), run


def proposed(plugin, run, iteration: int = 0) -> list[RewardProgram] | None:
    """The programs ``propose_rewards`` hands over, its groups joined (None when it abstains)."""
    groups = plugin.propose_rewards(run=run, iteration=iteration)
    return None if groups is None else [p for group in groups for p in group]


def messages(plugin, run) -> list[dict[str, str]]:
    return eureka.messages(run, plugin.best_reply, plugin.feedback)


def _result(cid: str, value: float, components: dict | None = None) -> TrainResult:
    curve = [CurvePoint(frames=1000 * (i + 1), fitness=value * i / 11, episode_return=-200.0) for i in range(12)]
    return TrainResult(
        candidate_id=cid,
        ok=True,
        fitness=Fitness("success_rate", value),
        curve=curve,
        components=components
        or {"height": [(1000 * i, 0.1 * i) for i in range(20)], "bonus": [(1000 * i, 2.0) for i in range(20)]},
        episodes=[Episode(ret=-150.0, length=150, success=True), Episode(ret=-200.0, length=200, success=False)],
    )


def _failed(cid: str) -> TrainResult:
    return TrainResult(candidate_id=cid, ok=False, error="Traceback ...\nKeyError: 'position'", error_kind="exception")


def _candidate(i: int, iteration: int = 0, origin: str = "eureka") -> Candidate:
    program = RewardProgram(
        source=f"def compute_reward(state, action, next_state):\n    return {i}", origin=origin, reply=f"reply {i}"
    )
    return Candidate(id=f"it{iteration}-c{i}", iteration=iteration, reward=program)


# -- prompt building -----------------------------------------------------------------------


def test_first_prompt_is_system_and_task_with_goal_interface_and_temperature_rule():
    p, run = make_run([GOOD])
    msgs = messages(p, run)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "reward engineer" in msgs[0]["content"]
    user = msgs[1]["content"]
    assert run.task.goal in user
    assert "def compute_reward(state, action, next_state)" in user
    assert "car_position" in user and "car_velocity" in user
    assert "temperature" in user and "component" in user
    assert "torch.where" in user  # batched tensors in, one reward per env out


def test_propose_samples_k_candidates_and_parses_each_reply():
    p, run = make_run([GOOD, NO_FUNCTION, GOOD])
    programs = proposed(p, run, 0)
    (call,) = run.llm.calls
    assert call.n == 3 and call.temperature == 1.0 and call.max_tokens == 256
    assert call.seed == 3 * 1000 + 0
    assert len(programs) == 3  # the reply without a function is kept, rejected with its reason
    assert all(p.entry == "compute_reward" and p.origin == "eureka" for p in programs)
    assert [p.meta["sample"] for p in programs] == [0, 1, 2]
    assert [bool(p.rejected) for p in programs] == [False, True, False]
    assert "contains no code" in programs[1].rejected and programs[1].meta["rejected_kind"] == "no_code"
    assert programs[1].reply == NO_FUNCTION
    assert "def compute_reward" in programs[0].source and "Here is" not in programs[0].source
    assert programs[0].reply == GOOD and "[system]" in programs[0].prompt
    assert programs[0].meta["call"] == "eureka-it0"


def test_a_lone_function_under_another_name_is_renamed_and_noted():
    renamed = GOOD.replace("def compute_reward(", "def improved_compute_reward(")
    p, run = make_run([renamed])
    program = proposed(p, run, 0)[0]
    assert not program.rejected and "def compute_reward(state, action, next_state)" in program.source
    assert program.meta["renamed_from"] == "improved_compute_reward"


def test_no_usable_reply_asks_again_with_the_reason():
    p, run = make_run([NO_FUNCTION])
    programs = proposed(p, run, 0)
    assert len(programs) == 3 and all(x.rejected for x in programs)
    assert p.feedback.startswith("Your reply could not be used")
    msgs = messages(p, run)
    assert [m["role"] for m in msgs] == ["system", "user"]  # no assistant turn to attach it to
    assert "could not be used" in msgs[1]["content"]


# -- reflection text -------------------------------------------------------------------------


def test_reflection_lists_each_component_and_fitness_sampled_about_ten_times_with_stats():
    text = eureka.reflection(_result("c", 0.5), "success_rate")
    lines = {line.split(":")[0]: line for line in text.splitlines() if ": [" in line}
    assert set(lines) == {"bonus", "height", "fitness (success_rate)", "episode length"}
    sampled = lines["height"].split("[")[1].split("]")[0].split(", ")
    assert len(sampled) == 10  # 20 points sampled evenly down to 10
    assert "0.00" == sampled[0] and "1.90" == sampled[-1]
    assert "Max: 1.90" in lines["height"] and "Min: 0.00" in lines["height"]
    assert "Max: 0.50" in lines["fitness (success_rate)"]
    # the standard tips
    assert "rewrite the entire reward function" in text
    assert "nearly identical" in text and "rescale" in text


def test_reflection_without_curve_uses_the_final_fitness():
    result = TrainResult(candidate_id="c", ok=True, fitness=Fitness("success_rate", 0.3))
    text = eureka.reflection(result, "success_rate")
    assert "fitness (success_rate): [0.30]" in text


# -- selection and context policy -------------------------------------------------------------


def test_reflect_keeps_the_best_candidate_and_its_reply_for_the_next_prompt():
    p, run = make_run([GOOD])
    candidates = [_candidate(0), _candidate(1), _candidate(2)]
    results = [_result("it0-c0", 0.2), _failed("it0-c1"), _result("it0-c2", 0.7)]
    text = p.reflect(run=run, result=IterationResult(0, candidates, results))
    assert p.best_reply == "reply 2"
    assert p.best_score == 0.7
    assert p.best_source.endswith("return 2")
    assert text.startswith("### Iteration 0: 3 sampled, 3 usable, 2 trained\n")
    assert "- `it0-c1`: failed (exception): KeyError: 'position'" in text
    # names the candidate the feedback is about and shows its code
    assert "### Feedback on `it0-c2`, the best of this iteration" in text
    assert "```python\ndef compute_reward(state, action, next_state):\n    return 2\n```" in text
    assert p.feedback in text
    msgs = messages(p, run)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == "reply 2"
    assert msgs[3]["content"] == p.feedback and "Max:" in msgs[3]["content"]


def test_context_holds_only_the_latest_best_reply():
    p, run = make_run([GOOD])
    p.reflect(run=run, result=IterationResult(0, [_candidate(0)], [_result("it0-c0", 0.9)]))
    p.reflect(run=run, result=IterationResult(1, [_candidate(5, 1)], [_result("it1-c5", 0.1)]))
    msgs = messages(p, run)
    assert len(msgs) == 4 and msgs[2]["content"] == "reply 5"  # latest iteration's best
    assert p.best_score == 0.9  # the best over the run is still remembered
    assert p.best_source.endswith("return 0")


def test_all_failed_sends_the_error_back():
    p, run = make_run([GOOD])
    text = p.reflect(run=run, result=IterationResult(0, [_candidate(0), _candidate(1)], [_failed("a"), _failed("b")]))
    assert "KeyError: 'position'" in p.feedback
    assert p.feedback.startswith("Running the reward function above failed (exception)")
    assert p.best_reply == "reply 0"
    assert "2 sampled, 2 usable, 0 trained" in text


def test_rejected_replies_are_counted_and_their_reason_sent_back():
    p, run = make_run([NO_FUNCTION])
    programs = proposed(p, run, 0)
    candidates = [Candidate(id=f"it0-c{i}", iteration=0, reward=x) for i, x in enumerate(programs)]
    results = [TrainResult(c.id, ok=False, error=c.rejected, error_kind="rejected") for c in candidates]
    text = p.reflect(run=run, result=IterationResult(0, candidates, results))
    assert "3 sampled, 0 usable, 0 trained" in text
    assert "- `it0-c1` (reply 1): rejected (no_code), not trained: The reply contains no code" in text
    assert NO_FUNCTION in text  # the reply the feedback is about, shown since it held no code
    assert "could not be used" in p.feedback and p.best_reply == ""


def test_reflection_keeps_its_lines_apart_in_markdown():
    """MLflow renders .md artifacts: lines of a paragraph merge, so every line is a list item,
    a heading, blank-separated, or inside a fence."""
    p, run = make_run([GOOD])
    text = p.reflect(
        run=run, result=IterationResult(0, [_candidate(0), _candidate(1)], [_result("it0-c0", 0.2), _failed("x")])
    )
    inside = False
    previous = ""
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and line and previous and not previous.startswith(("#", "-", "```")):
            assert line.startswith("-"), f"{line!r} would merge with {previous!r}"
        previous = line if not inside else "```"
    assert not inside


def test_reflect_ignores_other_plugins_candidates():
    p, run = make_run([GOOD])
    text = p.reflect(run=run, result=IterationResult(0, [_candidate(0, origin="text2reward")], [_result("x", 1.0)]))
    assert text is None and p.best_reply == ""


def test_run_end_logs_the_best_reward_source():
    p, run = make_run([GOOD])
    p.reflect(run=run, result=IterationResult(0, [_candidate(4)], [_result("it0-c4", 0.4)]))
    p.on_run_end(run=run, best=None)
    assert run.tracker.texts["eureka/best_reward.py"].endswith("return 4")


def test_extracted_program_passes_the_sandbox_on_the_task():
    from core.sandbox import prepare_reward

    p, run = make_run([GOOD])
    (program, *_) = proposed(p, run, 0)
    fn = prepare_reward(program, run.task)
    assert set(fn.component_names) == {"height", "bonus"}


# -- end to end --------------------------------------------------------------------------------

TINY = [
    "env=cartpole",
    "trainer.frames=256",
    "trainer.num_envs=4",
    "trainer.rollout_steps=32",
    "trainer.epochs=1",
    "trainer.minibatch=64",
    "trainer.hidden=[16]",
    "trainer.eval_every=0",
    "trainer.eval_episodes=2",
    "executor=inprocess",
    "tracking.log_plots=false",
    "save_policy=false",
    "resume=false",
]


@pytest.mark.slow
def test_a_dropped_reply_is_recorded_with_its_reason_in_mlflow_and_the_counts(make_config, monkeypatch):
    """Three replies: usable, prose only, and the function under another name. Each becomes a
    candidate run; the prose one is rejected (not trained) with its reason, the renamed one trains."""
    import mlflow

    from core.loop import run_experiment

    replies = iter(
        [fakes.REWARD.format(entry="compute_reward"), NO_FUNCTION, fakes.REWARD.format(entry="improved_compute_reward")]
    )

    def reply(msgs):  # the rejected reply goes to the core's repair first; the repair holds no code either
        return NO_FUNCTION if "failed its check before training" in msgs[-1]["content"] else next(replies)

    fakes.install_fake_litellm(monkeypatch, reply)
    cfg = make_config(
        [
            "+plugins=[eureka]",
            "plugins.eureka.iterations=1",
            "plugins.eureka.samples=3",
            *TINY,
            *fakes.FAKE_LLM_OVERRIDES,
            "llm.max_n=1",
            "llm.concurrency=1",
            "vetting.enabled=false",
        ]
    )
    summary = run_experiment(cfg)
    assert (summary.candidates, summary.rejected, summary.failed) == (3, 1, 1)
    assert summary.counts == "3 sampled, 2 usable, 2 trained"
    client = mlflow.MlflowClient(cfg.tracking.uri)
    children = client.search_runs(
        [client.get_run(summary.run_id).info.experiment_id], f"tags.mlflow.parentRunId = '{summary.run_id}'"
    )
    by_sample = {r.data.tags["sample"]: r for r in children}
    assert sorted(by_sample) == ["0", "1", "2"] and all(r.data.tags["llm_call"] == "eureka-it0" for r in children)
    rejected = by_sample["1"]
    assert rejected.data.tags["status"] == "rejected" and rejected.data.tags["rejected_kind"] == "no_code"
    assert rejected.data.tags["rejected"].startswith("The reply contains no code")
    assert rejected.info.status == "FAILED" and rejected.data.metrics.get("frames") == 0.0
    folder = client.download_artifacts(rejected.info.run_id, "", str(cfg.cache_dir))
    assert (Path(folder) / "error.txt").read_text().startswith("The reply contains no code")
    assert (Path(folder) / "reward" / "reply.txt").read_text() == NO_FUNCTION
    assert by_sample["2"].data.tags["renamed_from"] == "improved_compute_reward -> compute_reward"
    assert by_sample["2"].data.tags["ok"] == "True" and "status" not in by_sample["0"].data.tags
    metrics = client.get_run(summary.run_id).data.metrics
    assert metrics["candidates_rejected"] == 1.0
    # the study's measure of the LLM's contribution: the two programs the LLM wrote that trained
    assert metrics["candidates_trained"] == 2.0 and metrics["llm_programs_trained"] == 2.0
    reflection = Path(
        client.download_artifacts(summary.run_id, "reflection/it0-eureka.md", str(cfg.cache_dir))
    ).read_text()
    assert "3 sampled, 2 usable, 2 trained" in reflection and "rejected (no_code), not trained" in reflection


# The embedded model's end-to-end run (``python -m core +plugins=[eureka]`` on CartPole: every
# candidate's code and its fitness or error, the reflection, the LLM's exchanges in MLflow) is
# checked on the first of the two runs of tests/core/test_resume.py::
# test_second_identical_run_makes_no_model_call_and_gives_the_same_result: the same pipeline,
# which was run twice over (~2.5 min of the embedded model on CI's 2 cores) when each test had its own.


# -- end to end: the LLM's program trains (plumbing), and a run whose every program fails --------------------------


def _run_eureka(make_config, overrides):
    """One in-process Eureka run on CartPole with a tiny PPO; (summary, recorder)."""
    from core.loop import run_experiment
    from core.testing.contract import PPO_TINY, SMOKE_BASE, Recorder

    recorder = Recorder()
    cfg = make_config(
        ["+plugins=[eureka]", "env=cartpole", "plugins.eureka.iterations=1", *SMOKE_BASE, *PPO_TINY, *overrides]
    )
    return run_experiment(cfg, extra_plugins=(recorder,)), recorder


def test_the_llms_reward_program_trains_and_its_components_are_logged(make_config, monkeypatch, tmp_path):
    """Plumbing, not the model: the shared fake LLM (:func:`fakes.install_fake_litellm`)
    answers through the real client; the program Eureka extracts from its reply is the
    reward the candidate trains on, and the program's own components reach MLflow."""
    import mlflow

    llm = fakes.install_fake_litellm(monkeypatch)
    summary, recorder = _run_eureka(make_config, ["plugins.eureka.samples=2", "llm.cache=true"])
    assert llm.count("def compute_reward") >= 1
    trained = [(c, r) for c, r in recorder.trained if c.reward is not None and fakes.MARK in c.reward.source]
    assert len(trained) == 2 and summary.failed == 0, recorder.report()
    (part,) = summary.contributions  # the LLM's programs trained, and the chosen candidate uses one
    assert not part.nothing and part.text == "2 LLM program(s), 2 usable, 2 trained; the chosen candidate uses one"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # where the replies were kept is said on the run: the run's own cache folder
    assert client.get_run(summary.run_id).data.tags["llm.cache"] == summary.llm_cache
    assert summary.llm_cache.startswith(str(tmp_path / "cache"))
    for candidate, result in trained:
        assert candidate.reward.origin == "eureka" and result.ok and result.frames > 0
        # "alive" is the program's constant term: its per-step mean is 1 only if the program ran on every step
        assert [v for _, v in result.components["alive"]] == pytest.approx([1.0] * len(result.components["alive"]))
        assert result.components["alive"] and result.components["level"]
        assert client.get_metric_history(result.run_id, "components/alive")
        # the reward was rewritten; CartPole's env reward is constant, so the correlation is undefined (NaN)
        assert "reward/env_correlation" in result.metrics and math.isnan(result.metrics["reward/env_correlation"])


BROKEN = """```python
import torch


def compute_reward(state, action, next_state):
    return next_state["no_such_field"] * 2.0, {}
```"""


def test_a_run_whose_every_program_fails_records_each_failure(make_config, monkeypatch, tmp_path):
    """Failure handling (the fake LLM writes a program that reads a field CartPole lacks):
    no candidate trains, each is recorded with its error on its MLflow run, and the
    summary counts them all as failed."""
    import mlflow

    fakes.install_fake_litellm(monkeypatch, reply=lambda messages: BROKEN)
    summary, recorder = _run_eureka(make_config, ["plugins.eureka.samples=2"])
    assert summary.candidates == summary.failed == 2 and recorder.trained
    assert all(not r.ok and r.frames == 0 and "no_such_field" in r.error for _, r in recorder.trained), (
        recorder.report()
    )
    assert "no_such_field" in summary.first_error
    # the summary says the method's LLM put nothing in, and the parent run carries it
    (part,) = summary.contributions
    assert part.plugin == "eureka" and part.role == "reward" and part.nothing
    assert part.text.startswith("2 LLM program(s)") and "contributed nothing" in part.text
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert "contributed nothing" in client.get_run(summary.run_id).data.tags["llm4rl.contribution.eureka"]
    for _, result in recorder.trained:
        assert client.get_run(result.run_id).data.tags["ok"] == "False"
        assert "no_such_field" in Path(client.download_artifacts(result.run_id, "error.txt", str(tmp_path))).read_text()
