"""Memory bounded per worker: a memory cgroup per worker where the machine allows it, else the host's own measure.

The programs here fork and allocate; they run only where the worker's limits and
namespaces are in place (``workers_isolated``), inside a group whose limit they test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from core.envs.classic import CartPole
from core.records import RewardProgram
from core.sandbox import Limits, ProgramWorker, SandboxError, candidate_scope, memory, prepare_reward
from test_hostile_corpus import workers_isolated

TASK = CartPole()
LIMITS = Limits(
    cpu_s=3,
    wall_s=15,
    memory_mb=512,
    max_procs=64,
    call_timeout_s=5.0,
    max_open_files=64,
    tmp_mb=16,
    max_time_share=0.9,
    time_share_grace_s=20.0,
    static_check=False,
)
#: four processes of 200 MB each: every one under the per-process limit, together over the worker's 512 MB
FORKS = """
import os
import time
CALLS = [0]

def compute_reward(state, action, next_state):
    CALLS[0] += 1
    if CALLS[0] == 2:
        for _ in range(4):
            if os.fork() == 0:
                block = b'x' * (200 * 2**20)
                time.sleep(30)
                os._exit(0)
    return next_state['pole_angle'] * 0.0
"""


@pytest.fixture(scope="module", autouse=True)
def isolated() -> None:
    if not workers_isolated():
        pytest.skip("the worker's limits, user and namespaces are not all in place here: hostile code stays unrun")


def run(limits: Limits, calls: int = 60) -> tuple[str, str, ProgramWorker]:
    with candidate_scope():
        worker = ProgramWorker(limits)
        fn = prepare_reward(RewardProgram(FORKS), TASK, limits=limits, worker=worker)
        obs = torch.zeros(8, TASK.obs_dim)
        try:
            for _ in range(calls):
                fn.from_obs(obs, torch.zeros(8, dtype=torch.long), obs)
                time.sleep(0.05)
        except SandboxError as e:
            return e.report.kind, e.report.message, worker
    return "ok", "", worker


def test_a_worker_runs_in_a_memory_group_of_its_own_which_goes_with_it() -> None:
    if not memory._own_groups():
        pytest.skip("no cgroup file system here: the host-side measure is tested below")
    with candidate_scope():
        worker = ProgramWorker(LIMITS)
        group = worker._proc.memory_group
        assert group is not None and worker.isolation["memory_group"], worker.isolation
        limit = "memory.max" if group.version == 2 else "memory.limit_in_bytes"
        assert int((group.path / limit).read_text()) == LIMITS.memory_mb * 2**20
        assert str(worker._proc.server) in (group.path / "cgroup.procs").read_text().split()
        other = ProgramWorker(LIMITS)
        assert other._proc.memory_group.path != group.path  # one per worker
        worker.close()
        other.close()
    assert not group.path.exists()


def test_processes_that_together_exceed_the_limit_end_the_worker_as_memory() -> None:
    if not memory._own_groups():
        pytest.skip("no cgroup file system here: the host-side measure is tested below")
    kind, message, worker = run(LIMITS)
    assert kind == "memory", message
    assert "512 MB" in message and "all its processes" in message
    group = worker._proc.memory_group
    assert group is not None and not group.path.exists()


def test_without_a_group_the_host_measures_the_workers_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.NO_GROUP_ENV, "1")
    kind, message, worker = run(LIMITS)
    assert worker._proc.memory_group is None and not worker.isolation["memory_group"]
    assert kind == "memory", message
    assert " MB) than its limit of 512 MB" in message  # the host's own figure


def test_the_host_measure_counts_what_a_process_wrote_not_what_it_shares() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; b = b'x' * (64 * 2**20); print(1, flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline().strip() == b"1"
        written = memory.resident_bytes(child.pid, ())
        assert 64 * 2**20 <= written < 200 * 2**20, written
        assert memory.resident_bytes(os.getpid(), ()) > 0
    finally:
        child.kill()
        child.wait()


def test_groups_of_host_processes_that_are_gone_are_swept(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"llm4rl-{gone.pid}-0"
    live = tmp_path / f"llm4rl-{os.getpid()}-99"
    stale.mkdir()
    live.mkdir()
    memory._sweep(tmp_path)
    assert not stale.exists() and live.exists()


def test_a_group_is_not_made_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.NO_GROUP_ENV, "1")
    assert memory.create(2**30) is None
    with candidate_scope():
        worker = ProgramWorker(replace(LIMITS))
        assert worker._proc.memory_group is None and not worker.isolation["memory_group"]
