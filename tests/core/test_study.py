"""The study command: the spec, its cells, a tiny study run, interrupted and resumed, and its document."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest
import yaml

import core.config
import core.loop
from core.errors import UserError
from core.study import FRESH_SCORE, error_line, expand, load_spec, main, tracking_uri
from core.testing import fakes

ISSUE_TASKS = {"cartpole", "mountaincar", "acrobot", "pendulum", "lunarlander", "hopper", "reach", "crafter"}
METHODS = {
    "eureka",
    "text2reward",
    "lares",
    "llm_state_repr",
    "progress_reward",
    "rlaif_preference",
    "envgen",
    "rl_gpt",
}
#: the action and planning roles' plugins, on Crafter (their own task)
ROLE_METHODS = {"ellm", "saycan", "plan4mc"}
#: every training of a test cell takes about a second, in this process
TINY = [
    "trainer.num_envs=4",
    "trainer.rollout_steps=32",
    "trainer.epochs=1",
    "trainer.minibatch=64",
    "trainer.hidden=[16]",
    "trainer.eval_episodes=2",
    "executor=inprocess",
    "tracking.log_plots=false",
    "save_policy=false",
]


def _runs(store: Path, experiment: str = "results") -> list:
    client = mlflow.MlflowClient(tracking_uri=tracking_uri(store))
    exp = client.get_experiment_by_name(experiment)
    return [r for r in client.search_runs([exp.experiment_id]) if "study.cell" in r.data.tags]


# -- the spec and its cells -------------------------------------------------------------------


def test_the_results_spec_has_the_issue_tasks_the_baselines_and_every_method():
    spec = load_spec("results")
    assert set(spec.tasks) == ISSUE_TASKS
    controls = {"progress_no_llm", "saycan_uniform", "rlaif_ties", "ellm_fixed", "plan4mc_rules"}
    assert set(spec.arms) == {"random", "sparse", "human", "shaped", "eureka_1x8"} | controls | METHODS | ROLE_METHODS
    assert spec.arms["progress_no_llm"].plugins == ["progress_reward"]  # the control runs the method, LLM weight 0
    assert all(spec.arms[name].tasks == ["crafter"] for name in ROLE_METHODS | controls - {"progress_no_llm"})
    assert spec.arms["sparse"].overrides == ["env.reward=sparse"] and spec.arms["sparse"].tasks is None
    assert spec.arms["human"].overrides == ["env.reward=human"] and spec.arms["human"].tasks is None
    assert spec.arms["envgen"].tasks == ["crafter"]  # the only task with controllable params
    assert len(spec.seeds) >= 5 and spec.final_seeds >= 1
    assert all(
        arm.search
        for name, arm in spec.arms.items()
        if name
        not in {"random", "sparse", "human", "shaped", "progress_reward", "rlaif_preference"} | controls | ROLE_METHODS
    )
    assert spec.arms["random"].trainer == "random" and spec.arms["shaped"].tasks == ["mountaincar"]
    # reflection's ablation: the same number of samples in one round
    assert spec.arms["eureka_1x8"].overrides == ["plugins.eureka.iterations=1", "plugins.eureka.samples=8"]
    assert spec.arms["progress_no_llm"].control_of == "progress_reward"
    # saycan's control: the LLM's distribution to the power 0, a uniform prior
    assert spec.arms["saycan_uniform"].control_of == "saycan"
    assert spec.arms["saycan_uniform"].overrides == ["plugins.saycan.weight=0.0"]


def test_every_in_training_llm_arm_has_a_control_that_removes_only_its_llm():
    """A control runs the same plugin with the LLM's part switched off by the plugin's own knob."""
    spec = load_spec("results")
    knobs = {
        "progress_no_llm": "plugins.progress_reward.stages.",
        "saycan_uniform": "plugins.saycan.weight=0.0",
        "rlaif_ties": "plugins.rlaif_preference.control=ties",
        "ellm_fixed": "plugins.ellm.goals=fixed",
        "plan4mc_rules": "plugins.plan4mc.plan_source=rules",
    }
    for control, knob in knobs.items():
        arm = spec.arms[control]
        method = spec.arms[arm.control_of]
        assert arm.plugins == method.plugins and arm.tasks == method.tasks or arm.tasks == ["crafter"], control
        assert any(o.startswith(knob) for o in arm.overrides), control
        # everything else the method sets, the control sets too
        assert set(method.overrides) <= set(arm.overrides), control
    assert {spec.arms[c].control_of for c in knobs} == {
        "progress_reward",
        "saycan",
        "rlaif_preference",
        "ellm",
        "plan4mc",
    }


def test_every_task_that_scores_targets_is_calibrated_on_an_arm_it_runs():
    spec = load_spec("results")
    for name in ("cartpole", "mountaincar", "acrobot", "pendulum", "lunarlander"):
        calibration = spec.tasks[name].calibration
        arm = spec.arms[calibration.arm]
        assert calibration.threshold is not None and calibration.note, name
        assert arm.tasks is None or name in arm.tasks, name
    assert spec.tasks["mountaincar"].calibration.arm == "shaped" and len(spec.tasks["mountaincar"].seeds) == 8
    crafter = spec.tasks["crafter"].calibration  # no "solved" score: the designers' reward must beat random
    assert crafter.arm == "human" and crafter.beats == "random" and crafter.threshold is None and crafter.note


def test_the_random_arm_drops_the_tasks_trainer_settings_and_keeps_its_env():
    spec = load_spec("results")
    cells = {c.task: c for c in expand(spec, arms=["random"], seeds=[0])}
    pendulum, mountaincar = cells["pendulum"].overrides, cells["mountaincar"].overrides
    assert "trainer=random" in pendulum and "trainer=sac" not in pendulum
    assert not any(o.startswith("trainer.init_random_frames") for o in pendulum)
    assert "env=mountaincar" in mountaincar and not any(o.startswith("trainer.lr") for o in mountaincar)


def test_cells_are_each_arm_on_the_tasks_it_applies_to_for_every_seed():
    spec = load_spec("results")
    cells = expand(spec)
    expected = sum(
        len(task.seeds or spec.seeds)
        for name, task in spec.tasks.items()
        for arm in spec.arms.values()
        if arm.tasks is None or name in arm.tasks
    )
    assert len(cells) == expected
    names = {c.name for c in cells}
    assert len(names) == len(cells)
    for task in spec.tasks:
        for seed in spec.tasks[task].seeds or spec.seeds:
            assert {f"sparse-{task}-s{seed}", f"human-{task}-s{seed}", f"eureka-{task}-s{seed}"} <= names
    assert {c.task for c in cells if c.arm == "lares"} == {"pendulum", "hopper", "reach"}
    assert [c.seed for c in cells] == sorted(c.seed for c in cells)  # whole seeds first
    eureka = next(c for c in cells if c.name == "eureka-cartpole-s0")
    assert "+plugins=[eureka]" in eureka.overrides and "trainer.frames=100000" in eureka.overrides
    assert eureka.final_seeds == spec.final_seeds and eureka.score_metric == FRESH_SCORE
    human = next(c for c in cells if c.name == "human-cartpole-s0")
    assert "final_seeds=0" in human.overrides and human.score_metric == "fitness"
    # the same final-policy budget for every arm of a task
    assert {c.frames for c in cells if c.task == "cartpole"} == {100000}


def test_options_shrink_the_study():
    spec = load_spec("results")
    (cell,) = expand(spec, tasks=["pendulum"], arms=["human"], seeds=[3], frames_scale=0.1, extra=("trainer.lr=0.01",))
    assert cell.name == "human-pendulum-s3" and cell.frames == 2000
    for override in (
        "trainer=sac",
        "trainer.frames=2000",
        "trainer.eval_every=500",
        "trainer.init_random_frames=100",
        "seed=3",
        "trainer.lr=0.01",
    ):
        assert override in cell.overrides
    human, eureka = expand(
        spec, tasks=["cartpole"], arms=["human", "eureka"], seeds=[0], extra=("plugins.eureka.samples=2",)
    )
    assert "plugins.eureka.samples=2" in eureka.overrides and "plugins.eureka.samples=2" not in human.overrides
    assert human.ignored == ("plugins.eureka.samples=2",) and eureka.ignored == ()
    with pytest.raises(UserError, match="Did you mean 'cartpole'"):
        expand(spec, tasks=["cartpol"])
    with pytest.raises(UserError, match="Unknown arm 'eurika'"):
        expand(spec, arms=["eurika"])


def test_a_plugin_knob_set_for_the_study_is_checked_like_the_command_line():
    spec = load_spec("results")
    with pytest.raises(UserError, match=r"without '\+' \('plugins.eureka.samples=2'\).*Sweeping a plugin's knob"):
        expand(spec, tasks=["cartpole"], arms=["human", "eureka"], extra=("+plugins.eureka.samples=2",))
    with pytest.raises(UserError, match="plugin 'eureka', which no selected arm runs"):
        expand(spec, tasks=["cartpole"], arms=["human"], extra=("plugins.eureka.samples=2",))


def test_a_failure_is_reported_by_the_line_that_names_it():
    torch_error = (
        "Traceback (most recent call last):\n  File x\nTypeError: sum() received an invalid combination of arguments\n"
        " * (Tensor input, *, torch.dtype dtype = None)\n * (Tensor input, int dim, bool keepdim = False)"
    )
    assert error_line(torch_error) == "TypeError: sum() received an invalid combination of arguments"
    assert error_line("the program took too long") == "the program took too long"


def test_a_spec_that_names_an_unknown_task_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\nstore: s\nout: o.md\nseeds: [0]\ntasks: {cartpole: {env: cartpole, frames: 10}}\n"
        "arms: {x: {tasks: [cartpol]}}\n"
    )
    with pytest.raises(UserError, match="arm 'x' names unknown task"):
        load_spec(str(path))
    with pytest.raises(UserError, match="No study spec 'resluts'. Did you mean 'results'"):
        load_spec("resluts")
    path.write_text(
        "name: bad\nstore: s\nout: o.md\nseeds: [0]\narms: {human: {}}\n"
        "tasks: {crafter: {env: minecraft, frames: 10, calibration: {beats: randmo, threshold: 2}}}\n"
    )
    with pytest.raises(UserError, match="calibrated against arm 'randmo', which is not an arm") as err:
        load_spec(str(path))
    assert "a threshold or an arm to beat, not both" in str(err.value)


# -- running -------------------------------------------------------------------------------


def test_a_tiny_study_runs_is_resumed_after_an_interruption_and_writes_its_results(tmp_path, monkeypatch):
    store, out = tmp_path / "store", tmp_path / "docs" / "results.md"
    argv = [
        "results",
        "--tasks",
        "cartpole,mountaincar",
        "--arms",
        "sparse,human",
        "--seeds",
        "0,1",
        "--frames-scale",
        "0.01",
        "--reps",
        "200",
        "--store",
        str(store),
        "--out",
        str(out),
        "--set",
        *TINY,
        f"cache_dir={tmp_path / 'cache'}",
    ]
    real = core.loop.run_experiment
    calls: list[str] = []
    same_code = lambda: monkeypatch.setattr(core.config, "framework_hash", lambda: "code")  # noqa: E731 - others may edit the checkout meanwhile
    same_code()

    def interrupted_on_the_fourth(config, extra_plugins=(), tags=None):
        calls.append(str(config.run_name))
        if len(calls) == 4:  # the run starts, then the user presses Ctrl-C
            monkeypatch.setattr(core.loop.Loop, "execute", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
        return real(config, extra_plugins, tags)

    monkeypatch.setattr(core.loop, "run_experiment", interrupted_on_the_fourth)
    assert main(argv) == 130
    assert calls == ["sparse-cartpole-s0", "human-cartpole-s0", "sparse-mountaincar-s0", "human-mountaincar-s0"]
    assert sorted(r.info.status for r in _runs(store)) == ["FINISHED"] * 3 + ["KILLED"]
    assert not out.exists()

    monkeypatch.undo()
    same_code()
    monkeypatch.setattr(
        core.loop, "run_experiment", lambda c, e=(), tags=None: calls.append(str(c.run_name)) or real(c, e, tags)
    )
    calls.clear()
    assert main(argv) == 0
    assert calls == [
        "human-mountaincar-s0",
        "sparse-cartpole-s1",
        "human-cartpole-s1",
        "sparse-mountaincar-s1",
        "human-mountaincar-s1",
    ]  # only what had not finished
    calls.clear()
    assert main(argv) == 0 and calls == []  # everything finished: nothing runs again
    finished = [r for r in _runs(store) if r.info.status == "FINISHED"]
    assert len(finished) == 8 and all(r.data.tags["study"] == "results" for r in finished)
    assert {r.data.tags["study.arm"] for r in finished} == {"sparse", "human"}
    assert all(r.data.metrics["study/seconds"] > 0 for r in finished)

    text = out.read_text()
    assert "A reduced run of the study" in text
    assert "- Command: `python -m core.study results --tasks cartpole,mountaincar --arms sparse,human" in text
    assert (
        "- Commit: `" in text
        and "- Machine: " in text
        and " cores" in text
        and "load average" in text
        and "as the cells started" in text
    )
    assert "- Study wall time: " in text and "summed over the 8 counted runs" in text
    assert "this invocation ran 0 cell(s) and skipped 8" in text
    assert "- Projected at the spec's frames: " in text and "for the same 8 runs" in text
    assert "| task (fitness) | sparse | human |" in text
    summary = text.split("## Summary")[1].split("## Scores")[0]  # the random arm did not run in this reduced study
    assert "- **cartpole**: calibration: human " in summary and "— random not run" in summary
    assert "| cartpole (return) |" in text and "| mountaincar (success_rate) |" in text
    assert text.count("| sparse | 2/2 |") == 2 and text.count("| human | 2/2 |") == 2  # per task, both seeds
    assert "KILLED" not in text.split("## Runs left out")[0]  # the interrupted attempt is not counted
    for figure in ("cartpole_final.png", "cartpole_curves.png", "mountaincar_final.png"):
        assert (out.parent / "results" / figure).exists() and f"(results/{figure})" in text

    assert main([*argv, "--report-only"]) == 0 and calls == []
    rewritten = out.read_text()
    assert "rewritten from the finished cells (`--report-only`)" in rewritten
    assert "--report-only`" not in rewritten.split("- Commit")[0]  # the command shown is the one that runs the cells
    assert rewritten.split("## Scores")[1] == text.split("## Scores")[1]  # the same numbers


def test_edited_code_makes_new_cells(tmp_path, monkeypatch, capsys):
    """The resume key follows the framework's and the arm's plugin code: a finished cell of other code is not reused."""
    from core.study import plan

    spec = load_spec("results")
    cells = expand(spec, tasks=["cartpole"], arms=["human", "eureka"], seeds=[0])
    monkeypatch.setattr(core.config, "framework_hash", lambda: "a")
    before = {p.cell.name: p for p in plan(cells, "results", tmp_path)}
    monkeypatch.setattr(core.config, "framework_hash", lambda: "b")
    after = {p.cell.name: p for p in plan(cells, "results", tmp_path)}
    for name in before:
        assert before[name].config_key == after[name].config_key  # the same config ...
        assert before[name].key != after[name].key  # ... but other code: the cell runs again
    monkeypatch.setattr(core.config, "source_hash", lambda module: "edited")
    edited = {p.cell.name: p for p in plan(cells, "results", tmp_path)}
    assert edited["human-cartpole-s0"].key == after["human-cartpole-s0"].key  # no plugin: untouched
    assert edited["eureka-cartpole-s0"].key != after["eureka-cartpole-s0"].key


def _spec(tmp_path: Path, arms: dict) -> Path:
    """A one-task, one-seed study spec in ``tmp_path`` with these arms."""
    path = tmp_path / "check.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "check",
                "store": str(tmp_path / "store"),
                "out": str(tmp_path / "check.md"),
                "seeds": [0],
                "final_seeds": 1,
                "evaluations": 0,
                "overrides": [*TINY, f"cache_dir={tmp_path / 'cache'}"],
                "tasks": {"cartpole": {"env": "cartpole", "frames": 512}},
                "arms": arms,
            }
        )
    )
    return path


def test_a_search_arm_is_scored_on_fresh_seeds(tmp_path):
    """An arm marked as a search (here plain PPO, one candidate) retrains its best on seed + 1 and is scored there."""
    spec = _spec(tmp_path, {"human": {"overrides": ["env.reward=human"]}, "picked": {"search": True}})
    assert main([str(spec), "--reps", "200"]) == 0
    runs = {r.data.tags["study.arm"]: r for r in _runs(tmp_path / "store", "check")}
    picked, human = runs["picked"].data.metrics, runs["human"].data.metrics
    assert runs["picked"].data.tags["study.score"] == FRESH_SCORE
    assert picked["final/seeds"] == 2 and picked["final/frames"] == picked["frames"]  # one retraining, same budget
    assert picked["fitness"] == human["fitness"]  # the same training on seed 0 ...
    assert picked[FRESH_SCORE] != picked["fitness"]  # ... but scored on seed 1
    assert picked["final/fitness_mean"] == pytest.approx((picked["fitness"] + picked[FRESH_SCORE]) / 2)
    text = (tmp_path / "check.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| cartpole (return) |"))
    from core.report.render import number

    assert (
        row.split("|")[3].strip() == f"{number(picked[FRESH_SCORE])} (n=1, no CI)"
    )  # the fresh-seed score; one run, no CI
    assert "| picked | 1/1 |" in text and "| 1 (0) |" in text  # one candidate, none failed


def test_an_llm_arm_reports_its_llm_cost(tmp_path, monkeypatch):
    llm = fakes.install_fake_litellm(monkeypatch)
    eureka = ["plugins.eureka.iterations=1", "plugins.eureka.samples=2", *fakes.FAKE_LLM_OVERRIDES]
    spec = _spec(
        tmp_path,
        {
            "human": {"overrides": ["env.reward=human"]},
            "eureka": {"plugins": ["eureka"], "overrides": eureka, "search": True},
        },
    )
    assert main([str(spec), "--reps", "200"]) == 0
    assert llm.calls, "the eureka arm never asked the LLM"
    runs = {r.data.tags["study.arm"]: r for r in _runs(tmp_path / "store", "check")}
    eureka = runs["eureka"].data.metrics
    assert eureka["llm/calls"] >= 1 and eureka["candidates"] == 2 and FRESH_SCORE in eureka
    text = (tmp_path / "check.md").read_text()
    cost = next(line for line in text.splitlines() if line.startswith("| eureka | 1 |"))
    assert cost.split("|")[3].strip() == f"{eureka['llm/calls']:.0f}"


def test_a_rerun_from_the_replies_file_trains_the_same_programs_with_no_llm(tmp_path, monkeypatch):
    llm = fakes.install_fake_litellm(monkeypatch)
    eureka = ["plugins.eureka.iterations=1", "plugins.eureka.samples=2", *fakes.FAKE_LLM_OVERRIDES, "llm.cache=true"]
    spec = _spec(tmp_path, {"eureka": {"plugins": ["eureka"], "overrides": eureka, "search": True}})
    assert main([str(spec), "--reps", "200"]) == 0
    replies = tmp_path / "check" / "replies.jsonl.gz"
    asked = len(llm.calls)
    assert replies.exists() and asked
    shutil.rmtree(tmp_path / "cache")  # the replies file is all that is left of the LLM's answers
    again = ["--store", str(tmp_path / "again"), "--out", str(tmp_path / "again.md"), "--replies", str(replies)]
    assert main([str(spec), "--reps", "200", *again]) == 0
    assert len(llm.calls) == asked  # the LLM was not asked again
    first, second = (_runs(tmp_path / store, "check")[0] for store in ("store", "again"))
    client = (
        mlflow.MlflowClient(tracking_uri(tmp_path / "store")),
        mlflow.MlflowClient(tracking_uri(tmp_path / "again")),
    )

    def programs(c, run) -> list[str]:
        kids = c.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
        return sorted(
            Path(c.download_artifacts(k.info.run_id, "reward/compute_reward.py", str(tmp_path / "dl"))).read_text()
            for k in kids
            if "sample" in k.data.tags
        )

    assert programs(client[0], first) == programs(client[1], second) and programs(client[0], first)
    # one torch thread: the same programs train to the same scores
    assert second.data.metrics[FRESH_SCORE] == first.data.metrics[FRESH_SCORE]


def test_a_cell_the_replies_cannot_answer_fails_alone(tmp_path, monkeypatch, capsys):
    fakes.install_fake_litellm(monkeypatch)
    eureka = ["plugins.eureka.iterations=1", "plugins.eureka.samples=1", *fakes.FAKE_LLM_OVERRIDES, "llm.cache=true"]
    spec = _spec(tmp_path, {"eureka": {"plugins": ["eureka"], "overrides": eureka, "search": True}})
    assert main([str(spec), "--reps", "200", "--seeds", "0"]) == 0
    replies = tmp_path / "check" / "replies.jsonl.gz"
    shutil.rmtree(tmp_path / "cache")
    again = ["--store", str(tmp_path / "again"), "--out", str(tmp_path / "again.md"), "--replies", str(replies)]
    # seed 1 never ran, so its requests were never recorded: that cell fails, seed 0 still replays
    assert main([str(spec), "--reps", "200", "--seeds", "1,0", *again]) == 1
    out = capsys.readouterr().out
    assert "eureka-cartpole-s1: not replayable: llm.replay_only: no recorded reply" in out
    (replayed,) = (r for r in _runs(tmp_path / "again", "check") if r.info.status == "FINISHED")
    assert replayed.data.tags["seed"] == "0" and replayed.data.metrics["llm/requests"] == 0


@pytest.mark.slow
def test_an_eureka_arm_with_the_embedded_model(tmp_path):
    """The whole path with the shipped model: one round, one sample, a tiny budget."""
    eureka = ["plugins.eureka.iterations=1", "plugins.eureka.samples=1"]
    spec = _spec(tmp_path, {"eureka": {"plugins": ["eureka"], "overrides": eureka, "search": True}})
    assert main([str(spec), "--reps", "200"]) == 0
    (run,) = _runs(tmp_path / "store", "check")
    assert run.info.status == "FINISHED" and run.data.metrics["llm/calls"] >= 1
    assert "| eureka | 1 |" in (tmp_path / "check.md").read_text()


def test_the_projection_scales_training_time_but_not_a_searchs_llm_time():
    """At frames scale 0.1: a search cell of 10 s with 4 s of LLM calls counts 4 + 6 x 10; a
    one-training cell 2 x 10."""
    from types import SimpleNamespace

    from core.report.data import OK, StudyRun
    from core.report.results import Counted, _projection

    spec = load_spec("results")
    cells = expand(spec, tasks=["cartpole"], arms=["human", "eureka"], seeds=[0], frames_scale=0.1)
    planned = [SimpleNamespace(cell=c) for c in cells]
    runs = {
        ("cartpole", "eureka", 0): {"study/seconds": 10.0, "llm/latency_s": 4.0},
        ("cartpole", "human", 0): {"study/seconds": 2.0, "llm/latency_s": 1.5},
    }
    chosen = {k: StudyRun("id", "n", "cartpole", "x", 0, OK, metrics=m) for k, m in runs.items()}
    (line,) = _projection(spec, planned, Counted(list(chosen.values()), chosen, 0))  # type: ignore[arg-type]
    assert line.startswith("- Projected at the spec's frames: 1.4 min for the same 2 runs (1.4 min per seed)")  # 84 s
    full = expand(spec, tasks=["cartpole"], arms=["human"], seeds=[0])
    assert _projection(spec, [SimpleNamespace(cell=c) for c in full], Counted([], {}, 0)) == []  # type: ignore[misc]


# -- --code-of: cells that ran at one commit, reported by another ------------------------------


def _git(repo: Path, *args: str) -> str:
    import subprocess

    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _repo_of_this_tree(tmp_path: Path) -> tuple[Path, str]:
    """A git repository holding this checkout's keyed paths as they are now, and its commit."""
    import core.study

    repo = tmp_path / "repo"
    repo.mkdir()
    for name in core.study.KEYED_PATHS:
        source = core.study.REPO / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(source, repo / name)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "the tree")
    return repo, _git(repo, "rev-parse", "HEAD")


def test_code_of_keys_cells_as_that_commits_code_does(tmp_path):
    from core.study import keys_at, plan

    repo, first = _repo_of_this_tree(tmp_path)
    selection = {
        "spec": "results",
        "tasks": ["cartpole"],
        "arms": ["human", "eureka"],
        "seeds": [0],
        "frames_scale": None,
        "extra": [],
        "store": str(tmp_path / "store"),
    }
    here = {
        p.cell.name: (p.config_key, p.key)
        for p in plan(
            expand(load_spec("results"), ["cartpole"], ["human", "eureka"], [0]), "results", tmp_path / "store"
        )
    }
    assert keys_at(first, selection, repo=repo) == here  # the same code: the same keys

    with (repo / "core" / "loop.py").open("a") as f:
        f.write("\n# an edit of the training loop\n")
    _git(repo, "commit", "-q", "-am", "edit the loop")
    edited = keys_at("HEAD", selection, repo=repo)
    assert keys_at(first, selection, repo=repo) == here  # the first commit still keys as before
    for name, (ckey, key) in here.items():
        assert edited[name][0] == ckey and edited[name][1] != key  # the same config, other code


def test_code_of_names_what_is_wrong(tmp_path, capsys):
    from core.study import keys_at

    assert main(["results", "--tasks", "cartpole", "--arms", "human", "--code-of", "HEAD"]) == 2
    assert "--code-of only reads" in capsys.readouterr().out  # it never runs cells under another commit's keys
    assert main(["results", "--tasks", "cartpole", "--arms", "human", "--list", "--code-of", "f" * 40]) == 2
    assert "no such commit" in capsys.readouterr().out
    repo = tmp_path / "repo"
    (repo / "core").mkdir(parents=True)
    for name in ("plugins", "conf"):
        (repo / name).mkdir()
        (repo / name / "x.txt").write_text("x")
    (repo / "registry.yaml").write_text("{}\n")
    (repo / "core" / "__init__.py").write_text("")  # a commit with no study module
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "old")
    with pytest.raises(UserError, match="could not plan the cells"):
        keys_at(
            "HEAD",
            {
                "spec": "results",
                "tasks": None,
                "arms": None,
                "seeds": None,
                "frames_scale": None,
                "extra": [],
                "store": "s",
            },
            repo=repo,
        )


def test_a_report_of_cells_run_at_another_commit(tmp_path, monkeypatch):
    """--report-only --code-of counts the runs the named commit's code keyed, and names both commits."""
    import core.study

    spec = _spec(tmp_path, {"human": {"overrides": ["env.reward=human"]}})
    assert main([str(spec), "--reps", "200"]) == 0
    repo, ran_at = _repo_of_this_tree(tmp_path)
    monkeypatch.setattr(core.study, "REPO", repo)
    monkeypatch.setattr(core.config, "framework_hash", lambda: "later code")  # this checkout moved on
    assert main([str(spec), "--report-only", "--reps", "200"]) == 0
    assert "Cells planned: 1; with a run: 0" in (tmp_path / "check.md").read_text()  # its own keys find nothing
    assert main([str(spec), "--report-only", "--code-of", ran_at[:10], "--reps", "200"]) == 0
    text = (tmp_path / "check.md").read_text()
    assert "Cells planned: 1; with a run: 1" in text
    assert f"the cells are keyed by the code of `{ran_at}` (`--code-of`)" in text
    command = next(line for line in text.splitlines() if line.startswith("- Command:"))
    assert "--code-of" not in command and "--report-only" not in command  # the command that ran the cells
