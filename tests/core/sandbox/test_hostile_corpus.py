"""The hostile corpus, run as candidates: each gets its category, the host stays as it was, the loop goes on.

Every program runs twice: with the static check (the first filter) and without it (the
worker's isolation alone). Each run:

1. starts the candidate's worker and checks, from the host, that its limits are in place
   (process, memory, CPU, open files; its own uid; network/PID/mount namespaces) BEFORE
   any hostile code is loaded; the unchecked runs are skipped where that cannot be shown;
2. loads and probes the program, then calls it like a training loop would, on batches
   whose copies in the host are compared before and after every call;
3. asserts the category (``ok`` when the attack did nothing outside its worker);
4. runs the follow-up candidate (persistence) and a benign candidate in fresh workers,
   which must give their expected categories and correct values: the loop goes on;
5. asserts the host is unchanged: no file the program named, no process of its worker,
   no connection to the host's listeners, the same environment and global state of
   torch, numpy, builtins and the random generators, no program source in the host's
   line cache, no secret in any report.

``python -m pytest -k hostile`` runs them all.
"""

from __future__ import annotations

import builtins
import glob
import hashlib
import linecache
import os
import random
import shutil
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hostile_corpus
from core.envs.classic import CartPole
from core.records import MacroAction, Program, RewardProgram, StateProgram
from core.sandbox import UID_BASE, Limits, ProgramWorker, SandboxError, candidate_scope, prepare_reward, prepare_state
from core.sandbox.host import RECORDS_ENV, Zygote, hide_from_programs
from core.train.macros import MacroSet
from hostile_corpus import CORPUS, Hostile

REPO = str(Path(__file__).resolve().parents[3])
#: a file only its owner can read, somewhere a worker can see (one per test process: xdist runs several)
SECRET_DIR = (
    f"/var/lib/llm4rl-hostile-test-{os.getpid()}"
    if os.access("/var/lib", os.W_OK)
    else f"/tmp/llm4rl-hostile-test-{os.getpid()}"
)
SECRET = f"{SECRET_DIR}/secret"
SHARED = f"{SECRET_DIR}/shared"  # a world-writable folder outside the worker's private ones
RECORDS = f"{SECRET_DIR}/records/mlflow.db"  # a run's records, readable by all
RECORD_TEXT = "llm4rl-run-record"
FAKE_KEY = "sk-hostile-test-key-do-not-leak"
#: per_row_fallback off: a program written for one state is a different matter (tests/core/test_sandbox.py)
LIMITS = Limits(
    cpu_s=3,
    wall_s=15,
    memory_mb=2048,
    max_procs=8,
    call_timeout_s=0.5,
    max_open_files=64,
    tmp_mb=16,
    max_time_share=0.5,
    time_share_grace_s=1.0,
    per_row_fallback=False,
)
TASK = CartPole()
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", REPO, "/root", os.getcwd(), SHARED)
SUPERVISORS: set[int] = set()  # the workers this test process started (other runs share the machine)
ZYGOTES: set[int] = set()  # and the zygotes that forked them


def _supervisor(pid: int) -> bool:
    """Whether ``pid`` is still one of our supervisors (not a process that got its number since)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) in ZYGOTES
    except (OSError, ValueError, IndexError):
        return False


# -- the host around the tests ------------------------------------------------------------------------


@dataclass
class Listeners:
    tcp: socket.socket
    port: int
    unix: socket.socket
    abstract: str
    path_socket: socket.socket  # a Unix socket on the filesystem that anyone may connect to (as D-Bus's is)
    path: str

    def connections(self) -> int:
        n = 0
        for s in (self.tcp, self.unix, self.path_socket):
            while True:
                try:
                    conn, _ = s.accept()
                except (BlockingIOError, OSError):
                    break
                conn.close()
                n += 1
        return n


_KEY_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl


def plant_host_keys() -> list[int]:
    """The secret as a key in this process's session, user and user-session keyrings (those the kernel lets it add)."""
    import ctypes

    calls = _KEY_CALLS.get(os.uname().machine)
    if calls is None:
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    keys = []
    for ring in (-3, -4, -5):
        key = libc.syscall(
            ctypes.c_long(calls[0]),
            b"user",
            hostile_corpus.HOST_KEY.encode(),
            FAKE_KEY.encode(),
            ctypes.c_long(len(FAKE_KEY)),
            ctypes.c_long(ring),
        )
        if key > 0:
            keys.append(key)
    return keys


def revoke_keys(keys: list[int]) -> None:
    import ctypes

    calls = _KEY_CALLS.get(os.uname().machine)
    libc = ctypes.CDLL(None, use_errno=True)
    for key in keys if calls else []:
        libc.syscall(ctypes.c_long(calls[1]), ctypes.c_long(3), ctypes.c_long(key))  # KEYCTL_REVOKE


@pytest.fixture(scope="module")
def host() -> Any:
    """A secret only root can read, listeners a program could exfiltrate to, API keys in the environment."""
    os.makedirs(SECRET_DIR, exist_ok=True)
    os.chmod(SECRET_DIR, 0o755)
    with open(SECRET, "w") as f:
        f.write(FAKE_KEY)
    os.chmod(SECRET, 0o600)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    abstract = f"llm4rl-hostile-{os.getpid()}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + abstract)
    unix.listen(8)
    unix.setblocking(False)
    path = f"{SECRET_DIR}/open.sock"  # outside the folders a worker gets private copies of
    path_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path_socket.bind(path)
    os.chmod(path, 0o777)
    path_socket.listen(8)
    path_socket.setblocking(False)
    keys = plant_host_keys()
    os.makedirs(SHARED, exist_ok=True)
    os.chmod(SHARED, 0o1777)  # world-writable, as /var/crash or /var/mail are on some machines
    os.makedirs(os.path.dirname(RECORDS), exist_ok=True)
    with open(RECORDS, "w") as f:
        f.write(RECORD_TEXT)
    os.chmod(RECORDS, 0o644)  # readable by every user: only the worker's mount namespace hides it
    saved = {k: os.environ.get(k) for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HF_TOKEN", RECORDS_ENV)}
    hide_from_programs(RECORDS)  # as run_experiment does with the run's MLflow store
    os.environ.update(OPENAI_API_KEY=FAKE_KEY, ANTHROPIC_API_KEY=FAKE_KEY, HF_TOKEN=FAKE_KEY)
    try:
        yield Listeners(tcp, tcp.getsockname()[1], unix, abstract, path_socket, path)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        revoke_keys(keys)
        tcp.close()
        unix.close()
        path_socket.close()
        os.remove(path)
        os.remove(SECRET)
        shutil.rmtree(SHARED, ignore_errors=True)
        shutil.rmtree(os.path.dirname(RECORDS), ignore_errors=True)
        os.rmdir(SECRET_DIR)


@pytest.fixture(autouse=True)
def record_workers(monkeypatch: pytest.MonkeyPatch):
    spawn = Zygote.spawn

    def recording(self, request, fds, timeout):
        pid = spawn(self, request, fds, timeout)
        SUPERVISORS.add(pid)
        ZYGOTES.add(self.proc.pid)
        return pid

    monkeypatch.setattr(Zygote, "spawn", recording)


def worker_processes() -> list[int]:
    """Live processes of this test process's workers: their servers, supervisors and anything they started."""
    uids = {UID_BASE + pid for pid in SUPERVISORS}
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if (int(entry) in SUPERVISORS and _supervisor(int(entry))) or os.stat(f"/proc/{entry}").st_uid in uids:
                    found.append(int(entry))
            except FileNotFoundError:
                pass
    return found


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def host_state() -> dict[str, Any]:
    """What a program must not be able to change in the host process."""
    return {
        "env": dict(os.environ),
        "torch_isfinite": torch.isfinite,
        "numpy_isfinite": np.isfinite,
        "linear_forward": torch.nn.Linear.forward,
        "grad": torch.is_grad_enabled(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "torch_rng": _digest(torch.get_rng_state().tolist()),
        "numpy_rng": _digest(np.random.get_state()[1].tolist()),
        "python_rng": _digest(random.getstate()),
        "builtins": (builtins.len, builtins.isinstance, builtins.open, builtins.print),
        "sys_modules_torch": __import__("sys").modules.get("torch"),
        "program_sources": sorted(k for k in linecache.cache if k.startswith("<")),
    }


def hostile_files(tag: str) -> list[str]:
    found = []
    for folder in SCRATCH:
        found += glob.glob(os.path.join(folder, f"*hostile*{tag}*"))
    return found


# -- the loop ---------------------------------------------------------------------------------------------


def vm_size(pid: int) -> int:
    """The address space process ``pid`` has mapped now, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def limits_in_place(worker: ProgramWorker, limits: Limits, *, isolated: bool) -> None:
    """From the host: the worker's limits (and, where ``isolated``, its user and namespaces)
    before any program loads."""
    pid = worker._proc.server
    seen = {}
    with open(f"/proc/{pid}/limits") as f:
        for line in f.readlines()[1:]:
            seen[line[:26].strip()] = line[26:47].strip()
    assert seen["Max processes"] == str(limits.max_procs)
    # memory_mb on top of what the worker's imports had mapped when the limit was set (never more than it maps now)
    imported = int(seen["Max address space"]) - limits.memory_mb * 1024 * 1024
    assert 0 < imported <= vm_size(pid), (seen["Max address space"], vm_size(pid))
    assert seen["Max open files"] == str(limits.max_open_files)
    assert seen["Max cpu time"] != "unlimited" and seen["Max file size"] != "unlimited"
    if not isolated:
        return
    with open(f"/proc/{pid}/status") as f:
        uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
    assert all(int(u) >= UID_BASE for u in uids), uids
    iso = worker.isolation
    assert iso["network"] and iso["pid"] and iso["mount"] and iso["root_dropped"], iso


def fill(source: str, listeners: Listeners, tag: str) -> str:
    for key, value in (
        ("{PORT}", str(listeners.port)),
        ("{ABSTRACT}", listeners.abstract),
        ("{SECRET}", SECRET),
        ("{UNIX_PATH}", listeners.path),
        ("{SHARED}", SHARED),
        ("{RECORDS}", RECORDS),
        ("{REPO}", REPO),
        ("{TAG}", tag),
    ):
        source = source.replace(key, value)
    return source


def batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, TASK.obs_dim, generator=g) * 0.1
    return obs, torch.randint(0, 2, (n,), generator=g), obs + 0.01


def run_candidate(
    source: str, role: str, limits: Limits, calls: int, gap_s: float, isolated: bool = True
) -> tuple[str, str, list[str]]:
    """One candidate as the trainer runs it: a worker (limits checked first), a probe, training calls.

    :return: ``(category, message, component names)``; the host's batches are checked unchanged.
    """
    names: list[str] = []
    with candidate_scope():
        worker = ProgramWorker(limits)
        limits_in_place(worker, limits, isolated=isolated)  # before any hostile code runs
        try:
            if role == "reward":
                fn = prepare_reward(RewardProgram(source), TASK, limits=limits, worker=worker)
                names = list(fn.component_names)
                call = lambda obs, action, nxt: fn.from_obs(obs, action, nxt)  # noqa: E731
            elif role == "state":
                fn = prepare_state(StateProgram(source), TASK, limits=limits, worker=worker)
                call = lambda obs, action, nxt: fn.from_obs(obs)  # noqa: E731
            else:
                macros = MacroSet.prepare(
                    [MacroAction("hostile", Program(source, "act"))], TASK, limits=limits, worker=worker
                )
                call = lambda obs, action, nxt: macros.action(0, obs[0].numpy(), 2)  # noqa: E731
            for i in range(calls):
                obs, action, nxt = batch(i)
                kept = (obs.clone(), action.clone(), nxt.clone())
                out = call(obs, action, nxt)
                if isinstance(out, tuple):
                    names += list(out[1])
                assert all(torch.equal(a, b) for a, b in zip((obs, action, nxt), kept)), "the host's batch changed"
                time.sleep(gap_s)
        except SandboxError as e:
            return e.report.kind, e.report.message + "\n" + e.report.detail, names
    return "ok", "", names


BENIGN = "def compute_reward(state, action, next_state):\n    return 1.0 - next_state['pole_angle'].abs()\n"


def benign_candidate_works(limits: Limits) -> None:
    """The next candidate trains after a hostile one (its speed is not what is checked here: under a
    load of 7 on 2 cores a benign call once took longer than the corpus's 0.5 s call limit)."""
    limits = replace(limits, call_timeout_s=max(limits.call_timeout_s, 5.0))
    with candidate_scope():
        fn = prepare_reward(RewardProgram(BENIGN), TASK, limits=limits)
        obs, action, nxt = batch(99)
        reward, _ = fn.from_obs(obs, action, nxt)
        torch.testing.assert_close(reward, 1.0 - nxt[:, 2].abs())


def workers_isolated(limits: Limits = LIMITS) -> bool:
    """Whether a worker started now runs with every layer: its own uid, network, PID and mount namespaces.

    Asked of a real worker (what its supervisor's ``unshare`` and its server's ``setuid``
    achieved), never assumed from the user or the platform.
    """
    with candidate_scope():
        iso = ProgramWorker(limits).isolation
    return bool(iso.get("network") and iso.get("pid") and iso.get("mount") and iso.get("root_dropped"))


@pytest.fixture(scope="module")
def isolated() -> bool:
    """Whether workers here run with every layer (:func:`workers_isolated`).

    Without them (not root, no namespaces) only the runs with the static check on happen:
    the programs that pass it are plain Python, bounded by the resource limits.
    """
    return workers_isolated()


@pytest.mark.parametrize("static_check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("hostile", CORPUS, ids=[f"{h.kind}-{h.name}" for h in CORPUS])
def test_hostile_program(hostile: Hostile, static_check: bool, host: Listeners, isolated: bool) -> None:
    if not static_check and not isolated:
        pytest.skip("the worker's limits, user and namespaces are not all in place here: hostile code stays unrun")
    tag = f"{hostile.name}-{os.getpid()}-{int(static_check)}"
    limits = replace(LIMITS, static_check=static_check, **hostile.limits)
    before = host_state()
    start = time.monotonic()

    kind, message, names = run_candidate(
        fill(hostile.source, host, tag), hostile.role, limits, hostile.calls, hostile.gap_s, isolated
    )
    assert kind in hostile.expected(static_check), message
    assert time.monotonic() - start < 30
    if hostile.followup:
        follow, follow_message, _ = run_candidate(fill(hostile.followup, host, tag), "reward", limits, 2, 0.0, isolated)
        assert follow == hostile.followup_expected(static_check), follow_message
        assert "PERSISTED" not in follow_message
    benign_candidate_works(replace(LIMITS, static_check=static_check))  # the loop goes on

    deadline = time.monotonic() + 5
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_processes() == [], "a process of the candidate's worker outlived it"
    assert hostile_files(tag) == [], "a file the program wrote is on the host"
    assert host.connections() == 0, "the program reached a listener of the host"
    assert host_state() == before, "the host process changed"
    assert FAKE_KEY not in message and not any(FAKE_KEY in n for n in names)


# -- a few of them in a real training run ---------------------------------------------------------------

IN_TRAINING = [
    "typing_hints_run_code",
    "patch_isfinite_then_return_nan",
    "keep_result_and_spoil_it",
    "fork_bomb",
    "infinite_loop_after_the_probe",
    "exit_the_worker",
    "raise_keyboard_interrupt",
    "nan_in_one_row_after_the_probe",
]


@pytest.mark.parametrize("name", IN_TRAINING)
def test_hostile_candidate_fails_its_training_and_the_next_one_trains(
    name: str, host: Listeners, isolated: bool
) -> None:
    from core.config import Settings
    from core.context import TrainContext
    from core.records import Candidate
    from core.train.ppo import PPOConfig, train

    if not isolated:
        pytest.skip("the worker's isolation is not all in place here: hostile code stays unrun")
    hostile = next(h for h in CORPUS if h.name == name)
    tag = f"train-{name}-{os.getpid()}"
    sandbox = {
        "static_check": False,
        "call_timeout_s": 0.5,
        "max_procs": 8,
        "memory_mb": 2048,
        "cpu_s": 3,
        "time_share_grace_s": 1.0,
    }
    cfg = PPOConfig(
        frames=512, num_envs=4, rollout_steps=32, epochs=1, minibatch=64, hidden=[16], eval_every=0, eval_episodes=1
    )
    before = host_state()
    results = []
    for candidate in (
        Candidate("hostile", 0, reward=RewardProgram(fill(hostile.source, host, tag))),
        Candidate("benign", 0, reward=RewardProgram(BENIGN)),
    ):
        ctx = TrainContext(
            settings=Settings.of({"sandbox": sandbox}), task=TASK, candidate=candidate, seed=0, total_frames=cfg.frames
        )
        results.append(train(TASK, candidate, cfg, seed=0, ctx=ctx))
    bad, good = results
    expected = hostile.unchecked
    assert (bad.ok, bad.error_kind) == (expected == "ok", "" if expected == "ok" else expected), bad.error
    assert good.ok and good.frames == 512 and good.fitness is not None, good.error
    deadline = time.monotonic() + 5
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_processes() == [] and hostile_files(tag) == [] and host.connections() == 0
    trainer_sets = ("threads", "torch_rng")  # the trainer itself sets its threads and seeds torch
    after = host_state()
    assert {k: v for k, v in after.items() if k not in trainer_sets} == {
        k: v for k, v in before.items() if k not in trainer_sets
    }
