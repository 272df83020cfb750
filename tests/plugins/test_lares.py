"""lares plugin: selection, Thompson sampling, rescaling, relabelling, behaviour text, prompts, evolution."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from core.envs import make_task
from core.errors import UserError
from core.records import Candidate, Fitness, IterationResult, RewardProgram, TrainResult
from plugins import lares

UPRIGHT = """```python
import torch

def compute_reward(state, action, next_state):
    upright = next_state["cos_theta"]
    spin = torch.abs(next_state["angular_velocity"])
    reward = upright - 0.1 * spin
    return reward, {"upright": upright, "spin": spin}
```"""

SMOOTH = """```python
import torch

def compute_reward(state, action, next_state):
    upright = next_state["cos_theta"]
    effort = (action ** 2).sum(dim=-1)
    reward = 2.0 * upright - 0.01 * effort
    return reward, {"upright": upright, "effort": effort}
```"""

BROKEN = """```python
def compute_reward(state, action, next_state):
    return state["no_such_field"]
```"""

ANALYSIS = "- jitter: the torque flips sign every step; penalise action changes."


class FakeLLM:
    """Reward replies for code calls, the analysis text for analysis calls; records calls."""

    def __init__(self, codes: list[str]) -> None:
        self.codes, self.calls, self.i = codes, [], 0

    def chat(self, messages, *, n=1, temperature=None, max_tokens=None, seed=0, tag="", stop=None):
        self.calls.append({"messages": messages, "n": n, "temperature": temperature, "tag": tag, "seed": seed})
        if "analysis" in tag:
            return [SimpleNamespace(text=ANALYSIS, cached=False, latency_s=0.0)]
        out = []
        for _ in range(n):
            out.append(SimpleNamespace(text=self.codes[self.i % len(self.codes)], cached=False, latency_s=0.0))
            self.i += 1
        return out


SAC_KEYS = {"num_envs", "buffer_size", "batch_size", "updates_per_frame", "init_random_frames", "hidden", "lr", "eval_episodes", "name"}


def make_run(codes: list[str], tmp_path: Path, env: str = "pendulum", **cfg) -> SimpleNamespace:
    """A fake run: ``cfg`` keys of the SAC trainer go to ``trainer``, the rest to the plugin."""
    base = OmegaConf.load(Path(lares.__file__).parents[1] / "conf" / "plugins" / "lares.yaml")
    plugin = OmegaConf.merge(base, {k: v for k, v in cfg.items() if k not in SAC_KEYS})
    trainer = OmegaConf.load(Path(lares.__file__).parents[1] / "conf" / "trainer" / "sac.yaml")
    trainer = OmegaConf.merge(trainer, {"frames": 1000}, {k: v for k, v in cfg.items() if k in SAC_KEYS})
    config = OmegaConf.create(
        {
            "cache_dir": str(tmp_path),
            "save_policy": False,
            "trainer": trainer,
            "sandbox": {"allowed_imports": ["math", "numpy", "torch"], "cpu_s": 10, "wall_s": 20, "memory_mb": 4096, "call_timeout_s": 1.0},
            "plugins": {"lares": plugin},
        }
    )
    metrics: list[tuple[dict, int]] = []
    logged: dict[str, str] = {}
    run = SimpleNamespace(
        config=config, task=make_task({"name": env}), llm=FakeLLM(codes), seed=0,
        plugin_config=lambda name: config.plugins.get(name),
        log_metrics=lambda m, step=None: metrics.append((m, step)),
        log_text=lambda path, text: logged.__setitem__(path, text),
        metrics=metrics, logged=logged,
    )  # fmt: skip
    lares.on_run_start(run=run)
    return run


# -- selection and sampling -----------------------------------------------------------------------


def test_top_selection_keeps_the_best_scores():
    assert lares.select_elites([0.1, 0.9, 0.5, 0.7, 0.2], 3) == [1, 2, 3]
    assert lares.select_elites([0.1, 0.2], 3) == [0, 1]


def test_tournament_selection_picks_distinct_winners_of_each_tournament():
    scores = [0.1, 0.9, 0.5, 0.7, 0.2]
    chosen = lares.select_elites(scores, 3, "tournament", tournament=5, rng=random.Random(1))
    assert chosen == [1, 2, 3]  # a tournament of everyone is top-k
    small = lares.select_elites(scores, 2, "tournament", tournament=2, rng=random.Random(3))
    assert len(set(small)) == 2
    with pytest.raises(UserError):
        lares.select_elites(scores, 2, "roulette")


def test_complexity_penalty_prefers_the_simpler_of_equally_fit_rewards():
    simple = "def compute_reward(s, a, n):\n    return n['x']"
    fancy = "def compute_reward(s, a, n):\n    return n['x'] + 0 * (n['x'] ** 3 - n['x'] ** 2 + n['x'])"
    sizes = [lares.complexity(simple), lares.complexity(fancy)]
    assert sizes[0] < sizes[1]
    scores = lares.selection_scores([0.5, 0.5], sizes, 0.001)
    assert scores[0] > scores[1]
    assert lares.complexity("def (") == 0


def test_thompson_sampling_favours_the_agent_that_succeeds():
    rng = np.random.default_rng(0)
    outcomes = [deque([0.0] * 10), deque([1.0] * 10), deque([0.0, 1.0] * 5)]
    picks = [lares.thompson_pick(outcomes, rng) for _ in range(200)]
    assert picks.count(1) > 150
    fresh = [deque(), deque()]  # no data: both get picked
    assert {lares.thompson_pick(fresh, rng) for _ in range(50)} == {0, 1}


# -- rescaling, diversity, relabelling -----------------------------------------------------------------


def test_affine_rescale_matches_the_elites_mean_and_std():
    new = torch.randn(1000) * 7.0 + 3.0
    scale = lares.rescale(new, target_mean=-1.0, target_std=0.5)
    out = lares.apply_scale(new, scale)
    assert abs(float(out.mean()) + 1.0) < 1e-4 and abs(float(out.std()) - 0.5) < 1e-4


def test_sigmoid_rescale_squashes_into_zero_one():
    new = torch.randn(1000) * 100.0
    out = lares.apply_scale(new, lares.rescale(new, 0.0, 1.0, "sigmoid"))
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0 and abs(float(out.mean()) - 0.5) < 0.05


def test_diversity_is_zero_for_copies_and_high_for_unrelated_rewards():
    x = torch.randn(500)
    assert lares.diversity(torch.stack([x, 2 * x + 1, -x], 1)) == pytest.approx(0.0, abs=1e-6)
    assert lares.diversity(torch.stack([x, torch.randn(500)], 1)) > 0.8
    assert lares.diversity(torch.stack([x, torch.ones(500)], 1)) == pytest.approx(1.0)


def test_shared_buffer_relabels_a_column_with_a_new_function():
    task = make_task({"name": "pendulum"})
    buf = lares.SharedBuffer(capacity=8, obs_dim=3, act_dim=1, members=2)
    obs = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -0.5], [-1.0, 0.0, 2.0]])
    buf.add(obs, torch.zeros(3, 1), obs, torch.zeros(3), torch.ones(3), torch.zeros(3, 2))
    assert buf.size == 3 and float(buf.env_reward.sum()) == 3.0

    def fn(state, action, next_state):
        return next_state["cos_theta"] * 10, {}

    buf.relabel(1, fn, task, chunk=2)
    assert buf.raw[:3, 1].tolist() == [10.0, 0.0, -10.0]
    assert buf.raw[:3, 0].tolist() == [0.0, 0.0, 0.0]  # other columns untouched
    for _ in range(3):  # ring buffer wraps at capacity
        buf.add(obs, torch.zeros(3, 1), obs, torch.zeros(3), torch.ones(3), torch.zeros(3, 2))
    assert buf.size == 8 and buf.ptr == 4


def test_buffer_samples_a_sac_batch_rewarded_by_one_scaled_column():
    buf = lares.SharedBuffer(capacity=8, obs_dim=2, act_dim=1, members=2)
    obs = torch.arange(8.0).reshape(4, 2)
    buf.add(obs, torch.ones(4, 1), obs + 1, torch.tensor([0, 0, 0, 1]), torch.zeros(4), torch.tensor([[1.0, 5.0]] * 4))
    batch = buf.sample(16, 1, (2.0, -1.0, "affine"))
    assert batch.batch_size == torch.Size([16])
    assert set(batch.keys(True, True)) >= {"observation", "action", ("next", "observation"), ("next", "reward"),
                                           ("next", "done"), ("next", "terminated")}
    assert batch["next", "reward"].shape == (16, 1) and torch.all(batch["next", "reward"] == 9.0)
    assert batch["next", "terminated"].dtype == torch.bool
    assert torch.equal(batch["next", "observation"], batch["observation"] + 1)


def test_agents_are_core_sac_modules_and_a_newcomer_inherits_the_elites_weights(tmp_path):
    from torchrl.data import Bounded

    from core.train.sac import act_deterministic, make_sac_modules, sac_update

    run = make_run([UPRIGHT], tmp_path, hidden=[8], batch_size=4)
    cfg = lares.sac_settings(run, frames=500)
    assert cfg.frames == 500 and cfg.hidden == [8]
    spec = Bounded(low=-2.0, high=2.0, shape=(1,), dtype=torch.float32)
    elite, newcomer = make_sac_modules(3, spec, cfg), make_sac_modules(3, spec, cfg)
    buf = lares.SharedBuffer(capacity=8, obs_dim=3, act_dim=1, members=1)
    buf.add(torch.randn(8, 3), torch.rand(8, 1), torch.randn(8, 3), torch.zeros(8), torch.zeros(8), torch.randn(8, 1))
    sac_update(elite, buf.sample(4, 0, (1.0, 0.0, "affine")))
    obs = torch.randn(5, 3)
    assert not torch.allclose(act_deterministic(elite, obs), act_deterministic(newcomer, obs))
    lares.inherit(newcomer, elite)
    assert torch.allclose(act_deterministic(elite, obs), act_deterministic(newcomer, obs))
    action = lares.explore(newcomer, obs)
    assert action.shape == (5, 1) and float(action.abs().max()) <= 2.0


def test_a_non_sac_trainer_is_refused_with_a_clear_message(tmp_path):
    run = make_run([UPRIGHT], tmp_path, name="ppo")
    with pytest.raises(UserError, match="trainer=sac"):
        lares.sac_settings(run)


# -- behaviour analysis text ------------------------------------------------------------------------------


def test_behaviour_description_is_bounded_and_names_motion_defects():
    task = make_task({"name": "pendulum"})
    steps = 200
    obs = np.stack([np.cos(np.linspace(0, 3, steps + 1)), np.sin(np.linspace(0, 3, steps + 1)), np.zeros(steps + 1)], 1)
    actions = np.array([[2.0], [-2.0]] * (steps // 2))  # flips every step: jitter
    text = lares.describe_behaviour(task, obs, actions, success=None)
    assert len(text) <= lares.BEHAVIOUR_CHARS
    assert text.startswith("Episode of 200 steps")
    assert "cos_theta" in text and "t=0:" in text and f"t={steps}:" in text
    assert "mean |change| per step 4.00" in text
    long_task = SimpleNamespace(render_state=lambda o: "x" * 1000)
    assert len(lares.describe_behaviour(long_task, obs, actions, True)) == lares.BEHAVIOUR_CHARS


# -- prompts ----------------------------------------------------------------------------------------------


def test_initial_population_prompt_and_parsing(tmp_path):
    run = make_run([UPRIGHT, "no code here", SMOOTH], tmp_path, population=3)
    programs = lares.propose_rewards(run=run, iteration=0)
    (call,) = run.llm.calls
    assert call["n"] == 3 and call["temperature"] == 1.0
    system, user = call["messages"][0]["content"], call["messages"][1]["content"]
    assert "reward engineer" in system and "simple" in system
    assert run.task.goal in user and "def compute_reward(state, action, next_state)" in user
    assert len(programs) == 2 and all(p.origin == "lares" for p in programs)
    assert "2/3 replies held a reward function" in lares.STATE.log[0]
    assert lares.propose_rewards(run=run, iteration=1) is None  # later generations are born in training


def test_retrieval_shows_the_most_similar_cases_first(tmp_path):
    run = make_run([UPRIGHT], tmp_path, retrieval=True, retrieve_k=1)
    lares.STATE.cases = [
        {"task": "x", "goal": "open the drawer", "code": "def compute_reward(s, a, n):\n    return DRAWER", "fitness": 1.0},
        {"task": "y", "goal": "swing the pendulum up and keep it upright", "code": "def compute_reward(s, a, n):\n    return SWING", "fitness": 1.0},
    ]
    lares.propose_rewards(run=run, iteration=0)
    user = run.llm.calls[0]["messages"][1]["content"]
    assert user.startswith("Reward functions that worked") and "SWING" in user and "DRAWER" not in user


def test_evolve_prompt_holds_best_code_feedback_and_analysis():
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    msgs = lares.evolve_messages(base, "def compute_reward(s, a, n):\n    return 1", "fitness: [0.1]", ANALYSIS)
    text = msgs[-1]["content"]
    assert "return 1" in text and "fitness: [0.1]" in text and "jitter" in text
    assert len(msgs) == 3


# -- the joint training ---------------------------------------------------------------------------------


def _candidates(run, codes: list[str]) -> list[Candidate]:
    programs, _ = lares.programs_from([SimpleNamespace(text=t) for t in codes], "p", 0)
    return [Candidate(id=f"it0-c{i}", iteration=0, reward=p) for i, p in enumerate(programs)]


def test_evolution_replaces_non_elites_relabels_and_reports_each_member(tmp_path):
    run = make_run([SMOOTH], tmp_path, population=3, elites=1, llm_freq=400, frames=800, init_random_frames=200, updates_per_frame=0.25,
                   batch_size=32, num_envs=2, eval_episodes=1, hidden=[16])
    candidates = _candidates(run, [UPRIGHT, UPRIGHT, BROKEN])
    results = lares.train_candidates(run=run, candidates=candidates, seed=0)
    assert len(results) == 3 and all(isinstance(r, TrainResult) for r in results)
    assert sum(r.frames for r in results) == 800
    tags = [c["tag"] for c in run.llm.calls]
    assert tags == ["lares-repair", "lares-analysis-g1", "lares-evolve-g1"]
    repair = run.llm.calls[0]["messages"]
    assert repair[-1]["content"].startswith("Running the reward function above failed (exception)")
    assert "no_such_field" in repair[-1]["content"] and repair[-2]["content"] == BROKEN
    analysis_prompt = run.llm.calls[1]["messages"][0]["content"]
    assert "Episode of" in analysis_prompt and "name the defects" in analysis_prompt
    evolve = run.llm.calls[2]
    assert evolve["n"] == 2 and evolve["temperature"] == 0.4  # population 3, one elite
    assert "jitter" in evolve["messages"][-1]["content"] and "fitness (return)" in evolve["messages"][-1]["content"]
    assert all(r.ok and r.fitness is not None and r.curve for r in results)
    assert sum("replaced" in r.texts["lares_history.md"] for r in results) == 2
    assert "effort" in results[2].texts["lares_final_reward.py"]  # repaired (or regenerated) from SMOOTH
    assert any(m.get("lares/diversity") is not None for m, _ in run.metrics)
    log = "\n".join(lares.STATE.log)
    assert "## generation 1" in log and "elites:" in log and "### analysis" in log


def test_failed_functions_are_never_elites_and_all_get_regenerated(tmp_path):
    run = make_run([SMOOTH], tmp_path, population=2, elites=1, retries=0, llm_freq=200, frames=400, init_random_frames=100, updates_per_frame=0.25,
                   batch_size=16, num_envs=2, eval_episodes=1, hidden=[8])
    results = lares.train_candidates(run=run, candidates=_candidates(run, [BROKEN, BROKEN]), seed=0)
    tags = [c["tag"] for c in run.llm.calls]
    assert tags == ["lares-evolve-g1"]  # no behaviour to analyse, no repair allowed
    evolve = run.llm.calls[0]
    assert evolve["n"] == 2 and "failed (exception)" in evolve["messages"][-1]["content"]
    assert all(r.ok for r in results)
    assert all("effort" in r.texts["lares_final_reward.py"] for r in results)


def test_discrete_tasks_are_refused_with_a_clear_message(tmp_path):
    run = make_run([UPRIGHT], tmp_path, env="cartpole")
    program = RewardProgram(source="def compute_reward(state, action, next_state):\n    return next_state['pole_angle']", origin="lares")
    with pytest.raises(UserError, match="continuous action space"):
        lares.train_candidates(run=run, candidates=[Candidate("c", 0, reward=program)], seed=0)


def test_other_plugins_candidates_are_left_to_the_executor(tmp_path):
    run = make_run([UPRIGHT], tmp_path)
    program = RewardProgram(source="x", origin="eureka")
    assert lares.train_candidates(run=run, candidates=[Candidate("c", 0, reward=program)], seed=0) is None


def test_reflect_adds_the_best_final_reward_to_the_case_base(tmp_path):
    run = make_run([UPRIGHT], tmp_path, retrieval=True, case_min_fitness=-500.0)
    program = RewardProgram(source="old", origin="lares")
    result = TrainResult("c", ok=True, fitness=Fitness("return", -150.0), texts={"lares_final_reward.py": "evolved code"})
    text = lares.reflect(run=run, result=IterationResult(0, [Candidate("c", 0, reward=program)], [result]))
    assert "case base (1 cases)" in text
    assert lares.load_cases(tmp_path / "lares_cases.json")[0]["code"] == "evolved code"
    lares.on_run_end(run=run, best=None)
    assert run.logged["lares/best_reward.py"] == "evolved code"


@pytest.mark.slow
def test_end_to_end_on_pendulum_with_the_embedded_model(tmp_path: Path):
    """``python -m core +plugins=[lares] trainer=sac``, one LLM update; check MLflow."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cmd = [
        sys.executable, "-m", "core", "+plugins=[lares]", "env=pendulum", "trainer=sac",
        "plugins.lares.population=2", "plugins.lares.elites=1", "plugins.lares.llm_freq=600",
        "plugins.lares.max_tokens=300", "plugins.lares.analysis_tokens=80", "plugins.lares.retries=1",
        "trainer.frames=1000", "trainer.init_random_frames=200", "trainer.updates_per_frame=0.25",
        "trainer.hidden=[32,32]", "trainer.batch_size=64", "trainer.eval_episodes=1", "executor=inprocess",
        "progress=false", "save_policy=false", f"cache_dir={tmp_path / 'cache'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.artifact_location={tmp_path / 'art'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    # exit 1 is the app's answer when every candidate failed (the small model may write
    # code that no retry fixes); anything else is a crash
    all_failed = proc.returncode == 1 and "every candidate failed" in proc.stdout
    assert proc.returncode == 0 or all_failed, (proc.stdout + proc.stderr)[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    if all_failed:  # the failure is recorded with the feedback the LLM got
        assert children and all(c.data.tags["ok"] == "False" for c in children)
        error = Path(client.download_artifacts(children[0].info.run_id, "error.txt", str(tmp_path))).read_text()
        assert error.strip() and "the first error" in proc.stdout
        return
    assert len(children) == 2  # one per member
    for child in children:  # each member: its final code, and its fitness unless its code failed
        files = [a.path for a in client.list_artifacts(child.info.run_id, "texts")]
        assert "texts/lares_final_reward.py" in files and "texts/lares_history.md" in files, files
        if child.data.tags["ok"] == "True":
            assert "fitness" in child.data.metrics and "lares/diversity" in child.data.metrics
    assert any(c.data.tags["ok"] == "True" for c in children)
    assert 0.0 <= parent.data.metrics["lares/diversity"] <= 1.0
    evolution = Path(client.download_artifacts(parent.info.run_id, "lares/evolution.md", str(tmp_path)))
    text = evolution.read_text()
    assert "## generation 1" in text and "### behaviour of the best agent" in text and "### analysis" in text
