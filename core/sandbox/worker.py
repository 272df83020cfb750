"""The processes that run LLM-written code: a zygote, and one worker per candidate.

``python -m core.sandbox.worker FD`` is the *zygote*, started once per host process by
:class:`core.sandbox.host.Zygote` with a scrubbed environment. It imports and warms up
torch, numpy and the allowed submodules (trusted code only, one thread), then waits on
the socket ``FD`` for spawn requests. For each it forks:

1. a *supervisor*, which starts a new session, leaves the host's namespaces where the
   kernel allows it (network, PID, mount, IPC: ``unshare``), forks the server and
   reports the server's process id and, later, its exit status on a status pipe;
2. the *server*, process 1 of the new PID namespace (so every process the program
   starts dies with it). Before any program arrives it mounts a private ``/proc`` and
   private, size-limited tmpfs over the world-writable folders (``/tmp``, ``/var/tmp``,
   ``/dev/shm``...), makes its own temporary folder, sets its resource limits (address
   space, CPU time, processes, open files, file size, no core files), drops to an
   unprivileged user with ``no_new_privs``, and clears its environment. Only then does
   it answer "ready" and serve requests: load a program, call it on a batch from the
   shared input arena, write the result to the output arena, answer in JSON.

The host enforces every deadline from outside and kills the server (and with it the
namespace) when one passes; a worker never outlives its host (it exits when the socket
closes, and dies with its supervisor).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import importlib
import json
import mmap
import os
import pickle
import resource
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

from core.sandbox import memory

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    0x4000,
    1 << 18,
)
#: world-writable folders replaced by private tmpfs in the worker's mount namespace
PRIVATE_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/run/shm")
#: home folders hidden behind an empty tmpfs (the interpreter's own folders in them stay, read-only)
HIDDEN_FOLDERS = ("/root", "/home")
#: imported by the zygote, so no worker needs file access for them after dropping privileges
PRELOAD = (
    "math",
    "numpy",
    "numpy.linalg",
    "numpy.random",
    "numpy.fft",
    "torch",
    "torch.nn",
    "torch.nn.functional",
    "torch.linalg",
    "torch.special",
    "torch.fft",
    "torch.distributions",
    "typing",
)
MAX_REQUEST = 1 << 20
SAME = 1  # first byte of a short message: "the same call (or result layout) as last time"
#: after SAME: the request's sequence number, the handle, and how long to wait for the next one on a spinning CPU (µs)
SAME_REQUEST = struct.Struct("<QIH")
#: the short answer: SAME, the sequence number, the seconds spent in the program
_SAME_REPLY = struct.Struct("<BQd")
#: the longest a worker waits for the next request on a spinning CPU, whatever the host asks (µs)
MAX_SPIN_US = 5000
#: set to 1 in the host's environment, workers start without namespaces (the fallback path, as
#: where the kernel allows none)
NO_NAMESPACES_ENV = "LLM4RL_SANDBOX_NO_NAMESPACES"
#: in the host's environment: 0 never lets a worker spin for the next step, 1 always does (two
#: CPUs or more), unset: while a CPU is spare
SPIN_ENV = "LLM4RL_SANDBOX_SPIN"


def _libc() -> Any:
    """The C library already loaded in this process (``unshare``, ``mount``, ``prctl``)."""
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> bool:
    """Best effort: Linux only; failure leaves the other layers in place."""
    with contextlib.suppress(Exception):
        return _libc().prctl(option, value, 0, 0, 0) == 0
    return False


def _send(sock: socket.socket, obj: Any) -> None:
    sock.send(json.dumps(obj, default=str).encode())


# -- the zygote -------------------------------------------------------------------------------------


def zygote(fd: int) -> None:
    """Warm up, then fork one supervised worker per spawn request until the host goes."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    os.close(devnull)
    ctl = socket.socket(fileno=fd)
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    for module in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    import core.sandbox.programs  # the server's code, loaded once
    import core.sandbox.wire  # noqa: F401

    (torch.ones(2) + 1).sum().item()  # lazily created state, before any fork
    # torch's C code imports some modules on first use (torch.storage when a list holding
    # tensors becomes a tensor); under a program's restricted __import__ that import fails
    # with an internal assert, so make those first uses here
    torch.tensor([0.0, torch.zeros(())]).storage()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    _send(ctl, {"ready": True, "threads": len(os.listdir("/proc/self/task"))})
    children: list[int] = []
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, MAX_REQUEST, 8)
        except OSError:
            break
        if not msg:
            break  # the host is gone
        request = pickle.loads(msg)  # from the host: trusted
        try:
            pid = os.fork()
        except OSError as e:
            for f in fds:
                os.close(f)
            _send(ctl, {"error": f"fork failed: {e}"})
            continue
        if pid == 0:
            try:
                ctl.close()  # the zygote's socket: no object of it is left for a program to find
                del ctl
                _supervise(request, fds)
            finally:
                os._exit(70)
        for f in fds:
            os.close(f)
        children = [c for c in children if _alive(c)] + [pid]
        _send(ctl, {"pid": pid})
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


# -- the supervisor ---------------------------------------------------------------------------------


def _supervise(request: dict[str, Any], fds: list[int]) -> None:
    """Leave the host's namespaces, fork the server, report its pid and exit status."""
    sock_fd, status_fd, in_fd, out_fd = fds
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the zygote
    keep = {sock_fd, status_fd, in_fd, out_fd}
    for fd in _open_fds():
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    group = request.get("memory_group")
    joined = bool(group) and memory.join(str(group))  # before anything else: all the worker's processes in it
    spaces = _unshare() if request.get("namespaces", True) else _without_namespaces()
    spaces["memory_group"] = joined
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        try:
            _serve(request, sock_fd, in_fd, out_fd, spaces, me)
        finally:
            os._exit(71)
    for fd in (sock_fd, in_fd, out_fd):
        os.close(fd)
    os.write(status_fd, f"server {pid}\n".encode())
    cpu = 0.0
    while True:
        try:
            _, status, usage = os.wait4(pid, 0)
            cpu = usage.ru_utime + usage.ru_stime
            break
        except ChildProcessError:
            status = 0
            break
        except InterruptedError:
            continue
    with contextlib.suppress(OSError):
        os.write(status_fd, f"exit {status} {cpu:.3f}\n".encode())  # the wait status and the CPU seconds it used
    os._exit(0)


def _open_fds() -> list[int]:
    try:
        return [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 256))


def _unshare() -> dict[str, Any]:
    """New network, PID, mount and IPC namespaces, as far as the kernel allows; which ones."""
    libc = _libc()
    root = os.geteuid() == 0
    wanted = {"network": CLONE_NEWNET, "pid": CLONE_NEWPID, "mount": CLONE_NEWNS, "ipc": CLONE_NEWIPC}
    spaces: dict[str, Any] = {name: False for name in wanted}
    spaces["user"] = False
    flags = sum(wanted.values())
    if not root:  # an unprivileged user may still own namespaces inside a user namespace
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER | flags) == 0:
            with contextlib.suppress(OSError):
                _write("/proc/self/setgroups", "deny")
                _write("/proc/self/uid_map", f"{uid} {uid} 1")
                _write("/proc/self/gid_map", f"{gid} {gid} 1")
            spaces.update({name: True for name in wanted}, user=True)
            return spaces
        spaces["error"] = os.strerror(ctypes.get_errno())
        return spaces
    if libc.unshare(flags) == 0:
        spaces.update({name: True for name in wanted})
        return spaces
    spaces["error"] = os.strerror(ctypes.get_errno())
    for name, flag in wanted.items():  # some may still work alone
        spaces[name] = libc.unshare(flag) == 0
    return spaces


def _without_namespaces() -> dict[str, Any]:
    """No namespaces at all: the fallback path, as on a kernel or container that allows none (tests, diagnosis)."""
    spaces: dict[str, Any] = {name: False for name in ("network", "pid", "mount", "ipc", "user")}
    spaces["error"] = f"switched off by {NO_NAMESPACES_ENV}"
    return spaces


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# -- the server -------------------------------------------------------------------------------------


def _mount_private(spaces: dict[str, Any], tmp_mb: int, records: list[str] = ()) -> None:  # type: ignore[assignment]
    """Homes and the run's records hidden, everything read-only, then a private /proc and tmpfs folders.

    Never propagated to the host's mounts. The tmpfs folders come last, so they are the
    only places a program can write, and they vanish with the worker.
    """
    libc = _libc()
    if not spaces["mount"] or libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        spaces["mount"] = False
        return
    spaces["hidden"] = _hide_homes(libc)
    spaces["records_hidden"] = _hide_records(libc, records)
    spaces["read_only"] = _read_only_everywhere(libc)
    if spaces["pid"]:
        spaces["proc"] = libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) == 0
    options = f"size={int(tmp_mb)}m,nr_inodes=4096,mode=1777".encode()
    done = []
    for folder in PRIVATE_FOLDERS:
        if os.path.isdir(folder) and not os.path.islink(folder):
            if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) == 0:
                done.append(folder)
    spaces["private_folders"] = done


def _interpreter_trees() -> set[str]:
    """The folders the worker imports from (its interpreter, its libraries, the project)."""
    return {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path)
        if p and os.path.isabs(p) and os.path.isdir(p)
    }


def _hide_records(libc: Any, records: list[str]) -> list[str]:
    """An empty folder (tmpfs) or file (``/dev/null``) over each of the run's records.

    The host names them (:func:`core.sandbox.hide_from_programs`): the MLflow store, the
    run's output folder, the LLM cache. A folder the worker imports from is never hidden.
    """
    trees = _interpreter_trees()
    done = []
    for path in records:
        real = os.path.realpath(path)
        if any(t == real or t.startswith(real.rstrip("/") + "/") for t in trees) or not os.path.lexists(real):
            continue
        if os.path.isdir(real):
            ok = libc.mount(b"tmpfs", real.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=16k,mode=0755") == 0
        else:
            ok = libc.mount(b"/dev/null", real.encode(), None, _MS_BIND, None) == 0
        if ok:
            done.append(real)
    return done


#: statvfs flags -> the mount flags a bind remount must repeat (the kernel refuses to drop locked ones)
_KEPT_FLAGS = ((2, _MS_NOSUID), (4, _MS_NODEV), (8, _MS_NOEXEC), (1024, 1024), (2048, 2048), (4096, 1 << 21))


def _read_only_everywhere(libc: Any) -> int:
    """Every mount read-only in the worker's namespace; how many were made so.

    So no folder outside the private tmpfs ones is writable, whatever its permissions say
    (world-writable folders such as ``/var/crash`` would otherwise carry files from one
    candidate to the next), and nothing of the host's can be changed.
    """
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f if len(line.split()) > 4]
    except OSError:
        return 0
    done = 0
    for raw in points:
        point = raw.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        if point == "/proc" or point.startswith("/proc/"):
            continue  # replaced by the worker's own
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            continue
        if flags & 1:
            done += 1
            continue
        kept = sum(ms for st, ms in _KEPT_FLAGS if flags & st)
        if libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept, None) == 0:
            done += 1
    return done


def _hide_homes(libc: Any) -> list[str]:
    """Empty tmpfs over the home folders; the interpreter's folders inside them are bound back read-only.

    The programs' user cannot read root's home anyway; this hides what other users left
    readable there (configuration, caches, credentials) and lets the worker import the
    standard library when the interpreter lives in a home folder.
    """
    hidden = [h for h in HIDDEN_FOLDERS if os.path.isdir(h) and not os.path.islink(h)]
    wanted = _interpreter_trees()
    keep = sorted(p for p in wanted if any(p.startswith(h + "/") for h in hidden))
    keep = [p for p in keep if not any(p != q and p.startswith(q + "/") for q in keep)]
    if any(p in hidden for p in wanted):
        return []  # the interpreter lives right at a home folder's top: leave them alone
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep}
    done = []
    for h in hidden:
        if libc.mount(b"tmpfs", h.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=0755") == 0:
            done.append(h)
    for p, fd in fds.items():
        os.makedirs(p, exist_ok=True)
        source = f"/proc/self/fd/{fd}".encode()
        if libc.mount(source, p.encode(), None, _MS_BIND | _MS_REC, None) == 0:
            libc.mount(None, p.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None)
        os.close(fd)
    return done


def mapped_bytes() -> int:
    """The address space this process has mapped so far (``VmSize``), in bytes; 0 where unknown."""
    try:
        with open("/proc/self/status") as status:
            lines = status.read().splitlines()
        for line in lines:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _set_limits(limits: Any, root: bool, backstop: float = 0.0) -> float:
    """Resource limits of the server (inherited by anything it starts); the CPU time used so far.

    ``backstop`` > 0: the host cannot raise the CPU limit later (no CAP_SYS_RESOURCE), so the
    kernel's limit sits that far above and the host holds the worker to its budget itself.
    """
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_used = used.ru_utime + used.ru_stime
    soft_cpu = int(cpu_used + limits.cpu_s) + 1
    hard_cpu = soft_cpu + 1 if root else soft_cpu + 24 * 3600  # the host raises both as the candidate trains
    if root and backstop > 0:
        soft_cpu = hard_cpu = soft_cpu + int(backstop)
    resource.setrlimit(resource.RLIMIT_CPU, (soft_cpu, hard_cpu))
    # on top of what the imports mapped: a CUDA build of torch reserves GBs of address space it never touches
    memory = mapped_bytes() + int(limits.memory_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_size = int(limits.tmp_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
    return cpu_used


#: the keyctl system call's number per machine (no keyutils library is assumed)
_KEYCTL_NR = {"x86_64": 250, "aarch64": 219}
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_CLEAR = 1, 7
_KEY_SPEC_USER_KEYRING, _KEY_SPEC_USER_SESSION_KEYRING = -4, -5


def _private_keyrings(own_uid: bool) -> bool:
    """Leave the host's kernel keyrings behind; whether it worked.

    A process keeps the session keyring it was started in, so without this every worker
    could read, change and add to the host's keys (a key one candidate added there, the next
    read back). The worker joins a new, empty session keyring of its own; with a uid of its
    own (``own_uid``) it also empties that uid's user keyrings, which a fixed ``uid`` would
    share between workers. With the host's uid they are the host's, and are left alone.
    """
    nr = _KEYCTL_NR.get(os.uname().machine)
    if nr is None:
        return False
    libc = _libc()
    if libc.syscall(ctypes.c_long(nr), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
        return False
    if own_uid:
        for ring in (_KEY_SPEC_USER_KEYRING, _KEY_SPEC_USER_SESSION_KEYRING):
            libc.syscall(ctypes.c_long(nr), ctypes.c_long(_KEYCTL_CLEAR), ctypes.c_long(ring))
    return True


# seccomp: the kernel refuses a process the system calls its filter names, whatever runs in it
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
#: per machine: the audit arch, and the numbers of socket() and connect()
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 42), "aarch64": (0xC00000B7, 198, 203)}
_X32_BIT = 0x40000000  # x86_64's x32 system calls: the same calls under other numbers


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _no_new_sockets() -> bool:
    """A seccomp filter: ``socket(AF_UNIX, ...)`` and ``connect`` fail with EACCES; whether it is in place.

    The network namespace cuts TCP, UDP and abstract Unix sockets, but not the host's
    Unix sockets on the filesystem (D-Bus, the journal, a server's control socket): a
    program could connect to any it may write to. The worker needs neither call once it
    runs (its one socket to the host is inherited), so both are refused; a datagram socket
    that would send to a path cannot be made either. Needs ``no_new_privs`` first.
    """
    arch = _SECCOMP_ARCH.get(os.uname().machine)
    if arch is None:
        return False
    audit_arch, nr_socket, nr_connect = arch
    ld_w_abs, jeq_k, jset_k, ret_k = (
        0x20,
        0x15,
        0x45,
        0x06,
    )  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, ..|BPF_JSET, BPF_RET|BPF_K
    deny = _SECCOMP_RET_ERRNO | 13  # EACCES
    program = [
        (ld_w_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq_k, 1, 0, audit_arch),  # our architecture: go on
        (ret_k, 0, 0, deny),  # any other (a 32-bit call): refused
        (ld_w_abs, 0, 0, 0),  # seccomp_data.nr
        (jset_k, 0, 1, _X32_BIT),  # an x32 call: refused
        (ret_k, 0, 0, deny),
        (jeq_k, 0, 1, nr_connect),  # connect: refused
        (ret_k, 0, 0, deny),
        (jeq_k, 0, 3, nr_socket),  # socket: look at its family
        (ld_w_abs, 0, 0, 16),  # seccomp_data.args[0], low half (the domain)
        (jeq_k, 0, 1, socket.AF_UNIX),
        (ret_k, 0, 0, deny),
        (ret_k, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    filters = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    prog = _SockFprog(len(program), filters)
    libc = _libc()
    return libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0


def _drop_privileges(uid: int, gid: int) -> None:
    """Become an unprivileged user so that RLIMIT_NPROC applies (root ignores it)."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() == 0 or os.geteuid() == 0:  # pragma: no cover - would be a kernel surprise
        raise RuntimeError("could not drop root privileges")


def _private_folder(spaces: dict[str, Any], uid: int, gid: int) -> str:
    if "/tmp" in spaces.get("private_folders", ()):
        path = "/tmp/work"
        os.makedirs(path, exist_ok=True)
    else:  # no mount namespace: a folder of its own in the host's temp folder, removed by the host
        import tempfile

        path = tempfile.mkdtemp(prefix="llm4rl-sandbox-", dir="/tmp")
    os.chown(path, uid, gid)
    os.chmod(path, 0o700)
    return path


def _serve(
    request: dict[str, Any], sock_fd: int, in_fd: int, out_fd: int, spaces: dict[str, Any], supervisor: int
) -> None:
    sock = socket.socket(fileno=sock_fd)
    limits = request["limits"]
    root = os.geteuid() == 0 and not spaces.get("user")
    uid = os.getuid()
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # process 1: reap what the program leaves
        _mount_private(spaces, limits.tmp_mb, list(request.get("records", ())))
        if root:
            uid = limits.uid if limits.uid is not None else request["uid_base"] + supervisor
        folder = _private_folder(spaces, uid, limits.gid if root else os.getgid())
        os.chdir(folder)
        os.environ.clear()
        os.environ.update(
            {
                "PATH": os.defpath,
                "HOME": folder,
                "TMPDIR": folder,
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
                "PYTHONDONTWRITEBYTECODE": "1",
            }
        )
        import tempfile

        tempfile.tempdir = folder
        cpu_used = _set_limits(limits, root, float(request.get("cpu_backstop_s", 0.0)))
        if root:
            _drop_privileges(uid, limits.gid)
        keyring = _private_keyrings(own_uid=root)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        sockets_refused = _no_new_sockets()
        in_map = mmap.mmap(in_fd, 0, prot=mmap.PROT_READ)
        out_map = mmap.mmap(out_fd, 0)
        os.close(in_fd)
        os.close(out_fd)
    except BaseException as e:  # never run a program without its limits
        _send(sock, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        os._exit(3)
    _send(
        sock,
        {
            "ready": True,
            "isolation": dict(
                spaces,
                uid=os.getuid(),
                root_dropped=root,
                keyring=keyring,
                seccomp=sockets_refused,
                folder=folder,
                cpu_base=cpu_used,
            ),
        },
    )
    Server(sock, in_map, out_map, request).run()


class Server:
    """The request loop of a worker: programs by handle, calls on shared-memory batches."""

    def __init__(self, sock: socket.socket, in_map: mmap.mmap, out_map: mmap.mmap, request: dict[str, Any]) -> None:
        import numpy
        import torch

        from core.sandbox import programs, wire

        programs._WorkerFlag.runs_programs = True
        self.np, self.tensor, self.from_numpy = (
            numpy,
            torch.Tensor,
            torch.from_numpy,
        )  # taken now: a program may poison sys.modules
        self.sb, self.wire = programs, wire
        self.sock, self.in_map, self.out_map = sock, in_map, out_map
        self.limits = request["limits"]
        self.imports = tuple(request["imports"])
        self.programs: dict[int, Any] = {}
        self.fields: dict[int, Any] = {}
        self.lanes: dict[int, _ResultLane] = {}  # per handle: where a result of the last call's layout goes
        self.call_lanes: dict[int, _CallLane] = {}  # per handle: the last call's layout, for its repeats
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    def run(self) -> None:
        last: dict[int, dict[str, Any]] = {}  # the last call request per handle
        headers: dict[int, Any] = {}  # the last result header per handle
        buf = bytearray(MAX_REQUEST)  # one buffer for every request (no megabyte allocated per call)
        view = memoryview(buf)
        fd_space = socket.CMSG_SPACE(4 * array.array("i").itemsize)
        sock, lanes, same_reply = self.sock, self.call_lanes, _SAME_REPLY.pack
        spin = 0.0
        while True:
            n = self._receive(buf, fd_space, spin) if spin else -1
            if n < 0:
                try:
                    n, ancillary, _, _ = sock.recvmsg_into([buf], fd_space)
                except OSError:
                    os._exit(0)
                if ancillary:
                    self._take_fds(ancillary)
            if not n:
                os._exit(0)  # the host closed the socket: this worker is done
            spin = 0.0
            if buf[0] == SAME:  # the same call as last time on new data: (seq, handle, spin window)
                seq, handle, spin_us = SAME_REQUEST.unpack_from(buf, 1)
                lane = lanes.get(handle)
                if lane is not None:  # a training step: the layout's work was done once
                    try:
                        program_s = lane.run(self.in_map)
                    except BaseException as e:  # every failure of a program is data
                        reply = {"report": self._failure(e, handle), "seq": seq}
                    else:
                        if program_s is not None:
                            try:
                                sock.send(same_reply(SAME, seq, program_s))
                            except BaseException:  # e.g. the program replaced socket
                                os._exit(4)
                            spin = min(spin_us, MAX_SPIN_US) * 1e-6
                            continue
                        # the value does not fit the result lane: shaped and checked the long way
                        value, lane.value = lane.value, None
                        shaped = self._reply(
                            lambda: self.finish_call(last[handle], value, lane.program_s), handle, headers, seq
                        )
                        if shaped is None:
                            continue
                        reply = shaped
                    self._send_reply(reply)
                    continue
                request = last[handle]
            else:
                request = pickle.loads(view[:n])  # from the host: trusted
                seq = request.get("seq")
                if request["op"] == "call":
                    last[request["handle"]] = request
            handle = request.get("handle")
            answer = self._reply(lambda: getattr(self, "op_" + request["op"])(request), handle, headers, seq)
            if answer is not None:
                self._send_reply(answer)

    def _receive(self, buf: bytearray, fd_space: int, spin: float) -> int:
        """Wait for the next request on a spinning CPU for up to ``spin`` seconds; its size, or -1 (then block).

        Only asked for by the host while the machine has a CPU to spare (a training step
        comes within a millisecond): the request is read without the wake-up of a
        sleeping process, on caches that are still warm.
        """
        poll, clock = self.poller.poll, time.perf_counter
        end = clock() + spin
        while not poll(0):
            if clock() > end:
                return -1
        try:
            n, ancillary, _, _ = self.sock.recvmsg_into([buf], fd_space)
        except OSError:
            os._exit(0)
        if ancillary:
            self._take_fds(ancillary)
        return n

    def _take_fds(self, ancillary: list[Any]) -> None:
        fds = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", data[: len(data) - len(data) % 4]).tolist()
        if fds:
            self._remap(fds)

    def _reply(self, work: Any, handle: Any, headers: dict[int, Any], seq: Any) -> dict[str, Any] | None:
        """Run a request; its JSON reply, or None once the short "same layout" answer went out."""
        try:
            reply = work()
            if "out" in reply and len(reply) == 3 and headers.get(handle) == (reply["out"], reply["names"]):
                # the same result layout as last time: (seq, seconds in the program)
                try:
                    self.sock.send(_SAME_REPLY.pack(SAME, seq, reply["program_s"]))
                except BaseException:  # e.g. the program replaced socket
                    os._exit(4)
                return None
            if "out" in reply:
                headers[handle] = (reply["out"], reply["names"])
        except BaseException as e:  # every failure of a program is data
            reply = {"report": self._failure(e, handle)}
        reply["seq"] = seq
        return reply

    def _failure(self, e: BaseException, handle: Any) -> dict[str, Any]:
        if isinstance(e, self.sb.SandboxError):
            return _report(e.report)
        if isinstance(e, self.sb.Invalid):
            return _report(e.report())
        compiled = self.programs.get(handle)
        filename = compiled.filename if compiled is not None else "<program>"
        return _report(self.sb.report_exception(e, filename))

    def _send_reply(self, reply: dict[str, Any]) -> None:
        try:
            self.sock.send(json.dumps(reply, default=str).encode())
        except BaseException:  # e.g. the program replaced json
            os._exit(4)

    def _remap(self, fds: list[int]) -> None:
        in_fd, out_fd = fds
        self.lanes.clear()  # their views are of the old output arena
        self.call_lanes.clear()
        for old in (self.in_map, self.out_map):
            with contextlib.suppress(BufferError):
                old.close()
        self.in_map = mmap.mmap(in_fd, 0, prot=mmap.PROT_READ)
        self.out_map = mmap.mmap(out_fd, 0)
        os.close(in_fd)
        os.close(out_fd)

    # -- requests ------------------------------------------------------------------------------
    def op_load(self, request: dict[str, Any]) -> dict[str, Any]:
        compiled = self.sb.compile_program(
            request["program"],
            allowed_imports=self.imports,
            arg_names=request.get("arg_names"),
            max_output_chars=self.limits.max_output_chars,
            static_check=self.limits.static_check,
        )
        self.programs[request["handle"]] = compiled
        self.fields[request["handle"]] = request.get("fields") or []
        return {"ok": True}

    def op_call(self, request: dict[str, Any]) -> dict[str, Any]:
        wire, sb = self.wire, self.sb
        handle = request["handle"]
        compiled = self.programs[handle]
        self.call_lanes.pop(handle, None)
        buf = wire.private_copy(self.in_map, request["end"])
        plan = request.get("plan")
        if plan is None:  # kept on the request: a repeated call ("the same as last time") reuses it
            plan = request["plan"] = wire.flat_plan(request["args"])
        args = wire.unpack_tree(request["args"], buf, arrays=True) if plan is False else wire.read_plan(plan, buf)
        split = request.get("split") or ()
        fields = self.fields[handle]
        args = tuple(
            sb.split_fields(a, fields, tensors=True) if i in split else _as_state(wire.as_tensors(a), sb.State)
            for i, a in enumerate(args)
        )
        start = time.perf_counter()
        value = compiled(*args, per_row=request["per_row"])
        program_s = time.perf_counter() - start
        batch = sb.batch_size(args) if request["role"] != "value" else 0
        reply = self.finish_call(request, value, program_s, batch)
        if plan is not False and not request.get("printed") and handle in self.lanes:
            self.call_lanes[handle] = _CallLane(compiled, request, plan, fields, self.lanes[handle], batch, self)
        return reply

    def finish_call(
        self, request: dict[str, Any], value: Any, program_s: float, batch: int | None = None
    ) -> dict[str, Any]:
        """Shape a call's value into the output arena (the long way, with every check and message); the reply."""
        sb, handle, role = self.sb, request["handle"], request["role"]
        if batch is None:
            batch = self.call_lanes[handle].batch
        lane = self.lanes.get(handle)
        if lane is not None and not request.get("printed") and lane.write(value):
            return {"out": lane.header, "names": lane.names, "program_s": program_s}
        named, names = sb.shape_result(role, value, batch)
        try:
            header = self.wire.pack_named(named, self.out_map)
        except (TypeError, ValueError) as e:
            raise sb.Invalid("dtype", f"the value cannot be used: {e}.") from None
        reply: dict[str, Any] = {"out": header, "names": names, "program_s": program_s}
        if request.get("printed"):
            reply["printed"] = self.programs[handle].printer.text[-2000:]
        elif role in ("reward", "state"):
            self.lanes[handle] = _ResultLane(role, header, names, self.out_map, self.np, self.tensor)
            call_lane = self.call_lanes.get(handle)
            if call_lane is not None:
                call_lane.result = self.lanes[handle]
        return reply

    def op_sleep(self, request: dict[str, Any]) -> dict[str, Any]:  # tests: a call that takes time
        time.sleep(float(request["seconds"]))
        return {"ok": True}


class _CallLane:
    """A call repeated on new values of the same layout (a training step): its plan made once.

    :meth:`run` copies the arguments out of the input arena into memory of the program's
    own (new every call, so that a tensor the program keeps stays as it was), names the
    fields, calls the program and hands the value to the result lane; the seconds spent in
    the program, or None when the value must go the long way (:attr:`value` holds it then).
    """

    __slots__ = (
        "compiled",
        "per_row",
        "end",
        "args",
        "batch",
        "result",
        "value",
        "program_s",
        "np",
        "from_numpy",
        "split",
        "state",
    )

    def __init__(
        self,
        compiled: Any,
        request: dict[str, Any],
        plan: list[Any],
        fields: list[Any],
        result: _ResultLane,
        batch: int,
        server: Server,
    ) -> None:
        self.compiled, self.per_row, self.end, self.batch, self.result = (
            compiled,
            request["per_row"],
            request["end"],
            batch,
            result,
        )
        np = self.np = server.np  # the server's modules, taken before any program ran
        self.from_numpy, self.split, self.state = server.from_numpy, server.sb.split_fields, server.sb.State
        self.value: Any = None
        self.program_s = 0.0
        split = request.get("split") or ()
        self.args = [
            (np.dtype(dtype), count, offset, shape, self._naming(fields, shape) if i in split else None)
            for i, (dtype, count, offset, shape) in enumerate(plan)
        ]

    @staticmethod
    def _naming(fields: list[Any], shape: tuple[int, ...]) -> Any:
        """How to name an observation's fields: their names (one ``unbind`` when each is one
        column, in order) or the fields."""
        columns = all(stop - start == 1 and not fshape for _, start, stop, fshape in fields)
        if (
            columns
            and [start for _, start, _, _ in fields] == list(range(len(fields)))
            and shape
            and shape[-1] == len(fields)
        ):
            return tuple(name for name, _, _, _ in fields)
        return list(fields)

    def run(self, in_map: mmap.mmap) -> float | None:
        with memoryview(in_map) as view:
            buf = bytearray(view[: self.end])
        frombuffer, from_numpy = self.np.frombuffer, self.from_numpy
        args = []
        for dtype, count, offset, shape, naming in self.args:
            arr = frombuffer(buf, dtype, count, offset).reshape(shape)
            if naming is None:
                args.append(from_numpy(arr))
            elif type(naming) is tuple:
                args.append(self.state(zip(naming, from_numpy(arr).unbind(-1))))
            else:
                args.append(self.split(arr, naming, tensors=True))
        start = time.perf_counter()
        value = self.compiled(*args, per_row=self.per_row)
        program_s = time.perf_counter() - start
        if self.result.write(value):
            return program_s
        self.value, self.program_s = value, program_s
        return None


class _ResultLane:
    """Where a result of the last call's layout goes: a view of the output arena, made once.

    ``write`` takes only what :func:`core.sandbox.programs.shape_result` would pass
    unchanged (plain float32 CPU tensors of the same shapes, the same component names)
    and copies it straight into place; anything else goes the long way, with its checks
    and messages. The host checks its copy either way.
    """

    __slots__ = ("role", "header", "names", "keys", "rows", "block", "tensor")

    def __init__(
        self, role: str, header: list[Any], names: list[str], out_map: mmap.mmap, np: Any, tensor: type
    ) -> None:
        self.tensor = tensor
        self.role, self.header, self.names, self.keys = role, header, names, tuple(names)
        ((_, _, shape, offset),) = header
        self.block = np.ndarray(tuple(shape), np.float32, buffer=out_map, offset=offset)
        self.rows = tuple(shape) if role == "state" else (shape[1],)

    def write(self, value: Any) -> bool:
        if self.role == "state":
            parts = [value]
        elif type(value) is tuple:
            if len(value) != 2 or type(value[1]) is not dict or tuple(value[1]) != self.keys:
                return False
            parts = [value[0], *value[1].values()]
        elif self.keys:
            return False
        else:
            parts = [value]
        tensor = self.tensor
        if any(type(p) is not tensor for p in parts):
            return False
        try:
            arrays = [p.numpy() for p in parts]  # a plain CPU tensor (raises for grad, other devices)
        except (RuntimeError, TypeError):
            return False
        rows = self.rows
        for arr in arrays:
            if arr.shape != rows or arr.dtype.char != "f":
                return False
        if self.role == "state":
            self.block[...] = arrays[0]
        else:
            for i, arr in enumerate(arrays):
                self.block[i] = arr
        return True


def _as_state(arg: Any, state: type) -> Any:
    """A dict argument (a state the host named) as the program's :class:`~core.sandbox.programs.State`."""
    return state(arg) if type(arg) is dict else arg


def _report(report: Any) -> dict[str, Any]:
    return {
        "ok": bool(report.ok),
        "kind": report.kind,
        "message": report.message,
        "detail": report.detail[-4000:],
        "data": report.data,
    }


if __name__ == "__main__":
    zygote(int(sys.argv[1]))
