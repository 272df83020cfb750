"""envgen: JSON parsing, schema validation and repair, the training mix, feedback, the loop."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from core.config import typed
from core.envs.task import ParamSpec, StateField
from core.errors import UserError
from core.records import Candidate, EnvConfig, Episode, Fitness, IterationResult, TrainResult
from core.testing.cli import run_cli
from core.testing.fakes import (
    FAKE_LLM_OVERRIDES,
    MARK,
    ScriptedLLM,
    answer,
    install_fake_litellm,
    make_run,
    plugin_object,
    texts_of,
)
from plugins import envgen

SPECS = [
    ParamSpec("biome", "terrain", "natural", ("natural", "mountain")),
    ParamSpec("start_wood_pickaxe", "pickaxes", 0, None, 0, 9),
    ParamSpec("start_stone_pickaxe", "pickaxes", 0, None, 0, 9),
    ParamSpec("start_iron", "iron", 0, None, 0, 9),
]
RULES = [envgen.Rule("start_iron", "start_stone_pickaxe"), envgen.Rule("start_stone_pickaxe", "start_wood_pickaxe")]


@dataclass
class FakeTask:
    name: str = "fake"
    goal: str = "unlock achievements"
    params: list = field(default_factory=lambda: list(SPECS))
    state_fields: list = field(
        default_factory=lambda: [StateField("achievement_collect_wood", 0, 1, "wood"), StateField("x", 1, 2, "x")]
    )


YAML = Path(__file__).parents[2] / "conf/plugins/envgen.yaml"


def make(replies: list[str], task=None, config=None, **overrides):
    """A started plugin and its run; the LLM answers ``replies`` in order."""
    run = make_run(
        task or FakeTask(),
        ScriptedLLM(list(replies)),
        plugin=envgen.NAME,
        module=envgen,
        overrides=overrides,
        config=config,
    )
    plugin = envgen.Plugin(run.plugin_config(envgen.NAME))
    plugin.on_run_start(run=run)
    return plugin, run


def test_parse_fenced_json_with_trailing_commas():
    reply = 'Here:\n```json\n[{"name": "a", "params": {"biome": "mountain"},},]\n```'
    items, error = envgen.parse_configs(reply)
    assert error == "" and items[0]["params"]["biome"] == "mountain"


def test_parse_keeps_complete_configs_of_a_cut_off_reply():
    reply = '```json\n[\n  {"name": "a", "params": {"biome": "beach"}},\n  {"name": "b", "params": {"biome": "mount'
    items, error = envgen.parse_configs(reply)
    assert error == "" and [i["name"] for i in items] == ["a"]


def test_parse_reports_missing_json():
    items, error = envgen.parse_configs("I would make a mountain world.")
    assert items == [] and "no JSON" in error


def test_check_config_rejects_unknown_and_bad_choice():
    checked = envgen.check_config({"params": {"biome": "ocean", "lava": 3}}, SPECS, RULES)
    assert not checked.ok
    assert any("ocean" in e for e in checked.errors) and any("lava" in e for e in checked.errors)


def test_check_config_clamps_and_normalises_case():
    checked = envgen.check_config({"params": {"biome": "Mountain", "start_wood_pickaxe": 40}}, SPECS, [])
    assert checked.ok and checked.params == {"biome": "mountain", "start_wood_pickaxe": 9}
    assert any("allowed range" in r for r in checked.repairs)


def test_check_config_maps_near_miss_choice():
    checked = envgen.check_config({"params": {"biome": "mountains"}}, SPECS, [])
    assert checked.ok and checked.params == {"biome": "mountain"}


def test_configs_from_reply_salvages_valid_part_of_invalid_config():
    reply = json.dumps(
        [{"name": "forest", "params": {"biome": "forest", "start_iron": 2}}, {"name": "bad", "params": {"lava": 1}}]
    )
    parsed = envgen.configs_from_reply(reply, SPECS, RULES, 2)
    assert parsed.configs == [] and len(parsed.errors) == 2
    assert [c.name for c in parsed.salvaged] == ["forest"]  # "bad" has nothing valid left
    assert parsed.salvaged[0].params == {"start_iron": 2, "start_stone_pickaxe": 1, "start_wood_pickaxe": 1}


def test_generate_envs_uses_salvaged_configs_when_retries_are_spent():
    reply = json.dumps([{"name": "forest", "params": {"biome": "forest", "start_wood_pickaxe": 1}}])
    plugin, run = make([reply], num_envs=1, retries=0)
    (mix,) = plugin.generate_envs(run, 0)
    assert [c.name for c in mix] == ["forest"] and mix[0].params == {"start_wood_pickaxe": 1}
    assert any("without its invalid parameters" in line for line in plugin.log)
    plugin.on_run_end(run, None)
    assert "without its invalid parameters" in texts_of(run)["envgen/repairs.txt"]


@pytest.mark.parametrize(
    "continuing,names,weights", [(True, ["a", "b"], [0.5, 0.5]), (False, ["original", "a", "b"], [0.5, 0.25, 0.25])]
)
def test_the_training_mix_of_each_variant(continuing, names, weights):
    """Continuing, the generated stage trains on the generated envs alone (the original env comes after);
    from scratch, the original env keeps ``original_share`` of the mix."""
    good = json.dumps([{"name": "a", "params": {"biome": "mountain"}}, {"name": "b", "params": {}}])
    plugin, run = make([good], num_envs=2, retries=0, continue_training=continuing)
    (mix,) = plugin.generate_envs(run, 0)
    assert [c.name for c in mix] == names and [c.weight for c in mix] == weights


def test_prepare_candidates_continues_the_agent_for_each_cycles_share_of_the_frames():
    good = json.dumps([{"name": "a", "params": {"biome": "mountain"}}])
    plugin, run = make(
        [good], config={"trainer": {"frames": 3000}}, num_envs=1, retries=0, iterations=3, generated_share=0.25
    )
    others = Candidate("it0-c1", 0)  # a candidate without this plugin's envs is left alone
    (mix,) = plugin.generate_envs(run, 0)
    first = Candidate("it0-c0", 0, envs=mix)
    plugin.prepare_candidates(run, [first, others])
    assert (first.start, first.frames, first.original_after, first.keep_policy) == (None, 1000, 0.75, True)
    assert (others.start, others.frames, others.keep_policy) == (None, 0, False)
    trained = TrainResult("it0-c0", True, fitness=Fitness("crafter_score", 1.0), frames=896, final_policy=b"weights")
    plugin.on_iteration_end(run, IterationResult(0, [first], [trained]))
    assert plugin.agent.source == "it0-c0" and plugin.agent.frames == 896
    assert run.tracker.metrics["envgen/agent_frames"] == 896
    (mix,) = plugin.generate_envs(run, 1)
    second = Candidate("it1-c0", 1, envs=mix)
    plugin.prepare_candidates(run, [second])
    assert second.start is plugin.agent and second.frames == 2000 - 896  # the cycle ends at 2/3 of the budget


def test_from_scratch_candidates_train_as_proposed():
    good = json.dumps([{"name": "a", "params": {"biome": "mountain"}}])
    plugin, run = make([good], num_envs=1, retries=0, continue_training=False)
    (mix,) = plugin.generate_envs(run, 0)
    candidate = Candidate("it0-c0", 0, envs=mix)
    plugin.prepare_candidates(run, [candidate])
    assert (candidate.start, candidate.frames, candidate.original_after, candidate.keep_policy) == (None, 0, 0.0, False)


def test_continuing_needs_the_ppo_trainer():
    with pytest.raises(UserError, match="continue_training"):
        make([], config={"trainer": {"name": "sac", "frames": 1024}})
    make([], config={"trainer": {"name": "sac", "frames": 1024}}, continue_training=False)


def test_repair_rules_chain():
    checked = envgen.check_config({"params": {"start_iron": 2}}, SPECS, RULES)
    assert checked.params == {"start_iron": 2, "start_stone_pickaxe": 1, "start_wood_pickaxe": 1}
    assert len(checked.repairs) == 2


def test_training_mix_weights_sum_to_one():
    mix = envgen.training_mix([EnvConfig("a", {"biome": "mountain"}), EnvConfig("b", {})], 0.5)
    assert [c.name for c in mix] == ["original", "a", "b"]
    assert mix[0].params == {} and sum(c.weight for c in mix) == pytest.approx(1.0)


def test_achievement_rates_mean_and_std():
    eps = [Episode(1, 10, None, {"achievements": {"collect_wood": w}}) for w in (True, False, True, True)]
    rates = envgen.achievement_rates(TrainResult("c", True, episodes=eps))
    assert rates["collect_wood"] == pytest.approx((75.0, 43.30127), rel=1e-4)


def test_generate_envs_feeds_invalid_output_back():
    good = json.dumps(
        [
            {"name": "mine", "purpose": "iron", "params": {"start_iron": 1}},
            {"name": "hills", "params": {"biome": "mountain"}},
        ]
    )
    plugin, run = make(["not json at all", good], num_envs=2, retries=1, continue_training=False)
    (mix,) = plugin.generate_envs(run, 0)
    assert [c.name for c in mix] == ["original", "mine", "hills"]
    assert mix[1].params["start_stone_pickaxe"] == 1  # repaired by a default rule
    budget = envgen.reply_budget(2, len(SPECS))  # sized to two configs of the task's params
    assert len(run.llm.calls) == 2 and run.llm.calls[0].max_tokens == budget and run.llm.calls[0].temperature == 0.7
    retry_prompt = run.llm.calls[1].last
    assert "could not be used" in retry_prompt and "no JSON" in retry_prompt
    assert "envgen/it0-envs.json" in texts_of(run)
    assert run.tracker.metrics["envgen/generated_envs"] == 2 and run.tracker.metrics["envgen/original_share"] == 0.5


def test_a_reply_cut_off_at_the_cap_is_continued_not_asked_again():
    from core.testing.fakes import CUT_OFF

    head = '```json\n[{"name": "mine", "purpose": "iron", "params": {"start_iron": 1}}, {"name": "hi'
    tail = 'lls", "params": {"biome": "mountain"}}]\n```'
    plugin, run = make([head + CUT_OFF, tail], num_envs=2, retries=1, continue_training=False)
    (mix,) = plugin.generate_envs(run, 0)
    assert [c.name for c in mix] == ["original", "mine", "hills"]  # the second config came from the continuation
    assert len(run.llm.calls) == 2 and "cut off at the length limit" in run.llm.calls[1].last
    assert run.llm.calls[1].messages[-2] == {"role": "assistant", "content": head}  # the text so far, as its turn


def test_the_reply_budget_follows_what_is_asked():
    assert envgen.reply_budget(4, 17) > envgen.reply_budget(2, 17) > envgen.reply_budget(2, 5)
    assert envgen.reply_budget(4, 17) > 800  # four Crafter configs did not fit in the old fixed cap


def test_reflect_sends_rates_and_keeps_history():
    good = json.dumps([{"name": "a", "params": {"biome": "mountain"}}])
    plugin, run = make([good, good], num_envs=1, retries=0)
    (mix,) = plugin.generate_envs(run, 0)
    cand = Candidate("it0-c0", 0, envs=mix)
    eps = [Episode(1, 10, None, {"achievements": {"collect_wood": True, "place_table": False}})] * 2
    res = TrainResult("it0-c0", True, fitness=Fitness("crafter_score", 1.2), episodes=eps)
    text = plugin.reflect(run, IterationResult(0, [cand], [res]))
    assert "collect_wood: 100.0 +- 0.0" in text and "place_table: 0.0" in text
    plugin.generate_envs(run, 1)
    second = run.llm.calls[1].messages
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert run.tracker.metrics["envgen/success_collect_wood"] == 100.0


def test_history_keeps_the_first_prompt_and_the_last_exchanges():
    good = json.dumps([{"name": "a", "params": {"biome": "mountain"}}])
    plugin, run = make([good], num_envs=1, retries=0, history=1, iterations=3)
    eps = [Episode(1, 10, None, {"achievements": {"collect_wood": True}})]
    for it in range(2):
        (mix,) = plugin.generate_envs(run, it)
        plugin.reflect(
            run,
            IterationResult(
                it,
                [Candidate(f"it{it}-c0", it, envs=mix)],
                [TrainResult(f"it{it}-c0", True, fitness=Fitness("crafter_score", 1.0), episodes=eps)],
            ),
        )
    assert [m["role"] for m in plugin.messages] == ["system", "user", "assistant", "user"]
    assert plugin.messages[1] == run.llm.calls[0].messages[1]  # the first prompt stays


def test_prompt_states_the_configured_constraints_and_rules():
    plugin, run = make(
        [json.dumps([{"name": "a", "params": {}}])],
        num_envs=1,
        retries=0,
        constraints=["Never start in the mountains."],
        rules=[{"when": "start_iron", "then": "start_wood_pickaxe", "min": 2}],
    )
    plugin.generate_envs(run, 0)
    prompt = run.llm.calls[0].messages[1]["content"]
    assert "- Never start in the mountains." in prompt
    assert "- if start_iron is set, start_wood_pickaxe must be at least 2" in prompt
    assert "start_stone_pickaxe must be" not in prompt  # the default rules are replaced, not added to


def test_a_task_without_params_is_refused():
    with pytest.raises(UserError, match="controllable params"):
        make([], task=FakeTask(params=[]))


def test_two_runs_share_no_conversation():
    good = json.dumps([{"name": "a", "params": {"biome": "mountain"}}])
    first, run = make([good], num_envs=1, retries=0)
    second, _ = make([good], num_envs=1, retries=0)
    first.generate_envs(run, 0)
    assert len(first.messages) == 3 and [c.name for c in first.configs] == ["a"]
    assert second.messages == [] and second.configs == [] and second.log == []


def test_config_defaults_are_the_yaml_file():
    assert typed(envgen.Config, OmegaConf.load(YAML), "plugins.envgen") == envgen.Config() == plugin_object(envgen).cfg
    assert envgen.Config().rules[0] == envgen.Rule("start_stone_pickaxe", "start_wood_pickaxe", 1.0)


@pytest.mark.parametrize(
    "key,value",
    [
        ("num_envs", 0),
        ("history", 0),
        ("retries", -1),
        ("original_share", 1.5),
        ("generated_share", -0.1),
        ("rules", [{"when": "", "then": "start_iron"}]),
    ],
)
def test_config_refuses_values_that_cannot_work(key, value):
    with pytest.raises(UserError, match=key):
        plugin_object(envgen, **{key: value})


def test_crafter_params_validate_against_task():
    from core.envs import make_task

    task = make_task({"name": "minecraft", "max_episode_steps": 50, "pixels": False})
    cfg = typed(envgen.Config, OmegaConf.load(YAML), "plugins.envgen")  # the rules users get
    rules = envgen.rules_of(cfg, task)
    assert len(rules) == len(cfg.rules)  # every rule names two of Crafter's params
    checked = envgen.check_config(
        {"params": {"biome": "mountain", "start_iron_pickaxe": 1, "iron_rarity": "common"}}, task.params, rules
    )
    assert checked.ok and checked.params["start_wood_pickaxe"] == 1
    env = task.make_env(2, 0, [checked.params, {}])  # the task accepts what validation lets through
    env.close()


#: two EnvGen cycles on Crafter, in this process, with the shared fake LLM: seconds
TWO_CYCLES = [
    "+plugins=[envgen]",
    "env=minecraft",
    "env.max_episode_steps=50",
    "plugins.envgen.iterations=2",
    "plugins.envgen.num_envs=2",
    "trainer.frames=1024",
    "trainer.num_envs=4",
    "trainer.rollout_steps=32",
    "trainer.epochs=1",
    "trainer.minibatch=64",
    "trainer.hidden=[16]",
    "trainer.eval_every=0",
    "trainer.eval_episodes=1",
    "executor=inprocess",
    "save_policy=false",
    "tracking.log_plots=false",
    *FAKE_LLM_OVERRIDES,
]


@pytest.fixture
def stages(monkeypatch):
    """candidate id -> (flat parameters before, after) per training stage, as PPO ran them."""
    from core.train import ppo

    seen: dict[str, list[tuple]] = {}
    train_stage = ppo._Run.train_stage

    def spy(self, batches):
        before = self.model.params.clone()
        train_stage(self, batches)
        done = seen.setdefault(self.candidate.id, [])
        done.append((before, self.model.params.clone(), self.stages()[len(done)][0].envs))

    monkeypatch.setattr(ppo._Run, "train_stage", spy)
    return seen


def test_the_second_cycle_continues_the_first_cycles_agent(make_config, monkeypatch, stages):
    import torch

    from core.loop import Loop

    install_fake_litellm(monkeypatch)
    loop = Loop(make_config(TWO_CYCLES))
    summary = loop.execute()
    (c0,), (c1,) = [it.candidates for it in loop.run.history]
    (r0,), (r1,) = [it.results for it in loop.run.history]
    assert r0.ok and r1.ok, r0.error + r1.error
    assert [e.name for e in c0.envs] == ["fake_env_0", "fake_env_1"]  # the LLM's envs, then the original one
    assert [envs for _, _, envs in stages["it0-c0"]] == [c0.envs, []]
    assert torch.equal(stages["it1-c0"][0][0], stages["it0-c0"][-1][1])  # starts where the first cycle ended
    assert c1.start.source == "it0-c0" and c1.start.sha256 and c0.start is None
    assert r0.frames + r1.frames == 1024  # one plain training's frames, over the two cycles
    assert summary.best_id == "it1-c0" and summary.frames == 1024
    again = Loop(make_config(TWO_CYCLES)).execute()  # the same run again: both cycles come from the results store
    assert again.reused == 2 and again.fitness == summary.fitness


def test_the_from_scratch_switch_trains_each_cycle_afresh(make_config, monkeypatch, stages):
    import torch

    from core.loop import Loop

    install_fake_litellm(monkeypatch)
    # resume=false: the fake LLM writes the same envs each cycle, and the store would reuse the first training
    loop = Loop(make_config([*TWO_CYCLES, "plugins.envgen.continue_training=false", "resume=false"]))
    loop.execute()
    (c0,), (c1,) = [it.candidates for it in loop.run.history]
    assert c1.start is None and not c1.keep_policy and [e.name for e in c1.envs][0] == "original"
    assert len(stages["it1-c0"]) == 1  # one stage: the mix
    assert torch.equal(stages["it1-c0"][0][0], stages["it0-c0"][0][0])  # the seed's fresh initialisation
    assert not torch.equal(stages["it1-c0"][0][0], stages["it0-c0"][-1][1])
    assert [r.frames for it in loop.run.history for r in it.results] == [1024, 1024]


def test_final_seeds_retrain_the_whole_chain(make_config, monkeypatch, stages):
    from core.loop import Loop

    install_fake_litellm(monkeypatch)
    loop = Loop(make_config([*TWO_CYCLES, "plugins.envgen.final_seeds=1"]))
    summary = loop.execute()
    assert len(summary.final_fitness) == 2
    import torch

    assert torch.equal(stages["it1-c0-seed1"][0][0], stages["it0-c0-seed1"][-1][1])  # the fresh seed's own chain
    assert not torch.equal(stages["it0-c0-seed1"][0][0], stages["it0-c0"][0][0])


@pytest.mark.slow
def test_the_agent_crosses_pool_workers_and_leaves_no_policy_file(make_config, monkeypatch, tmp_path):
    """Two candidates a cycle (Eureka rewards x EnvGen envs) train in a pool of two workers:
    the next cycle's candidates load the weights the first cycle's best sent back."""
    import hashlib
    import tempfile

    from core.loop import Loop

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))  # the spawned workers' temp folder
    install_fake_litellm(monkeypatch)
    overrides = [
        *TWO_CYCLES,
        "+plugins=[eureka,envgen]",
        "plugins.eureka.iterations=2",
        "plugins.eureka.samples=2",
        "executor=local",
        "executor.workers=2",
        "save_policy=true",
    ]
    loop = Loop(make_config([o for o in overrides if o not in ("+plugins=[envgen]", "executor=inprocess")]))
    loop.execute()
    first, second = loop.run.history
    assert all(r.ok for r in first.results + second.results), [r.error for r in first.results + second.results]
    best = max(zip(first.candidates, first.results), key=lambda cr: cr[1].score)
    for candidate, result in zip(second.candidates, second.results):
        assert candidate.start.source == best[0].id
        assert candidate.start.sha256 == hashlib.sha256(best[1].final_policy).hexdigest()
        assert result.metrics["train/start_frames"] == best[1].frames  # the worker loaded the state
    assert not list(folder.rglob("policy-*.pt"))


@pytest.fixture
def llm_server():
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that answers with the shared fake LLM
    (:func:`fakes.answer`); yields its ``api_base``. A subprocess reaches it like any server."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Completions(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the handler's API
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = answer(body["messages"])
            choices = [
                {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                for i in range(int(body.get("n") or 1))
            ]
            data = json.dumps(
                {
                    "id": "fake",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", "fake"),
                    "choices": choices,
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_end_to_end_eureka_envgen_minecraft(tmp_path, llm_server):
    """The command users type first, with a tiny budget: Eureka rewards x EnvGen envs on Crafter.

    The LLM is an OpenAI-compatible server answering with the shared fake LLM (the embedded
    model took 8 of the 10+ minutes this test used to take under load, on the Eureka prompt
    alone; its own end-to-end tests are the other plugins'). ~1 minute on 2 busy cores.
    """
    args = [
        "+plugins=[eureka,envgen]",
        "env=minecraft",
        "env.max_episode_steps=100",
        "seed=1",
        "plugins.eureka.iterations=1",
        "plugins.eureka.samples=2",
        "plugins.envgen.iterations=1",
        "plugins.envgen.num_envs=2",
        "plugins.envgen.retries=0",
        "llm=openai",
        "llm.model=openai/fake-llm",
        f"llm.api_base={llm_server}",
        "llm.api_key_env=null",
        "llm.retries=0",
        "trainer.frames=1024",
        "trainer.num_envs=4",
        "trainer.rollout_steps=32",
        "trainer.epochs=1",
        "trainer.eval_episodes=2",
        "trainer.eval_every=0",
        "progress=false",
        "executor=inprocess",
    ]
    out = run_cli(tmp_path, *args, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parent = next(r for r in runs if "candidate" not in r.data.tags)
    assert parent.data.metrics["envgen/generated_envs"] == 2
    generated = json.loads(Path(client.download_artifacts(parent.info.run_id, "envgen/it0-envs.json")).read_text())
    children = [r for r in runs if "candidate" in r.data.tags]
    assert len(children) == 2, out.stdout[-2000:]
    for child in children:  # every candidate pairs a Eureka reward with the generated training mix, and trained
        arts = [a.path for a in client.list_artifacts(child.info.run_id)] + [
            a.path for a in client.list_artifacts(child.info.run_id, "reward")
        ]
        assert "envs.json" in arts and "reward/compute_reward.py" in arts
        assert MARK in Path(client.download_artifacts(child.info.run_id, "reward/compute_reward.py")).read_text()
        mix = json.loads(Path(client.download_artifacts(child.info.run_id, "envs.json")).read_text())
        assert mix == generated and sum(e["weight"] for e in mix) == pytest.approx(1.0)
        assert child.data.tags.get("ok") == "True" and child.data.metrics["frames"] == 1024
        success = [k for k in child.data.metrics if k.startswith("fitness/success_")]
        assert len(success) == 22  # per-achievement success of every Crafter achievement


# -- end to end: the LLM's env config is trained in (plumbing), and a run whose every config is invalid ------------


def _run_envgen(make_config, overrides):
    """One in-process EnvGen cycle on Crafter with a tiny PPO; (summary, recorder)."""
    from core.loop import run_experiment
    from core.testing.contract import PPO_TINY, SMOKE_BASE, Recorder

    recorder = Recorder()
    cfg = make_config(
        [
            "+plugins=[envgen]",
            "env=minecraft",
            "env.max_episode_steps=100",
            "plugins.envgen.iterations=1",
            "plugins.envgen.num_envs=1",
            "trainer.num_envs=4",
            "trainer.rollout_steps=64",
            *SMOKE_BASE,
            *PPO_TINY,
            *overrides,
        ]
    )
    return run_experiment(cfg, extra_plugins=(recorder,)), recorder


LLM_ENV = """```json
[{"name": "wood_start", "purpose": "practise crafting with wood at hand", "params": {"start_wood": 5}}]
```"""


def _instead_of_configs(messages, configs: str) -> str:
    """``configs`` where the shared fake would write env configs; its own reply elsewhere."""
    from core.testing import fakes

    text = fakes.answer(messages)
    return configs if "fake_env_" in text else text


def _spy_on_crafter_envs(monkeypatch):
    """Records the params of every Crafter vector env made (training and evaluation)."""
    from core.envs.crafter import Crafter

    made: list = []
    original = Crafter.make_env

    def make_env(self, num_envs, seed, params=None):
        made.append(params)
        return original(self, num_envs, seed, params)

    monkeypatch.setattr(Crafter, "make_env", make_env)
    return made


def test_the_llms_env_config_is_the_env_the_agent_trains_in(make_config, monkeypatch):
    """Plumbing, not the model: a fake LLM through the real client
    (:func:`fakes.install_fake_litellm`) writes one env config (5 wood at the start);
    the candidate carries it, and the training env is made with its params."""
    from core.testing import fakes

    fakes.install_fake_litellm(monkeypatch, reply=lambda m: _instead_of_configs(m, LLM_ENV))
    made = _spy_on_crafter_envs(monkeypatch)
    summary, recorder = _run_envgen(make_config, [])
    used = [(c, r) for c, r in recorder.trained if [e.name for e in c.envs] == ["wood_start"]]
    assert used and summary.failed == 0, recorder.report()
    (candidate, result), *_ = used
    assert result.ok and result.frames > 0 and candidate.envs[0].params["start_wood"] == 5
    trained_in = [p for p in made if p]  # the training env(s): one params dict per env of the vector env
    assert trained_in and all(d.get("start_wood") == 5 for d in trained_in[0]), made


NO_CONFIGS = "I would make the world a little easier for the agent."


def test_a_run_whose_every_env_reply_is_unusable_trains_in_the_original_env_and_says_why(
    make_config, monkeypatch, tmp_path
):
    """Failure handling (the fake LLM never writes a JSON list of configs): the reason
    goes back to the LLM, no candidate trains in a generated env, the cycle logs zero
    generated envs, and the invalid replies are recorded in ``envgen/repairs.txt``."""
    import mlflow

    from core.testing import fakes
    from plugins import envgen as eg

    llm = fakes.install_fake_litellm(monkeypatch, reply=lambda m: _instead_of_configs(m, NO_CONFIGS))
    summary, recorder = _run_envgen(make_config, ["plugins.envgen.retries=1"])
    assert recorder.trained and all(r.ok for _, r in recorder.trained), recorder.report()
    assert not [e for c, _ in recorder.trained for e in c.envs if e.name != eg.ORIGINAL]
    assert len(llm.calls) == 2 and "JSON" in llm.calls[1]["messages"][-1]["content"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (parent,) = [
        r
        for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
        if "candidate" not in r.data.tags
    ]
    assert parent.data.metrics["envgen/generated_envs"] == 0
    repairs = Path(client.download_artifacts(parent.info.run_id, "envgen/repairs.txt", str(tmp_path))).read_text()
    assert "it0: invalid" in repairs
