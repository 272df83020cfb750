"""Two runs in one process share nothing: per-run plugin objects, per-run worker runtimes.

A notebook, a launcher or a Ray worker may hold several runs at once and step them in
turn; each run's plugins must see only that run.
"""

from __future__ import annotations

from collections import OrderedDict

from omegaconf import OmegaConf, open_dict

import core.jobs
from core.config import validate
from core.executor import TrainJob, run_job
from core.loop import Loop
from core.records import Candidate
from core.registry import load_plugins, make_plugin_manager

#: keeps what it saw on its own object; reports it through the contexts
PROBE = '''
    """A probe plugin: counts what it sees, on its own object."""

    from dataclasses import dataclass

    from core import PluginConfig, hookimpl

    NAME = "probe"


    @dataclass
    class Config(PluginConfig):
        tag: str = "none"  # names the run in what the plugin reports


    class Plugin:
        def __init__(self, config: Config) -> None:
            self.config = config
            self.iterations: list[tuple[str, int]] = []  # (the run's tag as the run context gives it, iteration)
            self.trainings = 0

        @hookimpl
        def on_iteration_start(self, run, iteration):
            self.iterations.append((run.plugin_config("probe").tag, iteration))

        @hookimpl
        def plan(self, run, iteration):
            return f"{self.config.tag} {iteration}"

        @hookimpl
        def on_train_end(self, train, result):
            self.trainings += 1
            seen = train.plugin_config("probe").tag
            train.log_text("probe.txt", f"{id(self)} {self.config.tag} {seen} {self.trainings}")
'''


def _config(tiny_run, tag: str, seed: int = 0):
    cfg = tiny_run(f"seed={seed}", "save_policy=false", "resume=false")
    with open_dict(cfg):
        cfg.plugins = {"probe": {"tag": tag, "iterations": 2}}  # past its iterations the loop stops asking it to plan
    return cfg


def _plugin(loop: Loop):
    (impl,) = loop.run.hook.on_iteration_start.get_hookimpls()
    return impl.plugin


def test_two_loops_stepped_in_turn_keep_their_own_plugin_objects(local_plugins, tiny_run):
    local_plugins("probe", PROBE)
    a, b = Loop(_config(tiny_run, "a", seed=0)), Loop(_config(tiny_run, "b", seed=1))
    assert _plugin(a) is not _plugin(b) and type(_plugin(a)) is type(_plugin(b))
    results = {"a": [], "b": []}
    for iteration in range(2):  # a, b, a, b
        for tag, loop in (("a", a), ("b", b)):
            results[tag].append(loop.iterate(iteration))
    for tag, loop in (("a", a), ("b", b)):
        plugin = _plugin(loop)
        assert plugin.config.tag == tag
        assert plugin.iterations == [(tag, 0), (tag, 1)]
        assert plugin.trainings == 2
        assert [it.iteration for it in loop.run.history] == [0, 1]
        for it in results[tag]:
            (candidate,) = it.candidates
            (result,) = it.results
            assert result.ok, result.error
            assert candidate.plan.text == f"{tag} {it.iteration}"
            assert result.texts["probe.txt"].split()[1:] == [tag, tag, str(it.iteration + 1)]


def test_two_plugin_managers_make_two_plugin_objects(local_plugins):
    local_plugins("probe", PROBE)
    modules = load_plugins(["probe"])
    managers = {}
    for tag in ("a", "b"):
        settings = validate(OmegaConf.create({"plugins": {"probe": {"tag": tag}}}), modules)
        managers[tag] = make_plugin_manager(settings, modules)
    plugins = {tag: pm.get_plugin("probe") for tag, pm in managers.items()}
    assert plugins["a"] is not plugins["b"]
    assert (plugins["a"].config.tag, plugins["b"].config.tag) == ("a", "b")

    class Run:  # just enough of a run context for this hook
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def plugin_config(self, name: str):
            return type("C", (), {"tag": self.tag})

    for i in range(2):
        for tag in ("b", "a"):
            managers[tag].hook.on_iteration_start(run=Run(tag), iteration=i)
    assert plugins["a"].iterations == [("a", 0), ("a", 1)]
    assert plugins["b"].iterations == [("b", 0), ("b", 1)]


def test_a_worker_keeps_one_runtime_per_run_for_interleaved_jobs(local_plugins, tiny_run, monkeypatch):
    """Pool and Ray workers build a run's plugins once and keep them while other runs' jobs come in."""
    local_plugins("probe", PROBE)
    monkeypatch.setattr(core.jobs, "_RUNTIMES", OrderedDict())
    containers = {}
    for tag in ("a", "b"):
        container = OmegaConf.to_container(_config(tiny_run, tag), resolve=True)
        container.pop("hydra", None)
        containers[tag] = container
    order = ["a", "b", "a", "b", "a"]
    seen: dict[str, list[list[str]]] = {"a": [], "b": []}
    for n, tag in enumerate(order):
        job = TrainJob(containers[tag], Candidate(f"{tag}{n}", 0), seed=0, run_key=f"run-{tag}")
        result = run_job(job)  # no runtime given: the worker's own, as in a pool process
        assert result.ok, result.error
        seen[tag].append(result.texts["probe.txt"].split())
    for tag, reports in seen.items():
        assert len({r[0] for r in reports}) == 1, "one plugin object per run in this worker"
        assert all(r[1:3] == [tag, tag] for r in reports)
        assert [r[3] for r in reports] == [str(k + 1) for k in range(len(reports))]
    assert seen["a"][0][0] != seen["b"][0][0]
    assert list(core.jobs._RUNTIMES) == ["run-b", "run-a"]


def test_a_job_without_a_run_gets_a_runtime_of_its_own(local_plugins, tiny_run, monkeypatch):
    local_plugins("probe", PROBE)
    monkeypatch.setattr(core.jobs, "_RUNTIMES", OrderedDict())
    container = OmegaConf.to_container(_config(tiny_run, "a"), resolve=True)
    container.pop("hydra", None)
    reports = [
        run_job(TrainJob(container, Candidate(f"c{i}", 0), seed=0, run_key="")).texts["probe.txt"].split()
        for i in range(2)
    ]
    assert [r[3] for r in reports] == ["1", "1"]
    assert not core.jobs._RUNTIMES
