"""Progress: ETAs from work done, a live line per LLM call, frame bars from worker processes."""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import sys
import time

import pytest
from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import Progress

from core.executor import PoolExecutor, TrainJob, _pool_job
from core.llm.client import CallProgress
from core.progress import (
    EtaColumn,
    LLMCallView,
    ProgressRelay,
    RemoteProgress,
    eta_seconds,
    make_progress,
    next_steps,
    routed_output,
)
from core.records import Candidate


class Recorder:
    """A ``Progress`` look-alike that keeps every call (for the driver's side of a relay)."""

    def __init__(self) -> None:
        self.tasks: dict[int, dict] = {}
        self.removed: list[dict] = []
        self.ids = iter(range(1000))

    def add_task(self, description, total=None, **fields):
        task = next(self.ids)
        self.tasks[task] = {"description": description, "total": total, "completed": 0, "updates": 0, **fields}
        return task

    def update(self, task, **fields):
        self.tasks[task].update(fields)
        self.tasks[task]["updates"] += 1

    def advance(self, task, advance=1):
        self.tasks[task]["completed"] += advance

    def remove_task(self, task):
        self.removed.append(self.tasks.pop(task))


def _quiet() -> Progress:
    return Progress(EtaColumn(), console=Console(file=open("/dev/null", "w")), auto_refresh=False)


def _clocked() -> tuple[Progress, list[float]]:
    """A quiet Progress on a clock the test moves (``clock[0] += seconds``)."""
    clock = [1000.0]
    return Progress(
        EtaColumn(), console=Console(file=open("/dev/null", "w")), auto_refresh=False, get_time=lambda: clock[0]
    ), clock


def test_the_eta_comes_from_the_work_done_before_a_bar_ends():
    assert eta_seconds(None, 0, 2) is None and eta_seconds(80.0, 0, 2) is None  # nothing done yet
    assert eta_seconds(80.0, 0.5, 2) == pytest.approx(240.0)  # half an iteration in 80 s, 1.5 to go
    assert eta_seconds(80.0, 2, 2) == 0.0
    progress, clock = _clocked()
    task = progress.add_task("iterations", total=2)
    column = EtaColumn()
    assert column.render(progress.tasks[0]).plain == "-:--:--"
    clock[0] += 30
    progress.advance(task, 0.5)  # one of two candidates of the first iteration: a rich column would still wait
    assert column.render(progress.tasks[0]).plain == "0:01:30"  # a quarter of the work in 30 s
    clock[0] += 60
    assert column.render(progress.tasks[0]).plain == "0:00:30"  # counts down between steps, never up


def test_an_eta_that_a_step_outlasts_counts_the_step_in_and_never_sticks_at_zero():
    progress, clock = _clocked()
    task = progress.add_task("iterations", total=2)
    column = EtaColumn()
    clock[0] += 30
    progress.advance(task, 0.5)
    assert column.render(progress.tasks[0]).plain == "0:01:30"  # at this pace
    clock[0] += 88.5
    assert column.render(progress.tasks[0]).plain == "0:00:02"  # near the countdown's end
    clock[0] += 31.5  # the next step is late: 150 s for a quarter, 3 quarters to go
    assert column.render(progress.tasks[0]).plain == "0:07:30"
    clock[0] += 60  # later still: the estimate follows, it does not sit at 0:00:00
    assert column.render(progress.tasks[0]).plain == "0:10:30"
    progress.advance(task, 1.0)  # a step: the countdown starts again from the pace so far
    assert column.render(progress.tasks[0]).plain == "0:01:10"


def test_make_progress_uses_the_eta_column():
    with make_progress(enabled=True) as progress:
        assert any(isinstance(c, EtaColumn) for c in progress.columns)
    with make_progress(enabled=False) as none:
        assert none is None


def test_an_llm_call_is_a_live_line_that_goes_when_it_ends():
    view = LLMCallView()
    call = CallProgress("eureka/propose", samples=4, max_tokens=1024)
    view(call)  # nothing attached: nothing shown, nothing raised
    progress = _quiet()
    view.attach(progress)
    view(call)
    (task,) = progress.tasks
    assert task.description == "LLM eureka/propose x4" and task.total == 4 * 1024
    assert task.fields["info"] == "reading the prompt"
    call.tokens, call.first_token = 1, time.perf_counter()
    view(call)  # one token a moment ago: no rate yet (it read as 18677.6 tok/s), no time left from it
    assert task.fields["info"] == "1 tok" and task.fields["eta_s"] is None
    call.tokens, call.first_token = 413, time.perf_counter() - 2.0
    view(call)
    assert task.completed == 413 and task.fields["info"].startswith("413 tok, 20") and "tok/s" in task.fields["info"]
    # time left: the tokens left at the decoding rate (412 after the first in 2 s: ~206 tok/s), not the prompt's pace
    assert task.fields["eta_s"] == pytest.approx((4096 - 413) / 206, rel=0.05)
    assert EtaColumn().render(task).plain == f"0:00:{int(task.fields['eta_s'] + 0.5):02d}"
    call.done = True
    view(call)
    assert progress.tasks == []


def test_remote_bars_are_drawn_by_the_relay_and_removed_at_the_end():
    q: queue.Queue = queue.Queue()
    remote = RemoteProgress(q, every_s=10.0)
    bar = remote.add_task("train it0-c0", total=100)
    remote.update(bar, completed=10, description="train it0-c0 500 fps")  # within every_s: not sent
    remote.update(bar, completed=100, description="train it0-c0 done")  # the last one always is
    driver = Recorder()
    relay = ProgressRelay(driver)
    relay.drain(q.get_nowait)
    (shown,) = driver.tasks.values()
    assert shown["completed"] == 100 and shown["description"] == "train it0-c0 done" and shown["updates"] == 1
    remote.close()
    relay.drain(q.get_nowait)
    assert driver.tasks == {} and driver.removed[0]["total"] == 100
    # a worker that died leaves its bar: the relay removes it when it stops
    remote.add_task("train it0-c1", total=5)
    relay.drain(q.get_nowait)
    relay.stop()
    assert driver.tasks == {}


def test_a_pool_workers_training_draws_its_frames_in_the_driver(make_config, monkeypatch):
    """The frame bar of a training in another process reaches the driver through the queue."""
    cfg = make_config(["trainer.frames=1024", "trainer.eval_episodes=1", "trainer.eval_every=0", "save_policy=false"])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    job = TrainJob(container, Candidate(id="c0", iteration=0), 0)
    q = mp.get_context("spawn").Queue()
    monkeypatch.setattr("core.executor._progress_queue", q)  # as _warm_worker sets it in a worker
    assert _pool_job(job, show_progress=True).ok
    driver = Recorder()
    relay = ProgressRelay(driver)
    relay.pump(q)
    deadline = time.monotonic() + 10
    while not driver.removed and time.monotonic() < deadline:
        time.sleep(0.05)
    relay.stop()
    (bar,) = driver.removed  # added, updated to its last frame, removed when the job ended
    assert bar["description"].startswith("train c0") and bar["completed"] == bar["total"] >= 1024


PRINTER = '''
    """Prints from a hook that runs in the training's worker."""

    from core import PluginConfig, hookimpl

    Config = PluginConfig


    class Plugin:
        def __init__(self, config) -> None:
            self.config = config

        @hookimpl
        def on_train_start(self, train):
            print("hello from", train.candidate.id)
'''


def test_a_workers_print_is_printed_by_the_driver_above_its_bars(make_config, local_plugins, monkeypatch, capfd):
    """print() in a hook of a pool worker's training goes through the progress queue, and the
    driver prints it through its Progress's console (it landed on the bar's line)."""
    local_plugins("printer", PRINTER)
    cfg = make_config(
        [
            "trainer.frames=256",
            "trainer.eval_episodes=1",
            "trainer.eval_every=0",
            "save_policy=false",
            "+plugins=[printer]",
        ]
    )
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    q: queue.Queue = queue.Queue()
    monkeypatch.setattr("core.executor._progress_queue", q)  # as _warm_worker sets it in a worker
    before = sys.stdout
    assert _pool_job(TrainJob(container, Candidate(id="c0", iteration=0), 0), show_progress=True).ok
    assert sys.stdout is before  # restored after the job
    assert "hello from" not in capfd.readouterr().out  # nothing written past the display
    console = Console(record=True, file=io.StringIO(), width=100)
    relay = ProgressRelay(Progress(console=console, auto_refresh=False))
    relay.drain(q.get_nowait)
    assert "hello from c0" in console.export_text()
    # a line without its newline still comes out, at the end
    with routed_output(RemoteProgress(q)):
        print("no newline", end="")
    relay.drain(q.get_nowait)
    assert "no newline" in console.export_text()


@pytest.mark.slow
def test_the_pool_relays_its_workers_bars(make_config):
    cfg = make_config(["trainer.frames=2048", "trainer.eval_episodes=1", "trainer.eval_every=0", "save_policy=false"])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    jobs = [TrainJob(container, Candidate(id=f"c{s}", iteration=0), s) for s in (0, 1)]
    driver = Recorder()
    shown: list[str] = []
    original = driver.add_task

    def add_task(description, total=None, **fields):
        shown.append(description)
        return original(description, total, **fields)

    driver.add_task = add_task  # type: ignore[method-assign]
    pool = PoolExecutor(2, progress=driver, read=lambda: None)
    try:
        results = pool.run(jobs)
    finally:
        pool.close()
    assert all(r.ok for r in results)
    assert sorted(shown) == ["train c0", "train c1"]  # both workers' bars were drawn here
    assert driver.tasks == {}  # and removed when their jobs ended


def test_after_a_run_the_report_and_the_ui_are_named():
    lines = next_steps("sqlite:///mlflow.db", "abl")
    assert lines[0] == "report:    python -m core.report --experiment abl --uri sqlite:///mlflow.db"
    assert lines[1].startswith("MLflow UI: python -m core.ui --uri sqlite:///mlflow.db --experiment abl")
    assert next_steps("http://tracking:5000", "abl")[1] == "MLflow UI: http://tracking:5000"


TWO_REWARDS = '''
    """Proposes two constant rewards every iteration."""

    from dataclasses import dataclass

    from core import PluginConfig, hookimpl
    from core.records import RewardProgram


    @dataclass
    class Config(PluginConfig):
        pass


    class Plugin:
        def __init__(self, config: Config) -> None:
            self.config = config

        @hookimpl
        def propose_rewards(self, run, iteration):
            return [RewardProgram(source="def compute_reward(state, action, next_state):\\n"
                                         f"    return {k + 10 * iteration}.0\\n")
                    for k in (1, 2)]
'''


def test_the_iteration_bar_moves_as_each_candidate_finishes(local_plugins, tiny_run, monkeypatch):
    from contextlib import contextmanager

    from omegaconf import open_dict

    import core.loop

    local_plugins("two", TWO_REWARDS)
    cfg = tiny_run("save_policy=false", "executor=inprocess")
    with open_dict(cfg):
        cfg.plugins = {"two": {"iterations": 2}}
    driver = Recorder()
    moves: list[float] = []
    advance, update = driver.advance, driver.update

    def tracked_advance(task, amount=1):
        advance(task, amount)
        if driver.tasks[task]["description"] == "iterations":
            moves.append(driver.tasks[task]["completed"])

    def tracked_update(task, **fields):
        update(task, **fields)
        if driver.tasks[task]["description"] == "iterations":
            moves.append(driver.tasks[task]["completed"])

    driver.advance, driver.update = tracked_advance, tracked_update  # type: ignore[method-assign]

    @contextmanager
    def recorded(enabled=True):
        yield driver

    monkeypatch.setattr(core.loop, "make_progress", recorded)
    core.loop.run_experiment(cfg)
    # half an iteration per finished candidate (an ETA from the first), whole at each iteration's end
    assert moves == [0.5, 1.0, 1, 1.5, 2.0, 2]
    moves.clear()
    core.loop.run_experiment(cfg)  # again: every training is reused from the results store
    assert moves == [1.0, 1, 2.0, 2]


ARRIVING = '''
    """Proposes rewards in groups that arrive one after the other (as a streaming LLM call does),
    and, with ``bad``, a program that fails its check (rejected before training) beside a good one."""

    from dataclasses import dataclass

    from core import PluginConfig, hookimpl
    from core.records import RewardProgram

    GOOD = "def compute_reward(state, action, next_state):\\n    return {k}.0\\n"


    @dataclass
    class Config(PluginConfig):
        bad: bool = False


    class Plugin:
        def __init__(self, config: Config) -> None:
            self.config = config

        @hookimpl
        def propose_rewards(self, run, iteration):
            if self.config.bad:
                return [RewardProgram(source=GOOD.format(k=1)),
                        RewardProgram(source="def compute_reward(state):\\n    return (\\n")]
            return ([RewardProgram(source=GOOD.format(k=k))] for k in (1, 2))
'''


class BarLog(Recorder):
    """A Recorder that moves bars as rich does (``advance=`` and ``total=`` in ``update``) and keeps
    the candidates bar's ``completed/total`` after every call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, float | None]] = []

    def _log(self, task) -> None:
        if self.tasks[task]["description"] == "candidates":
            self.seen.append((self.tasks[task]["completed"], self.tasks[task]["total"]))

    def add_task(self, description, total=None, **fields):
        task = super().add_task(description, total, **fields)
        self.tasks[task]["completed"] = fields.get("completed", 0)
        self._log(task)
        return task

    def update(self, task, total=None, advance=None, **fields):
        if total is not None:
            self.tasks[task]["total"] = total
        if advance:
            self.tasks[task]["completed"] += advance
        super().update(task, **fields)
        self._log(task)

    def advance(self, task, advance=1):
        super().advance(task, advance)
        self._log(task)


@pytest.mark.parametrize("bad", [False, True], ids=["arriving", "one-rejected-before-training"])
def test_the_candidates_bar_counts_every_candidate_and_never_ends_early(local_plugins, tiny_run, monkeypatch, bad):
    """Two candidates: the bar never reads ``1/1`` (it did while the second was still being
    generated, and when the other had been rejected before training)."""
    from contextlib import contextmanager

    from omegaconf import open_dict

    import core.loop

    local_plugins("arriving", ARRIVING)
    cfg = tiny_run("save_policy=false", "executor=inprocess", "vetting.repair=0", "resume=false")
    with open_dict(cfg):
        cfg.plugins = {"arriving": {"bad": bad}}
    driver = BarLog()

    @contextmanager
    def recorded(enabled=True):
        yield driver

    monkeypatch.setattr(core.loop, "make_progress", recorded)
    core.loop.run_experiment(cfg)
    assert driver.seen and driver.seen[-1] == (2, 2)
    assert all(total in (None, 2) for _, total in driver.seen), driver.seen  # "1/?" while more may come, then 2
