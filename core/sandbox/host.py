"""The host's side of the sandbox: the zygote, and a worker process per candidate.

:class:`ProgramWorker` is the only way the trainer and the driver run LLM-written code.
It asks the process's :class:`Zygote` for a fresh worker (:mod:`core.sandbox.worker`),
loads programs into it and calls them on batches that cross through shared memory
(:mod:`core.sandbox.wire`). Every wait on the worker has a deadline: past
``call_timeout_s`` the worker is killed and the call fails as ``timeout``. Time spent
in calls is summed per worker; once it passes ``time_share_grace_s`` and exceeds
``max_time_share`` of the wall time since the first call, the candidate fails as
``too_slow`` with the measured cost. A failure that ends the worker (a kill, a crash)
makes every later call fail with the same report; the next candidate gets a new worker.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import pickle
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar, Iterator

import numpy as np

from core.records import Program
from core.sandbox import memory, wire
from core.sandbox.programs import Invalid, checked_result, component_names
from core.sandbox.reports import DEFAULT_IMPORTS, KINDS, MESSAGE_CHARS, Limits, SandboxError, SandboxReport, fail
from core.sandbox.worker import MAX_SPIN_US, NO_NAMESPACES_ENV, SAME, SAME_REQUEST, SPIN_ENV

log = logging.getLogger("core.sandbox")

#: when started as root, each worker runs as its own user: this plus its supervisor's pid
UID_BASE = 2_000_000_000
MAX_REPLY = 1 << 18
MAX_SOURCE_CHARS = 200_000
ZYGOTE_START_S = 180.0  # the zygote imports torch once per host process; a busy machine is slow
#: the share of the wall time that counted calls may take, overhead included, whatever the worker reports
ROUND_TRIP_SHARE = 0.9
#: where the host may not raise a worker's CPU limit, the kernel's limit is this far above the
#: start-up budget and the host holds the worker to its growing budget itself (from /proc)
CPU_BACKSTOP_S = 24 * 3600
_SCRATCH_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")
_SAME_BYTE = bytes((SAME,))
#: the run's records (its MLflow store, output folder, LLM cache), hidden from every worker: in the
#: environment, so that the trainings an executor runs in other processes hide them too
RECORDS_ENV = "LLM4RL_HIDDEN_RECORDS"


def hide_from_programs(*paths: str | os.PathLike[str]) -> None:
    """Hide these files or folders of the run's records from every worker started from now on.

    In the worker's mount namespace an empty folder or file takes each one's place (a
    folder the worker imports from is left alone). Sqlite stores bring their journal
    files along. Without a mount namespace they stay as readable as their permissions
    make them (``docs/sandbox.md``).
    """
    records = hidden_records()
    for path in paths:
        real = os.path.realpath(os.fspath(path))
        for one in (
            (real, real + "-wal", real + "-shm", real + "-journal") if real.endswith((".db", ".sqlite")) else (real,)
        ):
            if one not in records:
                records.append(one)
    os.environ[RECORDS_ENV] = os.pathsep.join(records)


def hidden_records() -> list[str]:
    """The paths :func:`hide_from_programs` was given (in this process or the one that started it)."""
    return [p for p in os.environ.get(RECORDS_ENV, "").split(os.pathsep) if p]


def may_raise_cpu_limits() -> bool:
    """Whether this process may raise a worker's CPU limit as it trains.

    A worker started by root runs as another user, whose hard limit only a process with
    CAP_SYS_RESOURCE may raise (containers usually drop it); a worker started by anyone
    else keeps their user and a high hard limit.
    """
    if os.geteuid() != 0:
        return True
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) >> 24 & 1)  # CAP_SYS_RESOURCE is capability 24
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def child_env() -> dict[str, str]:
    """The zygote's environment: nothing of the host's (no API keys, tokens, LLM settings)."""
    root = str(Path(__file__).resolve().parent.parent.parent)
    return {
        "PATH": os.defpath,
        "PYTHONPATH": root,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "HOME": "/nonexistent",
    }


def _recv_json(sock: socket.socket, buf: bytearray, timeout: float) -> dict[str, Any] | None:
    """One JSON object within ``timeout`` seconds; None on EOF or anything else (``TimeoutError`` past it)."""
    ready, _, _ = select.select([sock], [], [], max(0.0, timeout))
    if not ready:
        raise TimeoutError
    n = sock.recv_into(buf)
    if n == 0:
        return None
    try:
        return wire.decode_reply(bytes(buf[:n]))
    except wire.MalformedReply:
        return None


class Zygote:
    """The process that forks workers: one per host process, started on first use.

    It imports torch once (seconds) so that a worker starts in milliseconds. It runs
    only trusted code, with the scrubbed environment of :func:`child_env`, and exits
    when its host does (its socket closes).
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _per_process: ClassVar[dict[int, Zygote]] = {}  # a process resource, like a connection pool

    @classmethod
    def shared(cls) -> Zygote:
        """This process's zygote, started (or restarted, if it died) now."""
        with cls._lock:
            z = cls._per_process.get(os.getpid())
            if z is None or not z.alive():
                if z is not None:
                    z.close()
                z = cls._per_process[os.getpid()] = cls()
            return z

    def __init__(self) -> None:
        host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-B", "-m", "core.sandbox.worker", str(child.fileno())],
                pass_fds=[child.fileno()],
                env=child_env(),
                cwd="/",
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.sock = host
        self.lock = threading.Lock()
        self.buf = bytearray(1 << 16)
        try:
            ready = _recv_json(self.sock, self.buf, ZYGOTE_START_S)
        except TimeoutError:
            ready = None
        if not ready or not ready.get("ready"):
            self.close()
            raise SandboxError(fail("crashed", "The sandbox could not start its zygote process."))
        self.threads = int(ready.get("threads", 0))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, request: dict[str, Any], fds: list[int], timeout: float) -> int:
        """Fork a supervised worker that gets ``fds``; the supervisor's pid."""
        with self.lock:
            socket.send_fds(self.sock, [pickle.dumps(request)], fds)
            try:
                reply = _recv_json(self.sock, self.buf, timeout)
            except TimeoutError:
                self.close()  # a late answer must not be read as the next request's: start afresh
                raise OSError("the zygote did not answer in time") from None
        if not reply or "pid" not in reply:
            raise OSError(f"the zygote could not fork a worker: {(reply or {}).get('error', 'no answer')}")
        return int(reply["pid"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)


class _Process:
    """What a worker holds outside Python objects; closed by the worker's finalizer."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.status_fd = -1
        self.status = b""
        self.server = 0  # the server's pid, in the host's PID namespace
        self.pidfd = -1
        self.arenas: list[wire.Arena] = []
        self.isolation: dict[str, Any] = {}
        self.memory_group: memory.MemoryGroup | None = None
        self.closed = False

    def kill(self) -> None:
        """SIGKILL to the server (process 1 of its PID namespace: everything in it dies too); wait up to 1 s."""
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                select.select([self.pidfd], [], [], 1.0)  # readable once it has exited
        elif self.server > 0 and b"exit " not in self.status:  # no pidfd (an old kernel): by pid, while not reaped
            with contextlib.suppress(OSError):
                os.kill(self.server, signal.SIGKILL)
        uid = int(self.isolation.get("uid", 0) or 0)
        if not self.isolation.get("pid") and uid >= UID_BASE:
            _kill_uid(uid)  # no PID namespace: whatever the program started runs as its own uid

    def exit_status(self, timeout: float) -> tuple[int, float] | None:
        """The server's wait status and CPU seconds, from its supervisor (None if they do not come in time)."""
        deadline = time.monotonic() + timeout
        while b"exit " not in self.status:
            left = deadline - time.monotonic()
            if self.status_fd < 0 or left <= 0:
                return None
            ready, _, _ = select.select([self.status_fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.status_fd, 4096)
            if not chunk:
                return None
            self.status += chunk
        fields = self.status.split(b"exit ", 1)[1].split(b"\n", 1)[0].split()
        try:
            return int(fields[0]), float(fields[1]) if len(fields) > 1 else 0.0
        except (ValueError, IndexError):
            return None

    def server_pid(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.status:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.status_fd], [], [], max(0.0, left))
            chunk = os.read(self.status_fd, 4096) if ready else b""
            if not chunk:
                raise TimeoutError
            self.status += chunk
        first = self.status.split(b"\n", 1)[0]
        if not first.startswith(b"server "):
            raise OSError("the supervisor did not start a server")
        return int(first[7:])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.kill()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        for fd in (self.status_fd, self.pidfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for arena in self.arenas:
            with contextlib.suppress(Exception):
                arena.close()
        self.arenas = []
        if not self.isolation.get("mount"):
            _remove_scratch(self.isolation)
        if self.memory_group is not None:
            self.memory_group.remove()


def _kill_uid(uid: int) -> None:
    for _ in range(3):  # processes may fork while we look
        found = False
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        os.kill(int(entry), signal.SIGKILL)
                        found = True
        if not found:
            return


def _remove_scratch(isolation: dict[str, Any]) -> None:
    """Without a mount namespace: the worker's own folder and what its uid left in scratch folders."""
    folder = str(isolation.get("folder", ""))
    if Path(folder).name.startswith("llm4rl-sandbox-") and Path(folder).parent == Path("/tmp"):
        shutil.rmtree(folder, ignore_errors=True)
    uid = int(isolation.get("uid", 0) or 0)
    if uid < UID_BASE:
        return  # a shared or the host's own uid: its files cannot be told apart
    for base in _SCRATCH_FOLDERS:
        with contextlib.suppress(OSError):
            for entry in os.scandir(base):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, ignore_errors=True)
                        else:
                            os.unlink(entry.path)


#: the workers started in the current candidate's scope (see :func:`candidate_scope`)
_SCOPE: contextvars.ContextVar[list[weakref.ref[ProgramWorker]] | None] = contextvars.ContextVar(
    "sandbox_scope", default=None
)


@contextlib.contextmanager
def candidate_scope() -> Iterator[None]:
    """Every worker started inside the block (by the trainer or by a plugin) ends with it.

    The trainer wraps one candidate's training in it (:func:`core.train.common.train_safely`),
    so that nothing a candidate's programs did outlives the candidate.
    """
    workers: list[weakref.ref[ProgramWorker]] = []
    token = _SCOPE.set(workers)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        for ref in workers:
            worker = ref()
            if worker is not None:
                worker.close()


def in_candidate_scope() -> bool:
    """Whether a :func:`candidate_scope` is open here (workers started now end with it)."""
    return _SCOPE.get() is not None


class _Warnings:
    """Each missing isolation layer is said once per process, in the run's log."""

    _said: ClassVar[set[str]] = set()

    @classmethod
    def once(cls, key: str, text: str) -> None:
        if key not in cls._said:
            cls._said.add(key)
            log.warning(text)


def _libc_getcpu() -> Any:
    import ctypes

    with contextlib.suppress(Exception):
        fn = ctypes.CDLL(None).sched_getcpu
        fn.restype = ctypes.c_int
        return fn
    return None


_GETCPU = _libc_getcpu()


def _current_cpu() -> int | None:
    """The CPU this thread runs on now (None where the C library cannot say)."""
    if _GETCPU is None:
        return None
    cpu = _GETCPU()
    return cpu if cpu >= 0 else None


def report_from(raw: Any) -> SandboxReport:
    """A report that came from a worker, with every field checked (kind, lengths)."""
    if not isinstance(raw, dict):
        return fail("crashed", "The sandbox worker sent an unreadable report.")
    kind = raw.get("kind") if raw.get("kind") in KINDS and raw.get("kind") != "ok" else "crashed"
    data = raw["data"] if isinstance(raw.get("data"), dict) else {}
    check = data.get("check")
    return SandboxReport(
        False,
        str(kind),
        str(raw.get("message", ""))[:MESSAGE_CHARS],
        str(raw.get("detail", ""))[:8000],
        {"check": str(check)[:20]} if check else {},
    )


class _Spin:
    """Whether a training step's round trip runs on two spinning CPUs instead of two sleeping processes.

    A step's call is a hand-off: the trainer sends and waits, the worker answers and
    waits for the next step (a millisecond later). Sleeping, each side pays a wake-up and
    runs on caches the other process has just used. Where the machine has a CPU to spare,
    the worker goes to another CPU and waits for the next step there, polling its socket
    for up to :attr:`worker_s` (then it sleeps), and the trainer polls for the answer for
    up to :attr:`host_s`. Nothing else changes: every message still goes through the
    socket, and every deadline is the same.

    Whether a CPU is spare is sampled every :data:`SAMPLE_S` from the kernel's count of
    runnable tasks (``/proc/loadavg``), less this thread and the worker: spinning starts
    only while no other task wants a CPU (a moving mean below 0.25 other tasks for two
    CPUs; more CPUs leave more room), and stops as soon as others do (above 0.5). It also
    stops while the steps come too far apart for a spin to catch them, and once the
    worker's CPU time left under its limit falls to :data:`CPU_RESERVE_S`. Where the host
    may not raise the worker's CPU limit (no ``CAP_SYS_RESOURCE``), the limit is the
    program's, and spinning may take only :data:`FIXED_LIMIT_SHARE` of ``cpu_s``.
    ``LLM4RL_SANDBOX_SPIN=0`` in the host's environment never spins, ``=1`` always does
    (with two CPUs or more: measurements, tests).
    """

    SAMPLE_S = 0.05
    WORKER_S = 0.002  # the longest a worker polls for the next step (a step of 8 small envs takes well under 1 ms)
    HOST_MAX_S = 0.001  # the longest the trainer polls for an answer
    #: no spinning once the worker's CPU time left under its limit is this short
    CPU_RESERVE_S = 2.0
    #: where the host may not raise the worker's CPU limit: the share of ``cpu_s`` that spinning may take
    FIXED_LIMIT_SHARE = 0.25
    __slots__ = (
        "cpus",
        "mode",
        "on",
        "others",
        "next_sample",
        "hits",
        "round_trip",
        "last_end",
        "worker_s",
        "host_s",
        "granted_s",
        "spun",
        "spent_s",
        "allowance_s",
    )

    def __init__(self) -> None:
        try:
            self.cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = frozenset()
        self.mode = os.environ.get(SPIN_ENV, "")  # "0": never, "1": always, else sampled
        self.on = self.mode == "1" and len(self.cpus) > 1
        self.others = 0.5  # moving mean of the other runnable tasks (two samples of none start spinning)
        self.next_sample = 0.0
        self.hits = 1.0  # moving share of steps that came within WORKER_S of the last answer
        self.round_trip = 0.0  # moving mean of a spun round trip
        self.last_end = 0.0
        self.worker_s = 0.0  # asked of the worker with the current call
        self.host_s = 0.0
        self.granted_s = 0.0  # spinning asked of the worker so far: CPU time added to its limit
        self.spun = 0  # calls whose answer was polled for
        # the worker's spinning so far, as the host saw it (the time until the next step, at most worker_s)
        self.spent_s = 0.0
        self.allowance_s: float | None = None  # spinning a worker may do in all (None: its CPU limit grows with it)

    def before(self, now: float) -> int:
        """At a training step's send: how long the worker may poll for the next one, in µs (0: sleep)."""
        if self.last_end:
            gap = now - self.last_end
            self.hits = 0.9 * self.hits + (0.1 if gap < self.WORKER_S else 0.0)
            self.spent_s += min(gap, self.worker_s)
        spin = self.on and self.hits >= 0.5 and (self.allowance_s is None or self.spent_s < self.allowance_s)
        self.worker_s = self.WORKER_S if spin else 0.0
        self.host_s = min(self.HOST_MAX_S, 4 * self.round_trip + 50e-6) if spin else 0.0
        self.granted_s += self.worker_s
        self.spun += spin
        return min(int(self.worker_s * 1e6), MAX_SPIN_US)

    def after(self, now: float, took: float) -> bool:
        """At the answer: the round trip noted; whether it is time to sample the machine."""
        self.last_end = now
        if self.worker_s:
            self.round_trip = 0.9 * self.round_trip + 0.1 * took if self.round_trip else took
        return now >= self.next_sample and self.mode != "0"

    def sample(self, now: float, worker: int, cpu_room: float) -> bool:
        """Look at the machine (and the worker's CPU time left); whether spinning changed."""
        self.next_sample = now + self.SAMPLE_S
        if len(self.cpus) < 2:
            return False
        if self.mode == "1":
            on = cpu_room > self.CPU_RESERVE_S
        else:
            running = _runnable()
            if running is None:
                return False
            others = max(0, running - 1 - _running(worker))  # less this thread, and the worker if it is running now
            self.others = 0.7 * self.others + 0.3 * others
            spare = len(self.cpus) - 2  # CPUs left once the trainer and the worker have one each
            on = self.others < spare + (0.5 if self.on else 0.25) and cpu_room > self.CPU_RESERVE_S
        if on == self.on:
            return False
        self.on = on
        if not on:
            self.round_trip = 0.0
        return True


def _running(pid: int) -> int:
    """1 if process ``pid`` is running or waiting for a CPU now, else 0."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split(None, 1)[0] == b"R")
    except (OSError, IndexError):
        return 0


def _runnable() -> int | None:
    """The machine's runnable tasks now (the kernel's count, this one included); None where it cannot be read."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


class _Lane:
    """A call repeated with the same layout (a training step): views of the input arena, made once.

    ``write`` copies tensors of the same dtypes and shapes as the first call's straight
    into their places; the worker is then told "the same call as last time".
    """

    __slots__ = ("key", "inputs")

    def __init__(self, key: tuple[Any, ...], plan: list[tuple[Any, int, int, tuple[int, ...]]], arena: Any) -> None:
        self.key = key
        self.inputs = [
            (dtype, shape, np.ndarray(shape, dtype, buffer=arena, offset=offset)) for dtype, _, offset, shape in plan
        ]

    def write(self, args: tuple[Any, ...]) -> bool:
        """Copy ``args`` into their places; False (nothing sent) unless they are plain CPU tensors
        of the same layout."""
        if type(args) is not tuple or len(args) != len(self.inputs):
            return False
        try:
            arrays = [a.numpy() for a in args]  # raises for anything but a plain CPU tensor
        except (AttributeError, RuntimeError, TypeError):
            return False
        for arr, (dtype, shape, _) in zip(arrays, self.inputs):
            if arr.dtype != dtype or arr.shape != shape:
                return False
        for arr, (_, _, view) in zip(arrays, self.inputs):
            view[...] = arr
        return True


class ProgramWorker:
    """A sandboxed process that runs one candidate's programs; ``close()`` ends it.

    >>> worker = ProgramWorker(Limits(), ("math", "torch"))
    >>> handle = worker.load(program, role="reward", arg_names=REWARD_ARGS)
    >>> reward, components = worker.call(handle, (state, action, next_state), role="reward", batch=8)

    ``role`` says how the worker shapes a value before it crosses back: ``reward``
    (``reward [B]`` plus ``c:<name>`` components), ``state`` (``features [B, k]``) or
    ``value`` (a small tensor). The results are copies, checked in the host
    (:func:`core.sandbox.programs.checked_result`).
    """

    def __init__(
        self, limits: Limits | None = None, allowed_imports: tuple[str, ...] | list[str] = DEFAULT_IMPORTS
    ) -> None:
        self.limits = limits or Limits()
        self.imports = tuple(allowed_imports)
        self.dead: SandboxReport | None = None
        self.busy_s = 0.0  # seconds spent in counted calls (the round trip, as the trainer sees it)
        self.program_s = 0.0  # of which in the program itself (measured in the worker)
        self.calls = 0
        self._clock0: float | None = None
        self._lock = threading.RLock()
        self._proc = _Process()
        self._finalizer = weakref.finalize(self, self._proc.close)
        self._handles = 0
        self._seq = 0
        self._last_call: dict[int, Any] = {}  # per handle: the last call's layout (sent once)
        self._last_header: dict[int, Any] = {}  # per handle: the last result's layout, checked
        self._lanes: dict[int, _Lane] = {}  # per handle: views for a call repeated on new values
        self._buf = bytearray(MAX_REPLY)
        self._next_cpu_raise = 0.0
        self._ended_at: float | None = None
        self._cpu: tuple[int, bool] | None = None  # where the worker was placed: (this thread's CPU, away from it)
        self._spin = _Spin()
        self._cpu_limit = float("inf")
        self.last_printed = ""
        scope = _SCOPE.get()
        if scope is not None:
            scope.append(weakref.ref(self))
        self._start()

    # -- life ----------------------------------------------------------------------------------
    def _start(self) -> None:
        limits, proc = self.limits, self._proc
        Zygote.shared()  # the first in a process imports torch (seconds): not the worker's start-up time
        deadline = time.monotonic() + limits.wall_s
        proc.arenas = [wire.Arena(wire.MIN_ARENA), wire.Arena(wire.MIN_ARENA)]
        host, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (host, theirs):
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        proc.sock = host
        status_r, status_w = os.pipe()
        proc.status_fd = status_r
        read_only = proc.arenas[0].read_only_fd()
        backstop = 0.0 if may_raise_cpu_limits() else float(CPU_BACKSTOP_S)
        proc.memory_group = memory.create(int(limits.memory_mb) * 1024 * 1024)
        request = {
            "limits": limits,
            "imports": self.imports,
            "uid_base": UID_BASE,
            "cpu_backstop_s": backstop,
            "namespaces": os.environ.get(NO_NAMESPACES_ENV, "") in ("", "0"),
            "records": hidden_records(),
            "memory_group": str(proc.memory_group.path) if proc.memory_group else None,
        }
        try:
            for attempt in range(2):
                try:
                    Zygote.shared().spawn(
                        request,
                        [theirs.fileno(), status_w, read_only, proc.arenas[1].fd],
                        max(1.0, deadline - time.monotonic()),
                    )
                    break
                except (OSError, TimeoutError):
                    if attempt:
                        raise
            proc.server = proc.server_pid(max(0.1, deadline - time.monotonic()))
            ready = _recv_json(host, self._buf, max(0.1, deadline - time.monotonic()))
            if ready and ready.get("ready"):  # alive and waiting for us: its pid cannot have been reused
                with contextlib.suppress(OSError):
                    proc.pidfd = os.pidfd_open(proc.server)
        except TimeoutError:
            self._end(fail("crashed", f"The sandbox worker did not start within {limits.wall_s:g} s."))
            raise SandboxError(self.dead) from None  # type: ignore[arg-type]
        except (OSError, ValueError) as e:
            self._end(fail("crashed", f"The sandbox could not start a worker: {e}"))
            raise SandboxError(self.dead) from None  # type: ignore[arg-type]
        finally:
            theirs.close()
            for fd in (status_w, read_only):
                with contextlib.suppress(OSError):
                    os.close(fd)
        if not ready or not ready.get("ready"):
            error = str((ready or {}).get("error", "no answer"))[:300]
            self._end(fail("crashed", f"The sandbox worker could not set its limits: {error}"))
            raise SandboxError(self.dead)  # type: ignore[arg-type]
        isolation = ready["isolation"] if isinstance(ready.get("isolation"), dict) else {}
        proc.isolation = isolation
        try:  # whether the host may raise the worker's CPU limit as it trains (needs CAP_SYS_RESOURCE over its user)
            resource.prlimit(proc.server, resource.RLIMIT_CPU)
        except OSError:
            self._spin.allowance_s = _Spin.FIXED_LIMIT_SHARE * limits.cpu_s
        self._cpu_base = float(isolation.get("cpu_base", 0.0))
        self._cpu_limit = float(
            int(self._cpu_base + limits.cpu_s) + 1
        )  # the budget at start (the kernel's, or the host's)
        self._poll = select.poll()
        self._poll.register(host, select.POLLIN)
        self._say_what_is_missing()

    def _say_what_is_missing(self) -> None:
        iso = self._proc.isolation
        missing = [name for name in ("network", "pid", "mount") if not iso.get(name)]
        if missing:
            why = f" ({iso['error']})" if iso.get("error") else ""
            _Warnings.once(
                "ns:" + ",".join(missing),
                (
                    f"sandbox: no {', '.join(missing)} namespace for LLM-written programs{why}: "
                    + ("they can reach the network; " if "network" in missing else "")
                    + ("processes they start are killed by uid or process group only; " if "pid" in missing else "")
                    + (
                        "they see the host's /tmp and /proc (docs/sandbox.md lists what remains outside the guarantee)."
                        if "mount" in missing
                        else "see docs/sandbox.md."
                    )
                ),
            )
        if not iso.get("root_dropped") and not iso.get("user"):
            _Warnings.once(
                "uid",
                "sandbox: not started as root: LLM-written programs run as your own user "
                "(no privilege drop; max_procs counts all your processes).",
            )

    @property
    def isolation(self) -> dict[str, Any]:
        """Which layers are in place: ``network``, ``pid``, ``mount``, ``ipc`` namespaces, ``uid``..."""
        return dict(self._proc.isolation)

    @property
    def alive(self) -> bool:
        return self.dead is None

    def close(self) -> None:
        """End the worker and everything it started; later calls fail."""
        self._end(fail("crashed", "The sandbox worker was closed."), closing=True)

    def __enter__(self) -> ProgramWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _end(self, report: SandboxReport, closing: bool = False) -> SandboxReport:
        """The worker is over: kill it, remember why, free what it held."""
        if self.dead is None:
            if not closing and report.kind in ("timeout", "too_slow", "crashed"):
                report = self._memory_verdict() or report  # the cause, where memory ran out
            self.dead = report
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        self._finalizer()
        return self.dead

    def _died(self) -> SandboxReport:
        """The worker went away on its own (or sent nonsense): say why, as well as we can tell."""
        exit = self._proc.exit_status(1.0)
        limits = self.limits
        status, cpu = exit if exit is not None else (None, 0.0)
        if status is None:
            report = fail("crashed", "The program's worker stopped answering and was killed.")
        elif os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self._cpu_limit - 0.5):
                report = fail(
                    "too_slow",
                    f"The program used {cpu:.1f} s of CPU time, more than its budget ({limits.cpu_s:g} s "
                    f"plus {limits.max_time_share:.0%} of the training time), and was stopped. "
                    "Do less work per call, and none between calls.",
                )
            elif sig == signal.SIGKILL:
                report = fail(
                    "crashed", "The program's worker was killed (SIGKILL), most likely out of memory. Allocate less."
                )
            else:
                report = fail("crashed", f"The program crashed its worker ({name}).")
        else:
            report = fail(
                "crashed", f"The program's worker exited with status {os.WEXITSTATUS(status)} without an answer."
            )
        return self._end(report)

    def _over_memory(self, measured: int = 0) -> SandboxReport:
        seen = f" ({measured / 2**20:,.0f} MB)" if measured else ""
        return fail(
            "memory",
            f"The program's worker used more memory{seen} than its limit of {self.limits.memory_mb:g} MB "
            "for all its processes and temporary files together, and was stopped. Allocate less, "
            "and start no processes.",
        )

    def _memory_verdict(self) -> SandboxReport | None:
        """``memory`` when the worker went over its memory: a kill in its memory group (the kernel may
        have stopped one of its processes only), or, without a group, the host's own measure."""
        iso, group, proc = self._proc.isolation, self._proc.memory_group, self._proc
        if self.dead is not None or proc.closed or not proc.server:
            return None
        if group is not None and iso.get("memory_group"):
            return self._over_memory() if group.oom_kills() else None
        used = memory.resident_bytes(proc.server, iso.get("private_folders") or ())
        return self._over_memory(used) if used > int(self.limits.memory_mb) * 1024 * 1024 else None

    def _check_memory(self) -> None:
        """Once a second, as calls come (a worker that ends slow or killed is asked the same in :meth:`_end`)."""
        verdict = self._memory_verdict()
        if verdict is not None:
            raise SandboxError(self._end(verdict))

    # -- requests ------------------------------------------------------------------------------
    def _request(
        self, message: dict[str, Any], timeout: float, fds: list[int] | None = None, same: int = 0, count: bool = False
    ) -> tuple[dict[str, Any], float]:
        """Send a request (or, with ``same``, "the last call of that handle again") and wait for the reply.

        Sending and receiving share one deadline, ``timeout`` from the start of the send:
        a worker that stops reading its requests is as late as one that stops answering
        (``timeout``, the worker killed). A reply is decoded by :func:`core.sandbox.wire.decode_reply`;
        anything the protocol does not allow ends the worker as ``crashed``
        (:meth:`_malformed`), so every reply either is a dict with this request's ``seq`` or
        raises :class:`SandboxError`.
        """
        if self.dead is not None:
            raise SandboxError(self.dead)
        self._seq += 1
        spin = self._spin
        spin_us = spin.before(time.perf_counter()) if same and count else 0
        self._follow_cpu(away=spin_us > 0)
        if same:
            data = _SAME_BYTE + SAME_REQUEST.pack(self._seq, same, spin_us)
        else:
            message["seq"] = self._seq
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        sock = self._proc.sock
        assert sock is not None
        start = time.perf_counter()
        try:
            sent = self._send(sock, data, fds, start + timeout)
        except OSError:
            raise SandboxError(self._died()) from None
        if not sent:
            elapsed = time.perf_counter() - start
            self._end(
                fail(
                    "timeout",
                    f"Timeout: the program's worker took no request for {elapsed:.2f} s "
                    f"(a call may take {timeout:g} s) and was stopped.",
                )
            )
            raise SandboxError(self.dead)  # type: ignore[arg-type]
        poll = self._poll.poll
        ready = False
        if same and count and spin.host_s:  # the worker answers from another CPU: poll for it there, then sleep
            clock, end = time.perf_counter, start + spin.host_s
            while not (ready := bool(poll(0))) and clock() < end:
                pass
        if not ready and not poll(max(0, int((timeout - (time.perf_counter() - start)) * 1000))):
            elapsed = time.perf_counter() - start
            self._end(
                fail(
                    "timeout",
                    f"Timeout: a call took longer than {timeout:g} s (stopped after {elapsed:.2f} s). "
                    "Make the function faster (vectorise over the batch, no long loops).",
                )
            )
            raise SandboxError(self.dead)  # type: ignore[arg-type]
        try:
            n = sock.recv_into(self._buf, 0, socket.MSG_DONTWAIT)
        except OSError:
            n = 0
        now = time.perf_counter()
        took = now - start
        if n == 0:
            raise SandboxError(self._died())
        if same and count and spin.after(now, took):
            spin.sample(now, self._proc.server, self._cpu_room())
        if self._buf[0] == SAME and n == 17:  # the same result layout as this handle's last call
            seq, program_s = struct.unpack_from("<Qd", self._buf, 1)
            reply = {"seq": seq, "out": SAME, "program_s": program_s}
        else:
            try:
                reply = wire.decode_reply(bytes(self._buf[:n]))
            except wire.MalformedReply as e:
                raise self._malformed(str(e)) from None
        if type(reply.get("seq")) is not int or reply["seq"] != self._seq:
            raise self._malformed("not the answer to this request" if "seq" in reply else "no seq")
        return reply, took

    @staticmethod
    def _send(sock: socket.socket, data: bytes, fds: list[int] | None, deadline: float) -> bool:
        """Send one message before ``deadline`` (``time.perf_counter()``); False when the worker
        did not take it in time. Never blocks past the deadline: the socket is full while the
        worker does not read.
        """
        waiter: Any = None  # a select.poll, made once the socket is full
        while True:
            try:
                if fds:
                    socket.send_fds(sock, [data], fds, socket.MSG_DONTWAIT)
                else:
                    sock.send(data, socket.MSG_DONTWAIT)
                return True
            except (BlockingIOError, InterruptedError):
                pass
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            if waiter is None:
                waiter = select.poll()
                waiter.register(sock, select.POLLOUT)
            waiter.poll(max(1, int(left * 1000)))  # writable, closed, or the deadline: the loop says which

    def _malformed(self, detail: str) -> SandboxError:
        """The worker's reply broke the protocol: the worker is ended (``crashed``); the error to raise."""
        return SandboxError(
            self._end(fail("crashed", f"The program's worker sent a malformed reply ({detail[:200]}) and was stopped."))
        )

    def _follow_cpu(self, away: bool = False) -> None:
        """Keep the worker on the CPU this thread runs on, or, ``away``, on the others.

        A call is a hand-off (the host blocks until the answer), so the host's CPU is the
        one that is free when the worker wakes; elsewhere it may wait for another
        process's time slice (milliseconds on a busy machine). A worker asked to spin for
        the next step (:class:`_Spin`) must not hold the trainer's CPU: it goes to the
        others. Placed again only when this thread moved or that changed.
        """
        cpu = _current_cpu()
        if cpu is None or (cpu, away) == self._cpu:
            return
        self._cpu = (cpu, away)
        cpus = self._spin.cpus
        where = cpus - {cpu} if away and cpu in cpus and len(cpus) > 1 else {cpu}
        with contextlib.suppress(OSError):
            os.sched_setaffinity(self._proc.server, where)

    def load(
        self,
        program: Program,
        *,
        role: str,
        arg_names: tuple[str, ...] | list[str] | None = None,
        fields: list[tuple[str, int, int, tuple[int, ...]]] | None = None,
    ) -> int:
        """Run ``program``'s module body in the worker (within ``call_timeout_s``); a handle for :meth:`call`.

        ``fields`` (:func:`core.sandbox.programs.task_fields`) lets calls pass whole
        observations that the worker names (``split``).
        """
        if len(program.source or "") > MAX_SOURCE_CHARS:
            raise SandboxError(fail("forbidden", f"The program is longer than {MAX_SOURCE_CHARS} characters."))
        with self._lock:
            self._handles += 1
            handle = self._handles
            source_only = Program(program.source, program.entry)  # not its prompt, reply or meta
            reply, _ = self._request(
                {
                    "op": "load",
                    "handle": handle,
                    "program": source_only,
                    "role": role,
                    "arg_names": list(arg_names) if arg_names is not None else None,
                    "fields": fields,
                },
                self.limits.call_timeout_s,
            )
            if "report" in reply:
                raise SandboxError(report_from(reply["report"]))
            if reply.get("ok") is not True:
                raise self._malformed("a load answer with neither ok nor a report")
            return handle

    def call(
        self,
        handle: int,
        args: tuple[Any, ...],
        *,
        role: str,
        batch: int = 0,
        per_row: bool = False,
        count: bool = True,
        printed: bool = False,
        split: tuple[int, ...] = (),
    ) -> Any:
        """Call a loaded program on ``args`` (tensors, dicts of tensors); its checked value.

        ``reward`` (``batch`` rows): ``(reward [B], {name: [B]})``; ``state``: features
        ``[B, k]``; both float32, finite, copies of what the worker wrote.
        ``value``: a small tensor (its meaning is the caller's to check).

        ``split`` lists the arguments that are observations ``[B, obs_dim]`` for the
        worker to name by the fields given to :meth:`load` (one tensor crosses instead of
        one per field). ``count`` adds the call to the time budget (training calls; not probes).
        With ``printed``, the program's printed text is kept in :attr:`last_printed`.
        :raises SandboxError: the program failed; for ``timeout``, ``too_slow`` and
            ``crashed`` the worker is gone.
        """
        with self._lock:
            if self.dead is not None:
                raise SandboxError(self.dead)
            lane = self._lanes.get(handle)
            if lane is not None and not printed and lane.key == (role, batch, per_row, split) and lane.write(args):
                reply, took = self._request(None, self.limits.call_timeout_s, same=handle, count=count)  # type: ignore[arg-type]
                self.last_printed = ""
            else:
                reply, took = self._call_request(handle, args, role, per_row, printed, split)
                lane = None
            if "report" not in reply and ("out" not in reply or "program_s" not in reply):
                raise self._malformed(f"a call answer without {'out' if 'out' not in reply else 'program_s'}")
            if count:
                self._account(took, self._seconds(reply["program_s"]) if "program_s" in reply else float("nan"))
            if printed:
                self.last_printed = str(reply.get("printed", ""))[:2000]
            if "report" in reply:
                raise SandboxError(report_from(reply["report"]))
            out = self._proc.arenas[1].map
            try:
                if reply["out"] == SAME and handle in self._last_header:
                    layout, names = self._last_header[handle]
                else:
                    layout, names = wire.check_header(reply["out"], len(out)), component_names(reply.get("names", []))
                    self._last_header[handle] = layout, names
                named = wire.read_named(layout, out)
            except ValueError as e:
                raise self._malformed(f"its result: {e}") from None
            except Invalid as e:
                raise SandboxError(e.report()) from None
            try:
                value = checked_result(role, named, names, batch)
            except Invalid as e:
                raise SandboxError(e.report()) from None
            except Exception as e:  # a checked layout no check expected: the reply is the worker's fault
                raise self._malformed(f"its result: {type(e).__name__}: {e}") from None
            if lane is None:
                self._lanes.pop(handle, None)
                if not printed:
                    plan = wire.flat_plan(self._last_call[handle][0])
                    if plan:
                        self._lanes[handle] = _Lane((role, batch, per_row, split), plan, self._proc.arenas[0].map)  # type: ignore[arg-type]
            return value

    def _seconds(self, value: Any) -> float:
        """A reply's ``program_s`` (:func:`core.sandbox.wire.reply_seconds`), or the worker ends as ``crashed``."""
        try:
            return wire.reply_seconds(value)
        except wire.MalformedReply as e:
            raise self._malformed(str(e)) from None

    def _call_request(
        self, handle: int, args: tuple[Any, ...], role: str, per_row: bool, printed: bool, split: tuple[int, ...]
    ) -> tuple[dict[str, Any], float]:
        """A call as a full request (its layout sent once, then "the same as last time")."""
        fds = None
        try:
            spec, end = wire.pack_tree(args, self._proc.arenas[0].map)
        except wire.TooBig:
            fds = self._grow(wire.tree_nbytes(args))
            spec, end = wire.pack_tree(args, self._proc.arenas[0].map)
        key = (spec, end, role, per_row, printed, split)
        same = handle if fds is None and self._last_call.get(handle) == key else 0
        self._last_call[handle] = key
        return self._request(
            {
                "op": "call",
                "handle": handle,
                "args": spec,
                "end": end,
                "role": role,
                "per_row": per_row,
                "printed": printed,
                "split": split,
            },
            self.limits.call_timeout_s,
            fds,
            same=same,
        )

    def _grow(self, need: int) -> list[int]:
        """New arenas that hold ``need`` bytes; the descriptors to send with the call."""
        size = wire.arena_size(need)
        new = [wire.Arena(size), wire.Arena(size)]
        old, self._proc.arenas = self._proc.arenas, new
        self._lanes.clear()  # their views are of the old input arena
        for arena in old:
            arena.close()
        return [new[0].read_only_fd(), new[1].fd]

    # -- the time budget -----------------------------------------------------------------------
    def _account(self, took: float, program_s: float) -> None:
        """Add a call to the time budget; ``too_slow`` once the program takes more than its share.

        The program's own time is measured in the worker (wall clock around the call, so
        sleeping counts); the worker could lie about it, so the round trip as the trainer
        sees it is held to a looser bound too (:data:`ROUND_TRIP_SHARE`), and the kernel
        holds the worker's CPU time to the same share (:meth:`_raise_cpu_limit`).
        """
        now = time.monotonic()
        if self._clock0 is None:
            self._clock0 = now - took
        reported = program_s if program_s == program_s else took  # NaN: the round trip
        self.program_s += min(max(reported, 0.0), took)
        self.busy_s += took
        self.calls += 1
        limits = self.limits
        if self.busy_s > limits.time_share_grace_s:
            elapsed = max(now - self._clock0, 1e-9)
            share, round_trip = self.program_s / elapsed, self.busy_s / elapsed
            if share > limits.max_time_share or round_trip > max(limits.max_time_share, ROUND_TRIP_SHARE):
                per_call = self.program_s / self.calls * 1000
                raise SandboxError(
                    self._end(
                        fail(
                            "too_slow",
                            (
                                f"Too slow: the program took {self.program_s:.1f} s of the last "
                                f"{elapsed:.1f} s of training ({share:.0%}, {round_trip:.0%} with the "
                                f"calls' overhead; the budget is {limits.max_time_share:.0%}), "
                                f"{per_call:.2f} ms per call over {self.calls} calls. Make it faster: "
                                "vectorise over the batch, avoid Python loops over rows."
                            ),
                        )
                    )
                )
        if now >= self._next_cpu_raise:
            self._raise_cpu_limit(now)

    def _cpu_room(self) -> float:
        """CPU seconds the worker may still use under its limit as it stands."""
        used = self.cpu_seconds()
        return self._cpu_limit - used if used is not None else 0.0

    def _raise_cpu_limit(self, now: float) -> None:
        """The worker's CPU limit grows with the time it spent in calls (checked once a second).

        One thread runs a call, so a call's CPU time is at most its round trip; the worker has
        no business using CPU between calls. Budgeting by the calls' time rather than by a
        share of the wall time catches CPU burnt between calls at any load: threads left
        running on a busy machine get little CPU, but the calls' time does not grow with it.
        """
        self._next_cpu_raise = now + 1.0
        self._check_memory()
        limits = self.limits
        budget = (
            self._cpu_base + limits.cpu_s + limits.time_share_grace_s + self.busy_s + self._spin.granted_s
        )  # the polling for the next step that the host asked for
        seconds = int(budget) + 1
        with contextlib.suppress(OSError, ValueError):
            _, hard = resource.prlimit(self._proc.server, resource.RLIMIT_CPU)
            resource.prlimit(
                self._proc.server,
                resource.RLIMIT_CPU,
                (seconds, seconds + 1 if os.geteuid() == 0 else max(hard, seconds + 1)),
            )
            self._cpu_limit = float(seconds)
        if self._spin.allowance_s is not None:
            # The kernel's limit could not follow (it is the backstop far above): the host holds the
            # worker to its budget itself, also where a program raised its own soft limit.
            self._cpu_limit = float(seconds)
        used = self.cpu_seconds()
        if used is not None and used > seconds + 1.0:
            raise SandboxError(
                self._end(
                    fail(
                        "too_slow",
                        (
                            f"The program used {used:.1f} s of CPU time, more than its budget "
                            f"({limits.cpu_s:g} s plus {limits.max_time_share:.0%} of the training time), "
                            "and was stopped. Do less work per call, and none between calls."
                        ),
                    )
                )
            )

    def metrics(self) -> dict[str, float]:
        """Time in programs for the candidate's result: seconds, calls, share of the wall time."""
        out = {
            "sandbox/program_seconds": round(self.program_s, 4),
            "sandbox/call_seconds": round(self.busy_s, 4),
            "sandbox/program_calls": float(self.calls),
        }
        if self._clock0 is not None and self.calls:
            end = self._ended_at if self._ended_at is not None else time.monotonic()
            out["sandbox/program_share"] = round(self.program_s / max(end - self._clock0, 1e-9), 4)
            out["sandbox/call_share"] = round(self.busy_s / max(end - self._clock0, 1e-9), 4)
        if self.calls:
            out["sandbox/spun_share"] = round(self._spin.spun / self.calls, 4)  # calls made on spinning CPUs
        iso = self._proc.isolation
        out["sandbox/namespaces"] = float(all(iso.get(n) for n in ("network", "pid", "mount")))
        cpu = self.cpu_seconds()
        if cpu is not None:
            out["sandbox/worker_cpu_seconds"] = round(cpu, 3)
        return out

    def cpu_seconds(self) -> float | None:
        """CPU time the worker's server process has used so far, all its threads (None once it is gone)."""
        if self.dead is not None or not self._proc.server:
            return None
        try:
            with open(f"/proc/{self._proc.server}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None
