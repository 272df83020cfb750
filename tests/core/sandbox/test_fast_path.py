"""The training step's short path through the worker: the same answers, checks and deadlines as the long way.

A call repeated with the same layout (every training step) is short on both sides: the
worker names the fields and writes the value with a plan made once (its ``_CallLane``),
and, while the machine has a CPU to spare, the worker waits for the next step on a
spinning CPU instead of sleeping (the host's ``_Spin``). These tests show that nothing
a program sees or the host accepts changes on that path: values equal a direct call's,
inputs a program keeps stay as they were, a value that leaves the short path is shaped
and checked the long way, and deadlines and limits hold while the worker spins.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

from core.envs.classic import CartPole
from core.records import RewardProgram, StateProgram
from core.sandbox import (
    Limits,
    ProgramWorker,
    SandboxError,
    candidate_scope,
    host as sandbox_host,
    prepare_reward,
    prepare_state,
)
from core.sandbox.programs import REWARD_ARGS
from core.sandbox.worker import SPIN_ENV

LIMITS = Limits(cpu_s=5, wall_s=15, memory_mb=2048, call_timeout_s=0.5, max_time_share=1.0, time_share_grace_s=60.0)
TASK = CartPole()
TWO_CPUS = len(os.sched_getaffinity(0)) >= 2

WEIGHTED = """
import torch

def compute_reward(state, action, next_state):
    s, n = state, next_state
    reward = (
        n["cart_position"] + 10.0 * n["cart_velocity"] + 100.0 * n["pole_angle"] + 1000.0 * s["pole_angular_velocity"]
    )
    return reward, {"moved": n["cart_position"] - s["cart_position"], "pushed": action.float()}
"""
KEEPS_ITS_FIRST_INPUT = """
KEPT = {}

def compute_reward(state, action, next_state):
    first = KEPT.setdefault(len(next_state["pole_angle"]), next_state["pole_angle"])
    return first * 1.0
"""
CHANGES_SHAPE = """
import torch

CALLS = [0]

def compute_reward(state, action, next_state):
    CALLS[0] += 1
    reward = next_state["pole_angle"] * 2.0
    if CALLS[0] % 3 == 0:
        return reward.double(), {"late": reward}
    return reward, {"early": reward + 1.0}
"""
NAN_ON_FIFTH = """
import torch

CALLS = [0]

def compute_reward(state, action, next_state):
    CALLS[0] += 1
    reward = next_state["pole_angle"] * 1.0
    if CALLS[0] == 5:
        reward[1] = float("nan")
    return reward
"""
SLEEPS_ON_TENTH = """
CALLS = [0]

def compute_reward(state, action, next_state):
    CALLS[0] += 1
    while CALLS[0] == 10:
        pass
    return next_state["pole_angle"] * 1.0
"""
VECTOR_FIELDS = """
import torch

def compute_reward(state, action, next_state):
    return next_state["position"].sum(-1) * 10.0 + next_state["speed"]
"""
FEATURES = "def revise_state(state):\n    return state['pole_angle'].unsqueeze(-1) * 3.0\n"


def _weighted(
    obs: torch.Tensor, action: torch.Tensor, nxt: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    reward = nxt[:, 0] + 10.0 * nxt[:, 1] + 100.0 * nxt[:, 2] + 1000.0 * obs[:, 3]
    return reward, {"moved": nxt[:, 0] - obs[:, 0], "pushed": action.float()}


def _steps(n: int, batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield (
            torch.randn(batch, 4, generator=g),
            torch.randint(0, 2, (batch,), generator=g),
            torch.randn(batch, 4, generator=g),
        )


@pytest.fixture(params=["0", "1"], ids=["sleeping", "spinning"])
def spin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Workers that sleep between steps, and workers that spin for the next step (where there are two CPUs)."""
    monkeypatch.setenv(SPIN_ENV, request.param)
    return request.param == "1" and TWO_CPUS


def test_training_steps_give_what_a_direct_call_gives(spin: bool) -> None:
    with candidate_scope():
        fn = prepare_reward(RewardProgram(WEIGHTED), TASK, limits=LIMITS)
        for obs, action, nxt in _steps(300):
            reward, comps = fn.from_obs(obs, action, nxt)
            want, want_comps = _weighted(obs, action, nxt)
            torch.testing.assert_close(reward, want)
            assert comps.keys() == want_comps.keys()
            for name, value in want_comps.items():
                torch.testing.assert_close(comps[name], value)
        metrics = fn.worker.metrics()
    assert metrics["sandbox/program_calls"] == 300
    # spinning: nearly every step's answer is polled for (not the first, nor one after a slow step)
    assert (metrics["sandbox/spun_share"] > 0.5) if spin else (metrics["sandbox/spun_share"] == 0.0)


def test_a_kept_input_keeps_its_values(spin: bool) -> None:
    """The program gets memory of its own every call: a tensor it keeps is not overwritten by the next step."""
    with candidate_scope():
        fn = prepare_reward(RewardProgram(KEEPS_ITS_FIRST_INPUT), TASK, limits=LIMITS)
        first = None
        for obs, action, nxt in _steps(20):
            reward, _ = fn.from_obs(obs, action, nxt)
            first = reward if first is None else first
            torch.testing.assert_close(reward, first)


def test_a_value_that_leaves_the_short_path_goes_the_long_way(spin: bool) -> None:
    with candidate_scope():
        fn = prepare_reward(RewardProgram(CHANGES_SHAPE), TASK, limits=LIMITS)
        for i, (obs, action, nxt) in enumerate(_steps(12)):
            reward, comps = fn.from_obs(obs, action, nxt)
            torch.testing.assert_close(reward, nxt[:, 2] * 2.0)
            assert reward.dtype == torch.float32 and set(comps) in ({"late"}, {"early"})


def test_a_nan_on_the_short_path_is_refused_by_the_host(spin: bool) -> None:
    with candidate_scope():
        fn = prepare_reward(RewardProgram(NAN_ON_FIFTH), TASK, limits=LIMITS)
        steps = _steps(6)
        for _ in range(3):  # the probe was the first call
            fn.from_obs(*next(steps))
        with pytest.raises(SandboxError) as err:
            fn.from_obs(*next(steps))
        assert err.value.report.kind == "invalid_value" and "NaN" in err.value.report.message
        reward, _ = fn.from_obs(*next(steps))  # the worker lives on: a bad value is the program's failure, not a crash
        assert torch.isfinite(reward).all()


def test_the_deadline_holds_while_the_worker_spins(spin: bool) -> None:
    with candidate_scope():
        fn = prepare_reward(RewardProgram(SLEEPS_ON_TENTH), TASK, limits=LIMITS)
        steps = _steps(12)
        for _ in range(8):
            fn.from_obs(*next(steps))
        start = time.monotonic()
        with pytest.raises(SandboxError) as err:
            fn.from_obs(*next(steps))
        assert err.value.report.kind == "timeout" and time.monotonic() - start < 2.0
        assert not fn.worker.alive


def test_fields_of_several_columns_are_named_on_the_short_path(spin: bool) -> None:
    fields = [("position", 0, 2, (2,)), ("speed", 2, 3, ())]
    with candidate_scope(), ProgramWorker(LIMITS) as worker:
        handle = worker.load(RewardProgram(VECTOR_FIELDS), role="reward", arg_names=REWARD_ARGS, fields=fields)
        for obs, action, nxt in _steps(30):
            obs, nxt = obs[:, :3], nxt[:, :3]
            reward, _ = worker.call(handle, (obs, action, nxt), role="reward", batch=8, split=(0, 2))
            torch.testing.assert_close(reward, nxt[:, :2].sum(-1) * 10.0 + nxt[:, 2])


def test_state_programs_take_the_short_path_too(spin: bool) -> None:
    with candidate_scope():
        fn = prepare_state(StateProgram(FEATURES), TASK, limits=LIMITS)
        for obs, _, _ in _steps(50):
            torch.testing.assert_close(fn.from_obs(obs), obs[:, 2:3] * 3.0)


def test_spinning_is_added_to_the_workers_cpu_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's CPU limit (the backstop for a program's time) grows by the polling the host asked for."""
    monkeypatch.setenv(SPIN_ENV, "1")
    set_limits: list[tuple[int, int]] = []

    def prlimit(pid: int, what: int, limits: tuple[int, int] | None = None) -> tuple[int, int]:
        if limits is not None:
            set_limits.append(limits)
        return (1, 2)

    with candidate_scope():
        fn = prepare_reward(RewardProgram(WEIGHTED), TASK, limits=replace(LIMITS, max_time_share=0.0))
        for obs, action, nxt in _steps(100):
            fn.from_obs(obs, action, nxt)
        spin = fn.worker._spin
        assert spin.granted_s == pytest.approx(spin.WORKER_S * spin.spun)
        assert (spin.spun > 90) == TWO_CPUS
        monkeypatch.setattr(sandbox_host.resource, "prlimit", prlimit)
        fn.worker._raise_cpu_limit(time.monotonic())
    base = fn.worker._cpu_base + LIMITS.cpu_s + LIMITS.time_share_grace_s
    assert set_limits[-1][0] == int(base + spin.granted_s) + 1


# -- when to spin ------------------------------------------------------------------------------------


class _Machine:
    """What ``/proc`` says: the runnable tasks, and whether the worker is one of them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runnable, self.worker_running = 1, 0
        monkeypatch.setattr(sandbox_host, "_runnable", lambda: self.runnable)
        monkeypatch.setattr(sandbox_host, "_running", lambda pid: self.worker_running)
        monkeypatch.delenv(SPIN_ENV, raising=False)


def _spin(cpus: int = 2) -> sandbox_host._Spin:
    spin = sandbox_host._Spin()
    spin.cpus = frozenset(range(cpus))
    return spin


def _steps_at(spin: sandbox_host._Spin, now: float, seconds: float, gap: float = 0.0005, room: float = 10.0) -> float:
    """Calls of 50 µs, ``gap`` apart, for ``seconds``, the machine sampled as often as the host does; the time after."""
    end = now + seconds
    while now < end:
        spin.before(now)
        now += 50e-6
        if spin.after(now, 50e-6):
            spin.sample(now, 1, room)
        now += gap
    return now


def test_spinning_starts_while_a_cpu_is_spare_and_stops_when_others_want_one(monkeypatch: pytest.MonkeyPatch) -> None:
    machine, spin = _Machine(monkeypatch), _spin()
    now = _steps_at(spin, 1.0, 0.03)
    assert not spin.on  # not on one sample
    now = _steps_at(spin, now, 0.3)
    assert spin.on and spin.before(now) > 0 and spin.host_s > 0
    machine.runnable, machine.worker_running = 2, 1  # the worker spinning: still no one else
    now = _steps_at(spin, now, 1.0)
    assert spin.on
    machine.runnable = 3  # another task wants a CPU
    now = _steps_at(spin, now, 0.2)
    assert not spin.on and spin.before(now) == 0 and spin.host_s == 0


def test_spinning_stops_before_the_workers_cpu_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    _Machine(monkeypatch)
    spin = _spin()
    now = _steps_at(spin, 1.0, 0.5)
    assert spin.on
    now = _steps_at(spin, now, 0.1, room=spin.CPU_RESERVE_S / 2)  # the rest of the CPU time is the program's
    assert not spin.on and spin.before(now) == 0


def test_a_fixed_cpu_limit_bounds_the_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the host may not raise the worker's CPU limit, spinning takes only its allowance of it."""
    _Machine(monkeypatch)
    spin = _spin()
    spin.allowance_s = 0.05
    now = _steps_at(spin, 1.0, 0.5)  # 0.5 ms apart: the worker spins about 0.5 ms per step
    assert spin.on and spin.before(now) == 0
    assert 0.05 <= spin.spent_s < 0.06 and 90 <= spin.spun <= 110  # about 100 steps of 0.5 ms


def test_the_host_knows_whether_it_may_raise_the_cpu_limit() -> None:
    import resource

    with candidate_scope(), ProgramWorker(LIMITS) as worker:
        try:
            resource.prlimit(worker._proc.server, resource.RLIMIT_CPU)
            may = True
        except OSError:
            may = False
        assert (worker._spin.allowance_s is None) == may
        if not may:
            assert worker._spin.allowance_s == pytest.approx(worker._spin.FIXED_LIMIT_SHARE * LIMITS.cpu_s)


def test_more_cpus_leave_room_for_other_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = _Machine(monkeypatch)
    machine.runnable = 3  # this thread and two others
    two, four = _spin(2), _spin(4)
    _steps_at(two, 1.0, 1.0)
    _steps_at(four, 1.0, 1.0)
    assert not two.on and four.on


def test_one_cpu_never_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    _Machine(monkeypatch)
    spin = _spin(1)
    now = _steps_at(spin, 1.0, 1.0)
    assert not spin.on and spin.before(now) == 0


def test_steps_far_apart_are_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    _Machine(monkeypatch)
    spin = _spin()
    now = _steps_at(spin, 1.0, 1.0)
    assert spin.on and spin.before(now) > 0
    now = _steps_at(spin, now, 1.0, gap=0.05)  # a batch every 50 ms: a spin would not catch it
    assert spin.on and spin.before(now) == 0 and spin.host_s == 0


def test_the_environment_switch_overrides_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = _Machine(monkeypatch)
    monkeypatch.setenv(SPIN_ENV, "0")
    never = _spin()
    _steps_at(never, 1.0, 1.0)
    assert not never.on
    machine.runnable = 9
    monkeypatch.setenv(SPIN_ENV, "1")
    always = _spin()
    _steps_at(always, 1.0, 1.0)
    assert always.on


# -- the CPU budget where the host may not raise the kernel's limit -----------------------------------

BUSY_MS = """
import torch

def compute_reward(state, action, next_state):
    x = torch.ones(64, 64)
    for _ in range(400):  # some milliseconds of CPU per call
        x = torch.tanh(x @ x * 0.01)
    return next_state["pole_angle"] * 1.0 + x[0, 0] * 0.0
"""


def test_a_worker_within_its_time_share_outlives_its_start_up_cpu_budget() -> None:
    """Its CPU use passes ``cpu_s`` + 2 s (where the kernel's limit stood before the host could raise it)."""
    limits = replace(LIMITS, cpu_s=1, max_time_share=0.9, time_share_grace_s=0.5, call_timeout_s=2.0)
    with candidate_scope():
        fn = prepare_reward(RewardProgram(BUSY_MS), TASK, limits=limits)
        steps, deadline = list(_steps(8)), time.monotonic() + 60
        used = 0.0
        while used < fn.worker._cpu_base + limits.cpu_s + 3 and time.monotonic() < deadline:
            for obs, action, nxt in steps:
                fn.from_obs(obs, action, nxt)  # raises if the worker is stopped
                time.sleep(0.005)
            used = fn.worker.cpu_seconds() or 0.0
        assert used >= fn.worker._cpu_base + limits.cpu_s + 3 and fn.worker.dead is None


def test_the_host_stops_a_worker_over_its_cpu_budget_whatever_the_kernels_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = replace(LIMITS, cpu_s=1, max_time_share=0.9, time_share_grace_s=0.5, call_timeout_s=2.0)
    with candidate_scope():
        fn = prepare_reward(RewardProgram(WEIGHTED), TASK, limits=limits)
        obs, action, nxt = next(_steps(1))
        fn.from_obs(obs, action, nxt)
        worker = fn.worker
        monkeypatch.setattr(worker, "cpu_seconds", lambda: worker._cpu_limit + 60.0)  # as if it had burnt a minute
        with pytest.raises(SandboxError) as err:
            worker._raise_cpu_limit(time.monotonic())
        assert err.value.report.kind == "too_slow" and "CPU time" in err.value.report.message
        assert worker.dead is not None
