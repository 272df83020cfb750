"""The host's side of the worker protocol is total: every send and receive has a deadline,
and every reply the protocol does not allow ends the worker as ``crashed``.

Each test starts a real worker, then puts a peer of its own in the worker's place: a
socket the test drives, standing for a worker that stops reading or sends a forged
reply. No program runs in these tests beyond a benign one in a fresh worker afterwards:
the forged replies are written here, in the host, by the test itself.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any, Callable

import pytest
import torch

from core.records import RewardProgram
from core.sandbox import Limits, ProgramWorker, SandboxError, candidate_scope
from core.sandbox.programs import REWARD_ARGS
from core.sandbox.worker import SAME

LIMITS = Limits(cpu_s=5, wall_s=15, memory_mb=2048, call_timeout_s=0.5, max_time_share=1.0, time_share_grace_s=60.0)
PLAIN = "def compute_reward(state, action, next_state):\n    return next_state['x'] * 2.0\n"
FIELDS = [("x", 0, 1, ())]
#: how much later than its call's timeout a failed call may return on a loaded machine
MARGIN_S = 2.0


def _args(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    obs = torch.arange(batch, dtype=torch.float32)[:, None]
    return obs, torch.zeros(batch, dtype=torch.int64), obs + 1.0


class Peer:
    """The test's end of a socket put in a worker's place (the real worker waits, unused, until it is killed)."""

    def __init__(self, worker: ProgramWorker) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (mine, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        proc = worker._proc
        self.original, proc.sock = proc.sock, theirs
        worker._poll = select.poll()
        worker._poll.register(theirs, select.POLLIN)
        self.sock, self.host_end = mine, theirs
        self.server = proc.server
        self.thread: threading.Thread | None = None

    def fill(self) -> int:
        """Messages sent from the host's end until the socket is full (nothing reads them)."""
        sent = 0
        while True:
            try:
                self.host_end.send(b"x" * 64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return sent
            sent += 1

    def answer(self, reply: Callable[[int], bytes]) -> None:
        """Answer the next request with ``reply(seq)``, from a thread (as a worker would)."""

        def run() -> None:
            ready, _, _ = select.select([self.sock], [], [], 10.0)
            if not ready:
                return
            data = self.sock.recv(1 << 20)
            seq = struct.unpack_from("<Q", data, 1)[0] if data[:1] == bytes((SAME,)) else pickle.loads(data)["seq"]
            self.sock.send(reply(seq))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(5.0)
        for s in (self.sock, self.original):
            if s is not None:
                s.close()


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(f"/proc/{pid}")


def _in_time(work: Callable[[], Any], limit_s: float) -> BaseException | None:
    """Run ``work`` in a thread; the exception it raised (None if none). Fails if it is still
    running after ``limit_s``."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # handed to the test
            caught.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"the call was still waiting after {limit_s:g} s"
    return caught[0] if caught else None


def a_new_worker_works() -> None:
    with ProgramWorker(LIMITS) as worker:
        handle = worker.load(RewardProgram(PLAIN), role="reward", arg_names=REWARD_ARGS, fields=FIELDS)
        obs, action, nxt = _args()
        reward, _ = worker.call(handle, (obs, action, nxt), role="reward", batch=4, split=(0, 2))
        torch.testing.assert_close(reward, nxt[:, 0] * 2.0)


@pytest.fixture
def worker():
    with candidate_scope():
        w = ProgramWorker(LIMITS)
        yield w
        w.close()


def test_a_worker_that_stops_reading_times_out_within_the_call_timeout(worker: ProgramWorker) -> None:
    peer = Peer(worker)
    try:
        assert peer.fill() > 0
        start = time.monotonic()
        error = _in_time(
            lambda: worker.load(RewardProgram(PLAIN), role="reward", arg_names=REWARD_ARGS),
            LIMITS.call_timeout_s + MARGIN_S + 5.0,
        )
        elapsed = time.monotonic() - start
        assert isinstance(error, SandboxError), error
        assert error.report.kind == "timeout" and "took no request" in error.report.message
        assert LIMITS.call_timeout_s * 0.9 <= elapsed < LIMITS.call_timeout_s + MARGIN_S
        assert not worker.alive and _gone(peer.server)
    finally:
        peer.close()
    a_new_worker_works()


def _header(dtype: Any = "float32") -> list[list[Any]]:
    return [["block", dtype, [1, 4], 0]]


FORGED: dict[str, Callable[[int], bytes]] = {
    "a list as dtype": lambda seq: json.dumps(
        {"seq": seq, "out": _header(["float32"]), "names": [], "program_s": 0.001}
    ).encode(),
    "nesting 100000 deep": lambda seq: (
        f'{{"seq": {seq}, "out": ' + "[" * 100_000 + "]" * 100_000 + ', "names": [], "program_s": 0.001}'
    ).encode(),
    "program_s 10**400": lambda seq: json.dumps(
        {"seq": seq, "out": _header(), "names": [], "program_s": 10**400}
    ).encode(),
    "not JSON": lambda seq: b"\xff\xfe this is not JSON {",
    "a missing key": lambda seq: json.dumps({"seq": seq, "names": [], "program_s": 0.001}).encode(),
    "an empty dimension beside a huge one": lambda seq: json.dumps(
        {"seq": seq, "out": [["block", "float32", [0, 10**30], 0]], "names": [], "program_s": 0.001}
    ).encode(),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_malformed_reply_ends_the_worker_as_crashed(case: str, worker: ProgramWorker) -> None:
    peer = Peer(worker)
    try:
        peer.answer(FORGED[case])
        obs, action, nxt = _args()
        error = _in_time(
            lambda: worker.call(1, (obs, action, nxt), role="reward", batch=4), LIMITS.call_timeout_s + MARGIN_S
        )
        assert isinstance(error, SandboxError), repr(error)
        assert error.report.kind == "crashed" and "malformed reply" in error.report.message
        assert not worker.alive and _gone(peer.server)
        with pytest.raises(SandboxError) as again:  # every later call says why
            worker.call(1, (obs, action, nxt), role="reward", batch=4)
        assert again.value.report.kind == "crashed"
    finally:
        peer.close()
    a_new_worker_works()


def test_a_load_answer_without_ok_or_a_report_is_malformed(worker: ProgramWorker) -> None:
    peer = Peer(worker)
    try:
        peer.answer(lambda seq: json.dumps({"seq": seq}).encode())
        error = _in_time(
            lambda: worker.load(RewardProgram(PLAIN), role="reward", arg_names=REWARD_ARGS),
            LIMITS.call_timeout_s + MARGIN_S,
        )
        assert isinstance(error, SandboxError) and error.report.kind == "crashed"
        assert "malformed reply" in error.report.message and not worker.alive
    finally:
        peer.close()
