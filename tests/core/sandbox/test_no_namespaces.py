"""The sandbox without namespaces: the fallback path of a kernel or container that allows none.

``LLM4RL_SANDBOX_NO_NAMESPACES=1`` makes every worker skip ``unshare``, as where the
kernel refuses it. There:

- the run's log says which layers are missing and what that leaves open;
- benign programs still load, run and train;
- hostile code is never run without the static check: the corpus's skip decision comes
  from what a real worker got (checked here against ``/proc``), and the checked runs of
  the corpus still end in their categories with the host unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import test_hostile_corpus as corpus
from core.records import Candidate, RewardProgram, StateProgram
from core.sandbox import UID_BASE, ProgramWorker, candidate_scope, prepare_reward, prepare_state
from core.sandbox.host import Zygote, _Warnings
from core.sandbox.worker import NO_NAMESPACES_ENV
from hostile_corpus import CORPUS
from test_hostile_corpus import host, record_workers  # noqa: F401 - the corpus's fixtures, for its checked runs

LIMITS, TASK, BENIGN = corpus.LIMITS, corpus.TASK, corpus.BENIGN
STATE = (
    "import torch\n\ndef revise_state(state):\n"
    "    return torch.stack([state['pole_angle'] * 2.0, state['cart_velocity']], dim=-1)\n"
)


@pytest.fixture
def no_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_NAMESPACES_ENV, "1")
    monkeypatch.setattr(_Warnings, "_said", set())  # each missing layer is said once per process


def _namespaces(pid: int | str) -> dict[str, str]:
    return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("net", "pid", "mnt")}


def _truly_isolated(worker: ProgramWorker) -> bool:
    """What the kernel says of a worker's server: namespaces other than ours, and a uid of its own."""
    pid = worker._proc.server
    with open(f"/proc/{pid}/status") as f:
        uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
    theirs, ours = _namespaces(pid), _namespaces("self")
    return all(theirs[ns] != ours[ns] for ns in ours) and uid >= UID_BASE


def test_without_namespaces_the_log_says_what_is_missing(no_namespaces: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="core.sandbox"), candidate_scope():
        worker = ProgramWorker(LIMITS)
        iso, theirs = worker.isolation, _namespaces(worker._proc.server)
    assert not (iso["network"] or iso["pid"] or iso["mount"] or iso["ipc"]), iso
    assert theirs == _namespaces("self")  # the kernel agrees: the worker shares the host's namespaces
    text = caplog.text
    assert "no network, pid, mount namespace for LLM-written programs" in text
    assert NO_NAMESPACES_ENV in text  # why
    assert (
        "can reach the network" in text and "killed by uid or process group" in text and "host's /tmp and /proc" in text
    )
    assert worker.metrics()["sandbox/namespaces"] == 0.0


def test_not_being_root_is_said_in_the_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Warnings, "_said", set())
    with candidate_scope():
        worker = ProgramWorker(LIMITS)
        worker._proc.isolation = {"network": True, "pid": True, "mount": True, "user": False, "root_dropped": False}
        with caplog.at_level("WARNING", logger="core.sandbox"):
            worker._say_what_is_missing()
    assert "not started as root" in caplog.text and "run as your own user" in caplog.text


def test_without_namespaces_benign_programs_load_run_and_leave_nothing(no_namespaces: None) -> None:
    obs, action, nxt = corpus.batch(7)
    with candidate_scope():
        worker = ProgramWorker(LIMITS)
        folder = worker.isolation["folder"]
        assert folder.startswith("/tmp/llm4rl-sandbox-") and os.path.isdir(
            folder
        )  # no mount namespace: the host's /tmp
        reward_fn = prepare_reward(RewardProgram(BENIGN), TASK, limits=LIMITS, worker=worker)
        state_fn = prepare_state(StateProgram(STATE), TASK, limits=LIMITS, worker=worker)
        for _ in range(3):  # repeated calls take the short path
            reward, _ = reward_fn.from_obs(obs, action, nxt)
            torch.testing.assert_close(reward, 1.0 - nxt[:, 2].abs())
            torch.testing.assert_close(state_fn.from_obs(nxt), torch.stack([nxt[:, 2] * 2.0, nxt[:, 1]], dim=-1))
    assert not os.path.exists(folder)  # removed with the worker
    assert not worker.alive


def test_without_namespaces_a_training_with_a_reward_program_runs(no_namespaces: None) -> None:
    from core.train.ppo import PPOConfig, train

    cfg = PPOConfig(
        frames=512, num_envs=4, rollout_steps=32, epochs=1, minibatch=64, hidden=[16], eval_every=0, eval_episodes=1
    )
    result = train(TASK, Candidate("benign", 0, reward=RewardProgram(BENIGN)), cfg, seed=0)
    assert result.ok and result.frames == 512 and result.fitness is not None, result.error
    assert result.metrics["sandbox/namespaces"] == 0.0 and result.metrics["sandbox/program_calls"] > 0


def test_the_hostile_corpus_skip_decision_is_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``workers_isolated`` (the corpus's skip decision) matches what /proc shows of a real worker, switch on or off."""
    monkeypatch.delenv(NO_NAMESPACES_ENV, raising=False)
    with candidate_scope():
        truth = _truly_isolated(ProgramWorker(LIMITS))
    assert corpus.workers_isolated() == truth
    monkeypatch.setenv(NO_NAMESPACES_ENV, "1")
    with candidate_scope():
        assert not _truly_isolated(ProgramWorker(LIMITS))
    assert corpus.workers_isolated() is False


def test_without_namespaces_unchecked_hostile_code_is_never_started(
    no_namespaces: None,
    host: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawned = []
    monkeypatch.setattr(Zygote, "spawn", lambda self, *a, **k: spawned.append(a) or pytest.fail("a worker started"))
    isolated = False  # what workers_isolated() says here (test above)
    hostile = next(h for h in CORPUS if h.name == "typing_hints_run_code")
    with pytest.raises(pytest.skip.Exception):
        corpus.test_hostile_program(hostile, False, host, isolated)
    with pytest.raises(pytest.skip.Exception):
        corpus.test_hostile_candidate_fails_its_training_and_the_next_one_trains(hostile.name, host, isolated)
    assert spawned == []


CHECKED = [
    "typing_hints_run_code",
    "fork_bomb",
    "keep_result_and_spoil_it",
    "no_grad_generator_for_the_next_candidate",
    "infinite_loop_after_the_probe",
    "allocate_six_gib",
    "nan_in_one_row_after_the_probe",
    "state_program_infinite_loop",
]


@pytest.mark.parametrize("name", CHECKED)
def test_hostile_program_checked_without_namespaces(
    name: str,
    no_namespaces: None,
    host: Any,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The corpus's checked run, as on a machine without namespaces: its category, the host
    unchanged, the loop goes on."""
    hostile = next(h for h in CORPUS if h.name == name)
    with caplog.at_level("WARNING", logger="core.sandbox"):
        corpus.test_hostile_program(hostile, True, host, False)
    assert f"switched off by {NO_NAMESPACES_ENV}" in caplog.text  # its workers had no namespaces
