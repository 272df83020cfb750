"""Preflight (core.preflight): reward programs checked, vetted and repaired before any RL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.envs import make_task
from core.preflight import preflight
from core.records import Candidate, IterationResult, RewardProgram
from core.registry import make_plugin_manager
from core.testing import fakes
from core.testing.fakes import ScriptedLLM
from plugins import eureka_reward as eureka

ALIVE = """```python
import torch

def compute_reward(state, action, next_state):
    alive = torch.ones_like(state["car_position"])
    return alive, {"alive": alive}
```"""

FIXED = """```python
import torch

def compute_reward(state, action, next_state):
    reached = (next_state["car_position"] >= 0.5).float()
    height = next_state["car_position"]
    return height - 1.0 + 100.0 * reached, {"height": height, "reached": reached}
```"""

#: frames and sizes for a MountainCar run that trains in seconds
TINY = [
    "env=mountaincar",
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
    "vetting.episodes=3",
]


def eureka_run(replies: list[str], **vetting):
    """A MountainCar run context with the eureka plugin registered (its repair_program reachable)."""
    llm = ScriptedLLM(replies)
    settings = fakes.settings_for("eureka", eureka)
    pm = make_plugin_manager(settings, modules={"eureka": eureka})
    run = fakes.make_run(
        make_task({"name": "mountaincar"}),
        llm,
        plugin="eureka",
        module=eureka,
        config={"vetting": {"episodes": 3, **vetting}},
        hook=pm.hook,
    )
    return run, llm


def candidate(reply: str, cid: str = "it0-c0", **fields) -> Candidate:
    from core.codegen import extract_function

    found = extract_function(reply, "compute_reward", ["state", "action", "next_state"])
    program = RewardProgram(source=found.source, origin="eureka", reply=reply, **fields)
    return Candidate(id=cid, iteration=0, reward=program)


def test_a_round_checked_group_by_group_logs_the_rounds_counts():
    run, _ = eureka_run([], repair=0)
    totals: dict[str, int] = {}
    preflight(run, [candidate(ALIVE, "it0-c0")], totals)
    preflight(run, [candidate(ALIVE, "it0-c1")], totals)
    metrics = run.tracker.metrics
    assert metrics["vetting/checked"] == 2 and metrics["vetting/rejected"] == 2 and totals["vetting/checked"] == 2


def test_a_vetoed_program_becomes_a_failed_result_with_the_reason_and_is_logged():
    run, llm = eureka_run([], repair=0)
    c = candidate(ALIVE)
    rejected = preflight(run, [c])
    result = rejected["it0-c0"]
    assert not result.ok and result.error_kind == "vetting" and result.frames == 0
    assert "prolonging the episode" in result.error and "ranks failure above success" in result.error
    assert result.metrics["vetting/pair_accuracy"] == 0.0 and "vetting.md" in result.texts
    assert not llm.calls  # repair 0: nothing sent back
    texts, metrics = run.tracker.texts, run.tracker.metrics
    assert "rejected" in texts["vetting/it0-it0-c0.md"] and "pair accuracy 0.00" in texts["vetting/it0-it0-c0.md"]
    assert metrics["vetting/passed"] == 0.0 and metrics["vetting/rejected"] == 1 and metrics["vetting/checked"] == 1


def test_a_good_program_passes_untouched():
    run, llm = eureka_run([])
    c = candidate(FIXED)
    before = c.reward
    assert preflight(run, [c]) == {} and c.reward is before and not llm.calls
    assert (
        run.tracker.metrics["vetting/pair_accuracy"] == 1.0 and "passed" in run.tracker.texts["vetting/it0-it0-c0.md"]
    )


def test_a_failing_program_is_repaired_once_in_a_short_request_with_the_error_and_the_rule():
    run, llm = eureka_run([FIXED])
    c = candidate(ALIVE)
    assert preflight(run, [c]) == {}
    (call,) = llm.calls
    assert call.tag == "eureka-repair" and len(call.messages) == 2  # not the whole conversation again
    assert call.messages[0]["role"] == "system" and eureka.SYSTEM not in call.messages[0]["content"]
    assert "prolonging the episode" in call.last  # the vetting feedback went back to the LLM
    assert 'alive = torch.ones_like(state["car_position"])' in call.last  # the failing function
    assert "Sign rule: reaching the goal ends this task's episode" in call.last  # the rule it broke
    assert "- car_position ([B])" in call.last and call.temperature == 0.2
    assert "reached" in c.reward.source and c.reward.origin == "eureka" and c.reward.meta["repairs"] == 1
    assert "passed" in run.tracker.texts["vetting/it0-it0-c0-repair1.md"]
    assert run.tracker.metrics["vetting/repaired"] == 1


def test_a_program_no_llm_wrote_is_not_sent_to_the_llm_for_repair():
    run, llm = eureka_run([FIXED])
    c = candidate(ALIVE)
    c.reward.reply = ""  # a plugin's own code
    assert preflight(run, [c])["it0-c0"].error_kind == "vetting" and not llm.calls


def test_with_the_earlier_interface_the_plugin_repairs_in_its_conversation():
    llm = ScriptedLLM([FIXED])
    settings = fakes.settings_for("eureka", eureka)
    pm = make_plugin_manager(settings, modules={"eureka": eureka})
    run = fakes.make_run(
        make_task({"name": "mountaincar"}),
        llm,
        plugin="eureka",
        module=eureka,
        config={"vetting": {"episodes": 3}, "code": {"interface": "dict"}},
    )
    run.pluginmanager = pm  # preflight asks the proposing plugin alone, through pluggy
    c = candidate(ALIVE)
    assert preflight(run, [c]) == {}
    (call,) = llm.calls
    assert call.tag == "eureka-repair" and call.messages[-2] == {"role": "assistant", "content": ALIVE}
    assert "prolonging the episode" in call.last  # the vetting feedback went back to the LLM
    assert "reached" in c.reward.source and c.reward.origin == "eureka" and c.reward.meta["repairs"] == 1
    assert "passed" in run.tracker.texts["vetting/it0-it0-c0-repair1.md"]
    assert run.tracker.metrics["vetting/repaired"] == 1


def test_with_the_earlier_interface_a_run_without_its_plugin_manager_says_so_instead_of_skipping_repair():
    run = fakes.make_run(
        make_task({"name": "mountaincar"}),
        ScriptedLLM([FIXED]),
        plugin="eureka",
        module=eureka,
        config={"vetting": {"episodes": 3}, "code": {"interface": "dict"}},
    )
    with pytest.raises(RuntimeError, match="pluginmanager"):
        preflight(run, [candidate(ALIVE)])


def test_repair_is_tried_as_often_as_configured_then_the_candidate_fails():
    worse = [ALIVE.replace("alive = torch", f"alive = {k} * torch") for k in (2, 3)]
    run, llm = eureka_run(worse, repair=2)
    c = candidate(ALIVE)
    result = preflight(run, [c])["it0-c0"]
    assert len(llm.calls) == 2 and result.error_kind == "vetting" and result.metrics["vetting/repairs"] == 2.0
    assert "3 * torch" in c.reward.source  # the last attempt is what the candidate holds


def test_a_repair_that_returns_the_same_code_is_asked_again_saying_so_at_the_retry_temperature():
    run, llm = eureka_run([ALIVE, ALIVE], repair=2)
    c = candidate(ALIVE)
    result = preflight(run, [c])["it0-c0"]
    assert result.error_kind == "vetting" and len(llm.calls) == 2
    first, second = llm.calls
    assert first.temperature == 0.2 and "unchanged" not in first.last
    assert second.temperature == 0.8 and "returned this function unchanged" in second.last
    assert c.reward.meta["unchanged_repairs"] == 2
    assert not any(k.endswith("-repair1.md") for k in run.tracker.texts)  # the same code is not checked again


def test_a_program_that_fails_its_probe_is_repaired_too():
    run, llm = eureka_run([FIXED])
    broken = ALIVE.replace('state["car_position"]', 'state["position"]')
    c = candidate(broken)
    assert preflight(run, [c]) == {}
    assert "position" in llm.calls[0].last and "car_position" in llm.calls[0].last  # the sandbox's KeyError report


def test_a_reply_without_code_is_sent_back_and_left_to_the_loop_when_it_stays_unusable():
    run, llm = eureka_run(["still no code"])
    c = Candidate(
        id="it0-c0",
        iteration=0,
        reward=RewardProgram(
            source="", origin="eureka", reply="I would reward speed.", rejected="The reply contains no code."
        ),
    )
    assert preflight(run, [c]) == {}  # the loop records it as a rejected reply
    assert "The reply contains no code." in llm.calls[0].last and c.reward.rejected


def test_programs_kept_from_earlier_iterations_are_not_checked_again():
    run, llm = eureka_run([], repair=0)
    old = candidate(ALIVE)
    run.history.append(IterationResult(0, [old], []))
    kept = Candidate(id="it1-c0", iteration=1, reward=old.reward)
    assert preflight(run, [kept]) == {} and not run.tracker.texts


def test_nothing_is_checked_when_vetting_and_repair_are_off():
    run, _ = eureka_run([], enabled=False, repair=0)
    assert preflight(run, [candidate(ALIVE)]) == {} and not run.tracker.texts


def test_in_a_run_the_repaired_program_trains_and_the_verdicts_are_in_mlflow(make_config, monkeypatch):
    import mlflow

    from core.loop import run_experiment
    from core.testing.contract import Recorder

    def reply(messages):
        return FIXED if "failed its check before training" in messages[-1]["content"] else ALIVE

    fakes.install_fake_litellm(monkeypatch, reply)
    cfg = make_config(
        [
            "+plugins=[eureka]",
            "plugins.eureka.iterations=1",
            "plugins.eureka.samples=1",
            *TINY,
            *fakes.FAKE_LLM_OVERRIDES,
        ]
    )
    recorder = Recorder()
    summary = run_experiment(cfg, extra_plugins=(recorder,))
    ((c, r),) = recorder.trained
    assert r.ok and r.frames > 0, recorder.report()
    assert "reached" in c.reward.source and c.reward.meta["repairs"] == 1  # the repaired program is what trained
    client = mlflow.MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary.run_id)
    assert parent.data.metrics["vetting/repaired"] == 1.0 and parent.data.metrics["vetting/pair_accuracy"] == 1.0
    names = [a.path for a in client.list_artifacts(summary.run_id, "vetting")]
    assert names == ["vetting/it0-it0-c0-repair1.md", "vetting/it0-it0-c0.md"]


def test_in_a_run_a_vetoed_program_does_not_train_and_its_reason_reaches_the_next_prompt(make_config, monkeypatch):
    import mlflow

    from core.loop import run_experiment
    from core.testing.contract import Recorder

    backend = fakes.install_fake_litellm(monkeypatch, lambda messages: ALIVE)
    cfg = make_config(
        [
            "+plugins=[eureka]",
            "plugins.eureka.iterations=2",
            "plugins.eureka.samples=1",
            *TINY,
            *fakes.FAKE_LLM_OVERRIDES,
            "vetting.repair=0",
        ]
    )
    recorder = Recorder()
    summary = run_experiment(cfg, extra_plugins=(recorder,))
    assert [(r.ok, r.error_kind, r.frames) for _, r in recorder.trained] == [(False, "vetting", 0)] * 2
    assert summary.failed == 2
    prompts = [m["content"] for call in backend.calls for m in call["messages"] if m["role"] == "user"]
    assert any("prolonging the episode" in p for p in prompts)  # the second round was told why
    client = mlflow.MlflowClient(cfg.tracking.uri)
    children = client.search_runs(
        [client.get_run(summary.run_id).info.experiment_id], f"tags.mlflow.parentRunId = '{summary.run_id}'"
    )
    assert len(children) == 2 and all(ch.data.tags["rejected_by"] == "preflight" for ch in children)
    assert all(ch.info.status == "FAILED" and ch.data.metrics["vetting/pair_accuracy"] == 0.0 for ch in children)


def test_a_text2reward_program_is_repaired_without_its_helpers_and_keeps_them():
    from plugins import text2reward as t2r

    fixed = FIXED.replace("compute_reward", "compute_dense_reward")
    llm = ScriptedLLM([fixed])
    settings = fakes.settings_for(t2r.NAME, t2r)
    pm = make_plugin_manager(settings, modules={t2r.NAME: t2r})
    run = fakes.make_run(
        make_task({"name": "mountaincar"}),
        llm,
        plugin=t2r.NAME,
        module=t2r,
        config={"vetting": {"episodes": 3}},
        hook=pm.hook,
    )
    alive = ALIVE.replace("compute_reward", "compute_dense_reward")
    program = t2r.program_of(alive, "prompt", 0)
    c = Candidate(id="it0-c0", iteration=0, reward=program)
    assert preflight(run, [c]) == {}
    (call,) = llm.calls
    assert call.tag == "text2reward-repair" and "prolonging the episode" in call.last and "- car_position" in call.last
    assert "def tolerance" not in call.last  # the helpers are the plugin's, not the LLM's to fix
    assert (
        c.reward.entry == "compute_dense_reward" and "def tolerance" in c.reward.source and "reached" in c.reward.source
    )
    assert c.reward.origin == t2r.NAME and c.reward.meta["repairs"] == 1


@pytest.mark.slow
def test_with_the_embedded_model_most_sampled_programs_are_usable(tmp_path: Path):
    """The real pipeline on CartPole: four eureka samples from the embedded model, extracted,
    checked, probed, vetted and repaired; at least half are usable and none fails at run time
    on a field or name that does not exist. Every program checked has its verdict recorded
    (repairs included) and the reference episodes are cached. Replies are cached under
    LLM4RL_CACHE_DIR.

    The verdicts had a test of their own, a CLI run on MountainCar that sampled and checked
    two more programs: the same pipeline paid for twice (81 s on CI). How a run's verdicts
    reach MLflow is checked with a scripted LLM above."""
    from hydra import compose, initialize_config_dir

    from core.config import validate
    from core.context import RunContext
    from core.llm.client import make_client
    from core.resources import conf_dir

    cache = os.environ.get("LLM4RL_CACHE_DIR") or str(tmp_path / "cache")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "env=cartpole",
                "+plugins=[eureka]",
                "plugins.eureka.iterations=1",
                "plugins.eureka.samples=4",
                "vetting.episodes=4",
                f"llm.cache_path={cache}",
                f"cache_dir={tmp_path}",
                "progress=false",
            ],
        )
    settings = validate(cfg, {"eureka": eureka})
    llm = make_client(cfg.llm)
    pm = make_plugin_manager(settings, modules={"eureka": eureka})
    run = RunContext(
        settings=settings,
        task=make_task(cfg.env),
        seed=0,
        llm_factory=lambda: llm,
        hook=pm.hook,
        tracker=fakes.Logged(),
    )
    plugin = pm.get_plugin("eureka")
    candidates = [
        Candidate(id=f"it0-c{i}", iteration=0, reward=p)
        for i, p in enumerate(p for group in plugin.propose_rewards(run=run, iteration=0) for p in group)
    ]
    failed = preflight(run, candidates)
    usable = [c for c in candidates if not c.reward.rejected and c.id not in failed]
    assert len(candidates) == 4 and len(usable) >= 2, [
        (c.reward.rejected or failed[c.id].error)[:300] for c in candidates if c not in usable
    ]
    for c in usable:  # what trains reads only the task's fields
        assert "next_state" in c.reward.source or "state" in c.reward.source
    runtime = [failed[c.id].error for c in candidates if c.id in failed and failed[c.id].error_kind == "exception"]
    assert not any(word in e for e in runtime for word in ("KeyError", "NameError", "has no field")), runtime
    # a verdict for every program checked, as the run logs it (vetting/it0-<id>[-repair<k>].md)
    checked = run.tracker.metrics.get("vetting/checked", 0.0)
    verdicts = {path: text for path, text in run.tracker.texts.items() if path.startswith("vetting/")}
    assert checked == len(candidates), run.tracker.metrics
    assert {v.removesuffix(".md").split("-repair")[0] for v in verdicts} == {
        f"vetting/it0-{c.id}" for c in candidates
    }, list(verdicts)
    for path, text in verdicts.items():
        assert text.startswith(("# Reward vetting: ", "# Reward check: ")), (path, text)
    assert list((tmp_path / "reference").glob("cartpole-*.pkl"))  # the reference episodes were cached
