"""envgen: JSON parsing, schema validation and repair, the training mix, feedback, the loop."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fakes import ScriptedLLM, make_run, plugin_object, texts_of
from omegaconf import OmegaConf

from core.config import typed
from core.envs.task import ParamSpec, StateField
from core.errors import UserError
from core.records import Candidate, EnvConfig, Episode, Fitness, IterationResult, TrainResult
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
    state_fields: list = field(default_factory=lambda: [StateField("achievement_collect_wood", 0, 1, "wood"), StateField("x", 1, 2, "x")])


YAML = Path(__file__).parents[2] / "conf/plugins/envgen.yaml"


def make(replies: list[str], task=None, **overrides):
    """A started plugin and its run; the LLM answers ``replies`` in order."""
    run = make_run(task or FakeTask(), ScriptedLLM(list(replies)), plugin=envgen.NAME, module=envgen, overrides=overrides)
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
    reply = json.dumps([{"name": "forest", "params": {"biome": "forest", "start_iron": 2}}, {"name": "bad", "params": {"lava": 1}}])
    parsed = envgen.configs_from_reply(reply, SPECS, RULES, 2)
    assert parsed.configs == [] and len(parsed.errors) == 2
    assert [c.name for c in parsed.salvaged] == ["forest"]  # "bad" has nothing valid left
    assert parsed.salvaged[0].params == {"start_iron": 2, "start_stone_pickaxe": 1, "start_wood_pickaxe": 1}


def test_generate_envs_uses_salvaged_configs_when_retries_are_spent():
    reply = json.dumps([{"name": "forest", "params": {"biome": "forest", "start_wood_pickaxe": 1}}])
    plugin, run = make([reply], num_envs=1, retries=0)
    (mix,) = plugin.generate_envs(run, 0)
    assert [c.name for c in mix] == ["original", "forest"] and mix[1].params == {"start_wood_pickaxe": 1}
    assert any("without its invalid parameters" in line for line in plugin.log)
    plugin.on_run_end(run, None)
    assert "without its invalid parameters" in texts_of(run)["envgen/repairs.txt"]


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
    good = json.dumps([{"name": "mine", "purpose": "iron", "params": {"start_iron": 1}}, {"name": "hills", "params": {"biome": "mountain"}}])
    plugin, run = make(["not json at all", good], num_envs=2, retries=1)
    (mix,) = plugin.generate_envs(run, 0)
    assert [c.name for c in mix] == ["original", "mine", "hills"]
    assert mix[1].params["start_stone_pickaxe"] == 1  # repaired by a default rule
    assert len(run.llm.calls) == 2 and run.llm.calls[0].max_tokens == 800 and run.llm.calls[0].temperature == 0.7
    retry_prompt = run.llm.calls[1].last
    assert "could not be used" in retry_prompt and "no JSON" in retry_prompt
    assert "envgen/it0-envs.json" in texts_of(run)
    assert run.tracker.metrics["envgen/generated_envs"] == 2 and run.tracker.metrics["envgen/original_share"] == 0.5


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
        plugin.reflect(run, IterationResult(it, [Candidate(f"it{it}-c0", it, envs=mix)], [TrainResult(f"it{it}-c0", True, fitness=Fitness("crafter_score", 1.0), episodes=eps)]))
    assert [m["role"] for m in plugin.messages] == ["system", "user", "assistant", "user"]
    assert plugin.messages[1] == run.llm.calls[0].messages[1]  # the first prompt stays


def test_prompt_states_the_configured_constraints_and_rules():
    plugin, run = make([json.dumps([{"name": "a", "params": {}}])], num_envs=1, retries=0,
                       constraints=["Never start in the mountains."], rules=[{"when": "start_iron", "then": "start_wood_pickaxe", "min": 2}])
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


@pytest.mark.parametrize("key,value", [("num_envs", 0), ("history", 0), ("retries", -1), ("original_share", 1.5),
                                       ("rules", [{"when": "", "then": "start_iron"}])])
def test_config_refuses_values_that_cannot_work(key, value):
    with pytest.raises(UserError, match=key):
        plugin_object(envgen, **{key: value})


def test_crafter_params_validate_against_task():
    from core.envs import make_task

    task = make_task({"name": "minecraft", "max_episode_steps": 50, "pixels": False})
    cfg = typed(envgen.Config, OmegaConf.load(YAML), "plugins.envgen")  # the rules users get
    rules = envgen.rules_of(cfg, task)
    assert len(rules) == len(cfg.rules)  # every rule names two of Crafter's params
    checked = envgen.check_config({"params": {"biome": "mountain", "start_iron_pickaxe": 1, "iron_rarity": "common"}}, task.params, rules)
    assert checked.ok and checked.params["start_wood_pickaxe"] == 1
    env = task.make_env(2, 0, [checked.params, {}])  # the task accepts what validation lets through
    env.close()


@pytest.mark.slow
def test_end_to_end_eureka_envgen_minecraft(tmp_path):
    """The command users type first, with a tiny budget: Eureka rewards x EnvGen envs on Crafter."""
    cmd = [sys.executable, "-m", "core", "+plugins=[eureka,envgen]", "env=minecraft", "env.max_episode_steps=100", "seed=1",
           "plugins.eureka.iterations=1", "plugins.eureka.samples=2", "plugins.eureka.max_tokens=600",
           "plugins.envgen.iterations=1", "plugins.envgen.num_envs=2", "plugins.envgen.retries=0", "plugins.envgen.max_tokens=300",
           "trainer.frames=2048", "trainer.num_envs=4", "trainer.rollout_steps=64", "trainer.epochs=2", "trainer.eval_episodes=4",
           "trainer.eval_every=0", "progress=false", f"cache_dir={tmp_path / 'cache'}", "executor=inprocess"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    # exit 1 is the app's answer when every candidate failed (the small model's reward code
    # may not run); the generated envs and the training mix are logged either way
    all_failed = out.returncode == 1 and "every candidate failed" in out.stdout
    assert out.returncode == 0 or all_failed, (out.stdout + out.stderr)[-3000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parent = next(r for r in runs if "candidate" not in r.data.tags)
    assert parent.data.metrics["envgen/generated_envs"] >= 1
    generated = json.loads(Path(client.download_artifacts(parent.info.run_id, "envgen/it0-envs.json")).read_text())
    children = [r for r in runs if "candidate" in r.data.tags]
    assert children, out.stdout[-2000:]
    for child in children:  # every candidate pairs a Eureka reward with the generated training mix
        arts = [a.path for a in client.list_artifacts(child.info.run_id)] + [a.path for a in client.list_artifacts(child.info.run_id, "reward")]
        assert "envs.json" in arts and "reward/compute_reward.py" in arts
        mix = json.loads(Path(client.download_artifacts(child.info.run_id, "envs.json")).read_text())
        assert mix == generated and sum(e["weight"] for e in mix) == pytest.approx(1.0)
    ok = [r for r in children if r.data.tags.get("ok") == "True"]
    assert bool(ok) != all_failed, out.stdout[-2000:]
    if all_failed:
        return
    success = [k for k in ok[0].data.metrics if k.startswith("fitness/success_")]
    assert len(success) == 22  # per-achievement success of every Crafter achievement
