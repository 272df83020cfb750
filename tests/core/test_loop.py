from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlflow
from omegaconf import open_dict

import core.loop
from core.config import PluginConfig, Settings
from core.loop import Loop, combine, run_experiment
from core.records import Candidate, EnvConfig, IterationResult, RewardProgram, StateProgram
from core.registry import call_each, load_plugins, make_plugin_manager
from core.tracking import Tracker


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


# -- hook results credited by plugin -----------------------------------------------------

ALPHA = '''
    """Proposes rewards (one naming its own origin) and reflects on every iteration."""

    from dataclasses import dataclass

    from core import PluginConfig, hookimpl
    from core.records import RewardProgram


    @dataclass
    class Config(PluginConfig):
        propose: bool = True  # propose two constant rewards


    class Plugin:
        def __init__(self, config: Config) -> None:
            self.config = config

        @hookimpl
        def propose_rewards(self, run, iteration):
            if not self.config.propose:
                return None
            source = "def compute_reward(state, action, next_state):\\n    return 1.0\\n"
            return [RewardProgram(source=source), RewardProgram(source=source, origin="mine")]

        @hookimpl
        def reflect(self, run, result):
            return f"alpha's reflection on iteration {result.iteration}"
'''

BETA = '''
    """Has nothing to say after an iteration (a module of hook functions, no state)."""

    from core import hookimpl


    @hookimpl
    def reflect(run, result):
        return None
'''


def _alpha_beta(local_plugins, tiny_run, **alpha):
    local_plugins("alpha", ALPHA)
    local_plugins("beta", BETA)
    cfg = tiny_run("save_policy=false")
    with open_dict(cfg):
        cfg.plugins = {"alpha": alpha, "beta": {}}  # registered in this order: pluggy calls beta first
    return cfg


def test_a_reflection_is_saved_under_the_plugin_that_wrote_it(local_plugins, tiny_run):
    """The loop once paired pluggy's results (Nones dropped) with plugin names: alpha's text went to beta."""
    cfg = _alpha_beta(local_plugins, tiny_run, propose=False, iterations=2)
    summary = run_experiment(cfg)
    client = mlflow.MlflowClient(cfg.tracking.uri)
    saved = sorted(a.path for a in client.list_artifacts(summary.run_id, "reflection"))
    assert saved == ["reflection/it0-alpha.md", "reflection/it1-alpha.md"]
    text = client.download_artifacts(summary.run_id, "reflection/it1-alpha.md", str(cfg.cache_dir))
    assert Path(text).read_text() == "alpha's reflection on iteration 1"


ONCE = '''
    """Plans, proposes and reflects in every round it is asked; records each call."""

    from core import PluginConfig, hookimpl


    class Plugin:
        def __init__(self, config: PluginConfig) -> None:
            self.calls = []

        @hookimpl
        def plan(self, run, iteration):
            self.calls.append(("plan", iteration))

        @hookimpl
        def propose_rewards(self, run, iteration):
            self.calls.append(("propose_rewards", iteration))

        @hookimpl
        def reflect(self, run, result):
            self.calls.append(("reflect", result.iteration))
'''


def test_a_plugin_whose_iterations_are_over_is_no_longer_asked(local_plugins, tiny_run):
    """once has 1 iteration in a run of 2 (alpha's): the loop skips its plan, proposals and reflection after it."""
    local_plugins("once", ONCE)
    cfg = _alpha_beta(local_plugins, tiny_run, propose=False, iterations=2)
    with open_dict(cfg):
        cfg.plugins["once"] = {"iterations": 1}
    loop = Loop(cfg)
    assert loop.retired(0) == frozenset() and loop.retired(1) == {"beta", "once"}  # beta: the default 1
    loop.execute()
    once = loop.runtime.pluginmanager.get_plugin("once")
    assert once.calls == [("plan", 0), ("propose_rewards", 0), ("reflect", 0)]
    assert len(loop.run.history) == 2


def test_proposals_are_marked_with_their_plugin_unless_they_name_one(local_plugins, tiny_run):
    loop = Loop(_alpha_beta(local_plugins, tiny_run))
    candidates = loop.propose(0)
    assert sorted(c.reward.origin for c in candidates) == ["alpha", "mine"]


def test_call_each_pairs_every_result_with_its_plugin(local_plugins):
    local_plugins("alpha", ALPHA)
    local_plugins("beta", BETA)
    pm = make_plugin_manager(modules=load_plugins(["alpha", "beta"]))
    result = IterationResult(3, [], [])
    assert pm.hook.reflect(run=None, result=result) == ["alpha's reflection on iteration 3"]  # pluggy drops the None
    pairs = call_each(pm, "reflect", run=None, result=result)
    assert pairs == [("beta", None), ("alpha", "alpha's reflection on iteration 3")]


WRAPPER = '''
    """Wraps the other plugins' hooks: sees each plugin's proposals, signs each reflection."""

    from core import hookimpl


    class Plugin:
        def __init__(self, config) -> None:
            self.seen: list[list[int]] = []  # per wrapped call: the size of each proposal list in it

        @hookimpl(wrapper=True)
        def propose_rewards(self, run, iteration):
            proposals = yield
            self.seen.append([len(p) for p in proposals])
            return proposals

        @hookimpl(wrapper=True)
        def reflect(self, run, result):
            texts = yield
            return [f"{text} (seen by wrapper)" for text in texts]
'''

DELTA = '''
    """Proposes one constant reward (a module of hook functions)."""

    from core import hookimpl
    from core.records import RewardProgram


    @hookimpl
    def propose_rewards(run, iteration):
        return [RewardProgram(source="def compute_reward(state, action, next_state):\\n    return 2.0\\n")]
'''


def test_a_wrapper_wraps_each_plugins_call_and_the_pairs_stay(local_plugins):
    """call_each goes through pluggy: a wrapper's answer is what each plugin is credited with,
    and a plugin that only wraps is credited with nothing."""
    from core.registry import call_plugin

    for name, source in (("alpha", ALPHA), ("beta", BETA), ("wrapper", WRAPPER)):
        local_plugins(name, source)
    pm = make_plugin_manager(modules=load_plugins(["alpha", "beta", "wrapper"]))
    result = IterationResult(3, [], [])
    wrapped = "alpha's reflection on iteration 3 (seen by wrapper)"
    assert call_each(pm, "reflect", run=None, result=result) == [("beta", None), ("alpha", wrapped)]
    assert call_plugin(pm, "reflect", "alpha", run=None, result=result) == wrapped
    assert call_plugin(pm, "reflect", "beta", run=None, result=result) is None
    assert call_plugin(pm, "reflect", "wrapper", run=None, result=result) is None  # wrappers alone are not an answer


def test_a_wrapper_of_a_proposal_hook_sees_each_plugins_proposals(local_plugins, tiny_run):
    for name, source in (("alpha", ALPHA), ("delta", DELTA), ("wrapper", WRAPPER)):
        local_plugins(name, source)
    cfg = tiny_run("save_policy=false")
    with open_dict(cfg):
        cfg.plugins = {"alpha": {}, "delta": {}, "wrapper": {}}
    loop = Loop(cfg)
    candidates = loop.propose(0)
    assert loop.runtime.pluginmanager.get_plugin("wrapper").seen == [[1], [2]]  # delta's call, then alpha's
    assert sorted(c.reward.origin for c in candidates) == ["alpha", "delta", "mine"]


def test_a_wrapped_reflection_is_saved_as_the_wrapper_returns_it(local_plugins, tiny_run):
    """A ``wrapper=True`` reflect in a real run: the text saved is the wrapped one, never a generator."""
    local_plugins("wrapper", WRAPPER)
    cfg = _alpha_beta(local_plugins, tiny_run, propose=False)
    with open_dict(cfg):
        cfg.plugins.wrapper = {}
    summary = run_experiment(cfg)
    client = mlflow.MlflowClient(cfg.tracking.uri)
    saved = sorted(a.path for a in client.list_artifacts(summary.run_id, "reflection"))
    assert saved == ["reflection/it0-alpha.md"]
    text = client.download_artifacts(summary.run_id, "reflection/it0-alpha.md", str(cfg.cache_dir))
    assert Path(text).read_text() == "alpha's reflection on iteration 0 (seen by wrapper)"


# -- a reply with no usable program is recorded, never trained -----------------------------------

GAMMA = '''
    """Proposes a usable reward and a rejected reply (as a code-writing plugin does with program_from_reply)."""

    from core import hookimpl
    from core.records import RewardProgram


    @hookimpl
    def propose_rewards(run, iteration):
        good = RewardProgram(source="def compute_reward(state, action, next_state):\\n    return 1.0\\n",
                             meta={"sample": 0})
        bad = RewardProgram(source="", reply="Reward balance.", rejected="The reply contains no code.",
                            meta={"sample": 1, "rejected_kind": "no_code"})
        return [good, bad]
'''


def test_a_rejected_proposal_is_a_candidate_of_its_own_that_never_trains(local_plugins, tiny_run):
    local_plugins("gamma", GAMMA)
    cfg = tiny_run("save_policy=false", "resume=false")
    with open_dict(cfg):
        cfg.plugins = {"gamma": {}}
    loop = Loop(cfg)
    candidates = loop.propose(0)
    assert [(c.id, c.rejected) for c in candidates] == [("it0-c0", ""), ("it0-c1", "The reply contains no code.")]
    assert candidates[1].reward.origin == "gamma" and candidates[1].reward.reply == "Reward balance."
    good, bad = loop.train(candidates, 0, None)
    assert good.ok and good.frames > 0
    assert (bad.ok, bad.error_kind, bad.error, bad.frames) == (False, "rejected", "The reply contains no code.", 0)


# -- a candidate that cannot be recorded fails alone -----------------------------------------------


class _RefusesOne(Tracker):
    """A tracker that fails, as MLflow once did on a component name, while recording ``it0-c0``:
    its run made, then an error."""

    def log_candidate(self, candidate, result, tags, ended=None):
        if candidate.id == "it0-c0":
            from mlflow.exceptions import MlflowException
            from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

            run = self.client.create_run(
                self.experiment_id, tags={MLFLOW_PARENT_RUN_ID: self.parent_id, "candidate": candidate.id}
            )
            result.run_id = run.info.run_id
            raise MlflowException("Invalid metric name: 'components/angle (rad)'")
        return super().log_candidate(candidate, result, tags, ended)


def test_a_candidate_whose_recording_fails_fails_alone_and_the_run_goes_on(local_plugins, tiny_run, monkeypatch):
    monkeypatch.setattr(core.loop, "Tracker", _RefusesOne)
    cfg = _alpha_beta(local_plugins, tiny_run, iterations=2)
    summary = run_experiment(cfg)
    assert summary.candidates == 4 and summary.failed == 1 and summary.best_id != "it0-c0"
    client = mlflow.MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary.run_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{summary.run_id}'")
    by_candidate = {c.data.tags["candidate"]: c for c in children}
    assert set(by_candidate) == {"it0-c0", "it0-c1", "it1-c0", "it1-c1"}  # the later iteration ran
    assert not [c for c in children if c.info.status == "RUNNING"]
    failed = by_candidate["it0-c0"]
    assert failed.info.status == "FAILED" and failed.data.tags["error_kind"] == "tracking"
    assert "components/angle (rad)" in failed.data.tags["error"]
    assert all(by_candidate[c].info.status == "FINISHED" for c in ("it0-c1", "it1-c0", "it1-c1"))
    assert summary.first_error.startswith("Recording the candidate in MLflow failed: MlflowException")


def test_the_names_mended_before_a_program_ran_are_tagged_on_its_candidate():
    from core.loop import _reply_tags

    program = RewardProgram(
        source="x", meta={"sample": 2, "fixes": ["field `pole_angel` (line 2) read as `pole_angle`"]}
    )
    tags = _reply_tags(Candidate(id="it0-c0", iteration=0, reward=program))
    assert tags["name_fixes"] == "field `pole_angel` (line 2) read as `pole_angle`" and tags["sample"] == "2"


def test_a_run_hides_its_records_from_the_programs_workers(local_plugins, tiny_run, monkeypatch):
    """Its MLflow store, results store and LLM cache are hidden in every worker's mount namespace."""
    import os

    from core.sandbox.host import RECORDS_ENV

    monkeypatch.delenv(RECORDS_ENV, raising=False)
    cfg = _alpha_beta(local_plugins, tiny_run, propose=False, iterations=1)
    run_experiment(cfg)
    hidden = os.environ[RECORDS_ENV].split(os.pathsep)
    db = os.path.realpath(cfg.tracking.uri[len("sqlite:///") :])
    assert db in hidden and db + "-journal" in hidden
    assert any(p.endswith("llm4rl-results.sqlite") for p in hidden)
    assert any(p.endswith("llm_cache.sqlite") for p in hidden)
