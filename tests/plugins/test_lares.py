"""lares plugin: selection, Thompson sampling, rescaling, relabelling, prompts, and the
population's training contract."""

from __future__ import annotations

import os
import random
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core import hookimpl
from core.envs import make_task
from core.errors import UserError
from core.records import (
    Candidate,
    EnvConfig,
    Fitness,
    IterationResult,
    MacroAction,
    Program,
    RewardProgram,
    StateProgram,
    TrainResult,
)
from core.registry import make_plugin_manager
from core.testing import fakes
from core.testing.cli import run_cli
from core.testing.fakes import ScriptedLLM, plugin_object
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

ANGLE = """import torch

def revise_state(state):
    return torch.stack([state["cos_theta"] * state["angular_velocity"], state["sin_theta"] ** 2], dim=-1)
"""

ANALYSIS = "- jitter: the torque flips sign every step; penalise action changes."

#: small SAC settings for the population's agents
SAC = {
    "name": "sac",
    "frames": 1000,
    "init_random_frames": 200,
    "updates_per_frame": 0.25,
    "batch_size": 32,
    "num_envs": 2,
    "eval_episodes": 1,
    "hidden": [16],
}


def scripted(codes: list[str]) -> ScriptedLLM:
    """Reward code in turn for code calls, the analysis text for analysis calls."""
    turn = iter(range(10_000))
    return ScriptedLLM(answer=lambda messages, tag: ANALYSIS if "analysis" in tag else codes[next(turn) % len(codes)])


def make_run(
    codes: list[str], tmp_path: Path, env: str = "pendulum", extra: tuple = (), trainer: dict | None = None, **cfg
):
    """(the LaRes plugin object, a run context): the plugin registered with ``extra`` as in a run."""
    config = {"trainer": {**SAC, **(trainer or {})}, "save_policy": False, "cache_dir": str(tmp_path)}
    run = fakes.make_run(
        make_task({"name": env}), scripted(codes), plugin="lares", module=lares, overrides=cfg, config=config
    )
    pm = make_plugin_manager(run.settings, {"lares": lares}, extra=extra)
    run.hook = pm.hook
    plugin = pm.get_plugin("lares")
    plugin.on_run_start(run=run)
    return plugin, run


def candidates(codes: list[str], **parts) -> list[Candidate]:
    programs, _ = lares.programs_from([SimpleNamespace(text=t) for t in codes], "p", 0)
    return [Candidate(id=f"it0-c{i}", iteration=0, reward=p, **parts) for i, p in enumerate(programs)]


def upright_reward(state: dict) -> torch.Tensor:
    return state["cos_theta"] - 0.1 * torch.abs(state["angular_velocity"])


# -- config ----------------------------------------------------------------------------------------


def test_config_refuses_unknown_choices_before_any_work():
    with pytest.raises(UserError, match="selection"):
        fakes.settings_for("lares", lares, {"selection": "roulette"})
    with pytest.raises(UserError, match="rescale"):
        fakes.settings_for("lares", lares, {"rescale": "log"})
    with pytest.raises(UserError, match="population"):
        fakes.settings_for("lares", lares, {"population": 0})
    assert lares.Config().final_seeds == 0 and lares.Config().frames is None


def test_a_non_sac_trainer_is_refused_at_run_start(tmp_path):
    config = {"trainer": {"name": "ppo", "frames": 1000}, "cache_dir": str(tmp_path)}
    run = fakes.make_run(
        make_task({"name": "pendulum"}), scripted([UPRIGHT]), plugin="lares", module=lares, config=config
    )
    with pytest.raises(UserError, match="trainer=sac"):
        plugin_object(lares).on_run_start(run=run)


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
    plugin, run = make_run([UPRIGHT, "no code here", SMOOTH], tmp_path, population=3)
    programs = plugin.propose_rewards(run=run, iteration=0)
    (call,) = run.llm.calls
    assert call.n == 3 and call.temperature == 0.512  # by the population's size (core.prompting.sampling_temperature)
    system, user = call.messages[0]["content"], call.messages[1]["content"]
    assert "reward engineer" in system and "simple" in system
    assert run.task.goal in user and "def compute_reward(state, action, next_state)" in user
    assert len(programs) == 3 and all(p.origin == "lares" for p in programs)
    assert [bool(p.rejected) for p in programs] == [False, True, False]  # the prose reply is kept, rejected
    assert programs[1].meta == {"sample": 1, "generation": 0, "call": "lares-init-it0", "rejected_kind": "no_code"}
    assert "2/3 replies held a reward function" in plugin.log[0]


def test_retrieval_shows_the_most_similar_cases_first(tmp_path):
    plugin, run = make_run([UPRIGHT], tmp_path, retrieval=True, retrieve_k=1)
    plugin.cases = [
        {
            "task": "x",
            "goal": "open the drawer",
            "code": "def compute_reward(s, a, n):\n    return DRAWER",
            "fitness": 1.0,
        },
        {
            "task": "y",
            "goal": "swing the pendulum up and keep it upright",
            "code": "def compute_reward(s, a, n):\n    return SWING",
            "fitness": 1.0,
        },
    ]
    plugin.propose_rewards(run=run, iteration=0)
    user = run.llm.calls[0].messages[1]["content"]
    assert user.startswith("Reward functions that worked") and "SWING" in user and "DRAWER" not in user


def test_evolve_prompt_holds_best_code_feedback_and_analysis():
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    msgs = lares.evolve_messages(base, "def compute_reward(s, a, n):\n    return 1", "fitness: [0.1]", ANALYSIS)
    text = msgs[-1]["content"]
    assert "return 1" in text and "fitness: [0.1]" in text and "jitter" in text
    assert len(msgs) == 3


def test_two_runs_keep_their_own_plugin_state(tmp_path):
    first, run_a = make_run([UPRIGHT], tmp_path / "a")
    second, run_b = make_run([UPRIGHT, SMOOTH], tmp_path / "b", population=2)
    first.propose_rewards(run=run_a, iteration=0)
    second.propose_rewards(run=run_b, iteration=0)
    assert first is not second and len(first.log) == len(second.log) == 1
    assert "5/5" in first.log[0] and "2/2" in second.log[0]


# -- the train_candidates contract ----------------------------------------------------------------------


class Observer:
    """A plugin beside LaRes: a per-step reward bonus, an extra feature, and the training hooks."""

    def __init__(self) -> None:
        self.rewards: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.contexts: dict[str, set[int]] = {}
        self.obs_dims: dict[str, set[int]] = {}
        self.events: list[tuple[str, str]] = []

    @hookimpl
    def compute_reward(self, train, batch):
        self.rewards.setdefault(train.candidate.id, []).append((batch.next_obs.clone(), batch.reward.clone()))
        self.contexts.setdefault(train.candidate.id, set()).add(id(train))
        assert 0.0 <= train.progress <= 1.0
        return torch.full_like(batch.reward, 0.25)

    @hookimpl
    def represent_state(self, train, obs):
        self.obs_dims.setdefault(train.candidate.id, set()).add(int(obs.shape[-1]))
        return obs[:, :1] * 0.0 + 1.0

    @hookimpl
    def on_train_start(self, train):
        self.events.append(("start", train.candidate.id))

    @hookimpl
    def on_rollout(self, train, batch):
        self.events.append(("rollout", train.candidate.id))

    @hookimpl
    def on_evaluation(self, train, frames, fitness, episodes):
        self.events.append(("evaluation", train.candidate.id))
        train.log_metric("observer/fitness_seen", fitness)

    @hookimpl
    def on_train_end(self, train, result):
        self.events.append(("end", train.candidate.id))
        result.metrics["observer/ended"] = 1.0

    def count(self, event: str, cid: str) -> int:
        return self.events.count((event, cid))


def test_population_trains_through_the_core_machinery_with_a_context_per_member(tmp_path):
    """Per-step hooks fire for every member with its own TrainContext; the state program and env
    configs are honoured; macros are refused as unsupported; others' candidates go to the executor."""
    observer = Observer()
    plugin, run = make_run([SMOOTH], tmp_path, extra=(observer,), population=2, elites=1, llm_freq=400, frames=800)
    seen_params: list = []
    make_env = run.task.make_env

    def recording_make_env(num_envs, seed, params=None):  # pendulum has no params: record them, build the default
        seen_params.append(params)
        return make_env(num_envs, seed, None)

    run.task.make_env = recording_make_env
    featured, plain = candidates([UPRIGHT, UPRIGHT])
    featured = Candidate(
        "it0-c0",
        0,
        reward=featured.reward,
        state=StateProgram(source=ANGLE, origin="llm_state_repr", extra_dim=2),
        envs=[EnvConfig("heavy", {"g": 12.0})],
    )
    macro = Candidate(
        "it0-c2",
        0,
        reward=RewardProgram(source=plain.reward.source, origin="lares"),
        macros=[MacroAction("spin", Program(source="def act(state):\n    return 0", entry="act"))],
    )
    other = Candidate("it0-c3", 0, reward=RewardProgram(source=plain.reward.source, origin="eureka"))

    results = run.hook.train_candidates(run=run, candidates=[featured, plain, macro, other], seed=0)

    assert len(results) == 4 and results[3] is None  # eureka's candidate: left to the executor
    assert not results[2].ok and results[2].error_kind == "unsupported" and "macro-actions (spin)" in results[2].error
    trained = {c.id: r for c, r in zip([featured, plain], results[:2])}
    for cid, result in trained.items():
        assert result.ok, result.error
        assert result.fitness is not None and result.curve and result.metrics["observer/ended"] == 1.0
        assert result.series["observer/fitness_seen"]  # what a hook logged through the member's context
        assert observer.count("start", cid) == 1 and observer.count("end", cid) == 1
        assert observer.count("evaluation", cid) >= 2  # at the LLM update and at the end
        assert len(observer.contexts[cid]) == 1  # one TrainContext per member, for every call
    assert observer.contexts["it0-c0"] != observer.contexts["it0-c1"]
    assert sum(observer.count("rollout", cid) for cid in trained) == 400  # one batch per vector step
    assert sum(r.frames for r in results[:2]) == 800
    assert "it0-c2" not in observer.contexts and "it0-c3" not in observer.contexts
    # every member's reward program labels every collected step (its own and the other's), and
    # the hook sees that program's reward as the reward so far
    for cid in trained:
        steps = observer.rewards[cid]
        assert len(steps) == 400
        for next_obs, reward in steps[:150]:  # before the LLM update (at 400 frames) both are UPRIGHT
            assert torch.allclose(reward, upright_reward(run.task.split_state(next_obs)), atol=1e-5)
    # the state program's features (2) reach the member's policy: the represent_state hook sees them
    assert observer.obs_dims["it0-c0"] == {5} and observer.obs_dims["it0-c1"] == {3}
    assert [{"g": 12.0}] * 2 in seen_params  # the env config went to the member's vector env
    # the LLM update: one analysis, one new function for the non-elite (its observation differs from the elite's or not)
    assert [c.tag for c in run.llm.calls] == ["lares-analysis-g1", "lares-evolve-g1"]
    assert sum("replaced" in r.texts["lares_history.md"] for r in results[:2]) == 1


def test_candidates_lares_did_not_propose_are_left_to_the_executor(tmp_path):
    plugin, run = make_run([UPRIGHT], tmp_path)
    program = RewardProgram(source="x", origin="eureka")
    assert (
        plugin.train_candidates(run=run, candidates=[Candidate("c", 0, reward=program), Candidate("d", 0)], seed=0)
        is None
    )
    assert run.llm.calls == []


def test_a_candidate_lares_cannot_honour_gets_an_unsupported_result_naming_the_part(tmp_path):
    plugin, run = make_run([UPRIGHT], tmp_path)
    (candidate,) = candidates(
        [UPRIGHT], macros=[MacroAction("spin", Program(source="def act(state):\n    return 0", entry="act"))]
    )
    (result,) = plugin.train_candidates(run=run, candidates=[candidate], seed=0)
    assert not result.ok and result.error_kind == "unsupported"
    assert "macro-actions (spin)" in result.error and "discrete" in result.error
    assert run.llm.calls == []  # nothing trained, nothing asked


def test_discrete_tasks_get_unsupported_results_naming_the_action_space(tmp_path):
    plugin, run = make_run([UPRIGHT], tmp_path, env="cartpole")
    program = RewardProgram(
        source="def compute_reward(state, action, next_state):\n    return next_state['pole_angle']", origin="lares"
    )
    (result,) = plugin.train_candidates(run=run, candidates=[Candidate("c", 0, reward=program)], seed=0)
    assert not result.ok and result.error_kind == "unsupported"
    assert result.error.startswith("action space") and "continuous" in result.error


# -- the method ---------------------------------------------------------------------------------------


def test_evolution_replaces_non_elites_relabels_and_reports_each_member(tmp_path):
    plugin, run = make_run([SMOOTH], tmp_path, population=3, elites=1, llm_freq=400, frames=800)
    results = plugin.train_candidates(run=run, candidates=candidates([UPRIGHT, UPRIGHT, BROKEN]), seed=0)
    assert len(results) == 3 and all(isinstance(r, TrainResult) for r in results)
    assert sum(r.frames for r in results) == 800
    tags = [c.tag for c in run.llm.calls]
    assert tags == ["lares-repair", "lares-analysis-g1", "lares-evolve-g1"]
    repair = run.llm.calls[0].messages
    assert len(repair) == 2 and "`compute_reward` for this task failed its check" in repair[-1]["content"]
    assert "`no_such_field` is not a field of this task" in repair[-1]["content"]  # refused before it ran
    assert 'return state["no_such_field"]' in repair[-1]["content"] and run.llm.calls[0].temperature == 0.2
    analysis_prompt = run.llm.calls[1].messages[0]["content"]
    assert "Episode of" in analysis_prompt and "name the defects" in analysis_prompt
    evolve = run.llm.calls[2]
    assert evolve.n == 2 and evolve.temperature == 0.4  # population 3, one elite
    assert "jitter" in evolve.last and "fitness (return)" in evolve.last
    assert all(r.ok and r.fitness is not None and r.curve for r in results)
    assert all(r.components for r in results)  # every member's components, over every transition
    assert sum("replaced" in r.texts["lares_history.md"] for r in results) == 2
    assert "effort" in results[2].texts["lares_final_reward.py"]  # repaired (or regenerated) from SMOOTH
    assert "lares/diversity" in run.tracker.metrics
    log = "\n".join(plugin.log)
    assert "## generation 1" in log and "elites:" in log and "### analysis" in log


def test_failed_functions_are_never_elites_and_all_get_regenerated(tmp_path):
    plugin, run = make_run(
        [SMOOTH],
        tmp_path,
        population=2,
        elites=1,
        retries=0,
        llm_freq=200,
        frames=400,
        trainer={"init_random_frames": 100, "batch_size": 16, "hidden": [8]},
    )
    results = plugin.train_candidates(run=run, candidates=candidates([BROKEN, BROKEN]), seed=0)
    tags = [c.tag for c in run.llm.calls]
    assert tags == ["lares-evolve-g1"]  # no behaviour to analyse, no repair allowed
    evolve = run.llm.calls[0]
    assert evolve.n == 2 and "failed (names)" in evolve.last and "no_such_field" in evolve.last
    assert all(r.ok for r in results)
    assert all("effort" in r.texts["lares_final_reward.py"] for r in results)


def test_reflect_adds_the_best_final_reward_to_the_case_base(tmp_path):
    plugin, run = make_run([UPRIGHT], tmp_path, retrieval=True, case_min_fitness=-500.0)
    program = RewardProgram(source="old", origin="lares")
    result = TrainResult(
        "c", ok=True, fitness=Fitness("return", -150.0), texts={"lares_final_reward.py": "evolved code"}
    )
    text = plugin.reflect(run=run, result=IterationResult(0, [Candidate("c", 0, reward=program)], [result]))
    assert "case base (1 cases)" in text
    assert "### `c`, the best of this iteration" in text and "```python\nevolved code\n```" in text
    assert text.startswith("### Iteration 0: population of 1 (1 sampled, 1 usable, 1 trained)")
    assert lares.load_cases(tmp_path / "lares_cases.json")[0]["code"] == "evolved code"
    plugin.on_run_end(run=run, best=None)
    assert fakes.texts_of(run)["lares/best_reward.py"] == "evolved code"
    fresh = plugin_object(lares, retrieval=True)
    fresh.on_run_start(run=run)
    assert fresh.cases and fresh.cases[0]["code"] == "evolved code"  # the next run reads the case base


@pytest.mark.slow
def test_a_run_with_lares_and_eureka_trains_lares_candidates_jointly_and_the_others_by_the_executor(
    make_config, monkeypatch
):
    """The loop hands the candidates lares did not propose (None in its answer) to the executor."""
    from core.loop import run_experiment
    from core.testing.contract import Recorder

    fakes.install_fake_litellm(monkeypatch)
    cfg = make_config(
        [
            "+plugins=[lares,eureka]",
            "env=pendulum",
            "trainer=sac",
            "trainer.frames=600",
            "trainer.init_random_frames=100",
            "trainer.updates_per_frame=0.25",
            "trainer.batch_size=32",
            "trainer.hidden=[32,32]",
            "trainer.eval_episodes=1",
            "trainer.eval_every=0",
            "plugins.lares.population=2",
            "plugins.lares.elites=1",
            "plugins.lares.llm_freq=300",
            "plugins.eureka.iterations=1",
            "plugins.eureka.samples=1",
            "executor=inprocess",
            "save_policy=false",
            *fakes.FAKE_LLM_OVERRIDES,
        ]
    )
    recorder = Recorder()
    run_experiment(cfg, extra_plugins=(recorder,))
    origins = [(c.reward.origin, r) for c, r in recorder.trained]
    assert sorted(o for o, _ in origins) == ["eureka", "lares", "lares"], recorder.report()
    assert all(r.ok for _, r in origins), recorder.report()
    assert all(
        ("lares/generation" in r.metrics) == (o == "lares") for o, r in origins
    )  # only lares's were its population


@pytest.mark.slow
def test_end_to_end_on_pendulum_with_the_embedded_model(tmp_path: Path):
    """``python -m core +plugins=[lares] trainer=sac``, one LLM update; check MLflow."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    args = [
        "+plugins=[lares]", "env=pendulum", "trainer=sac",
        "plugins.lares.population=2", "plugins.lares.elites=1", "plugins.lares.llm_freq=600",
        "plugins.lares.max_tokens=300", "plugins.lares.analysis_tokens=80", "plugins.lares.retries=1",
        "trainer.frames=1000", "trainer.init_random_frames=200", "trainer.updates_per_frame=0.25",
        "trainer.hidden=[32,32]", "trainer.batch_size=64", "trainer.eval_episodes=1", "executor=inprocess",
        "progress=false", "save_policy=false",
    ]  # fmt: skip
    proc = run_cli(tmp_path, *args, env=env, timeout=900)
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


# -- end to end: the LLM's reward trains the population (plumbing), and a run whose every reward fails --------------


def _run_lares(make_config, overrides):
    """One in-process LaRes run on Pendulum with a tiny SAC; (summary, recorder)."""
    from core.loop import run_experiment
    from core.testing.contract import SMOKE_BASE, Recorder

    recorder = Recorder()
    cfg = make_config(
        [
            "+plugins=[lares]",
            "env=pendulum",
            "trainer=sac",
            "trainer.frames=600",
            "trainer.init_random_frames=100",
            "trainer.updates_per_frame=0.25",
            "trainer.batch_size=32",
            "trainer.hidden=[32,32]",
            "plugins.lares.population=2",
            "plugins.lares.elites=1",
            "plugins.lares.llm_freq=300",
            *SMOKE_BASE,
            "trainer.eval_episodes=1",
            *overrides,
        ]
    )
    return run_experiment(cfg, extra_plugins=(recorder,)), recorder


def test_the_llms_reward_functions_train_the_population_and_their_components_are_logged(make_config, monkeypatch):
    """Plumbing, not the model: the shared fake LLM (:func:`fakes.install_fake_litellm`)
    answers through the real client; each member of the population trains on a reward
    function extracted from its replies, whose components are logged."""
    llm = fakes.install_fake_litellm(monkeypatch)
    summary, recorder = _run_lares(make_config, [])
    assert llm.count("def compute_reward") >= 2
    members = [(c, r) for c, r in recorder.trained if c.reward is not None and c.reward.origin == "lares"]
    assert len(members) == 2 and summary.failed == 0, recorder.report()
    for candidate, result in members:
        assert fakes.MARK in candidate.reward.source and result.ok and result.frames > 0
        assert "lares/generation" in result.metrics
        alive = [v for _, v in result.components.get("alive", [])]
        assert alive and alive == pytest.approx([1.0] * len(alive)), result.components  # the program ran on each step


BROKEN_REWARD = """```python
import torch


def compute_reward(state, action, next_state):
    return next_state["no_such_field"] * 2.0, {}
```"""


def test_a_run_whose_every_reward_fails_records_each_failure(make_config, monkeypatch):
    """Failure handling (the fake LLM only writes rewards that read a field Pendulum
    lacks): no member trains on an LLM reward, each is recorded failed with the reason."""
    fakes.install_fake_litellm(
        monkeypatch, reply=lambda m: BROKEN_REWARD if "compute_reward" in fakes.answer(m) else fakes.answer(m)
    )
    summary, recorder = _run_lares(make_config, ["plugins.lares.retries=0"])
    members = [(c, r) for c, r in recorder.trained if c.reward is not None and c.reward.origin == "lares"]
    assert members and summary.failed >= len(members), recorder.report()
    assert all(not r.ok and "no_such_field" in r.error for _, r in members), recorder.report()
