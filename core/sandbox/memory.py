"""Memory bounded per worker, not per process.

``RLIMIT_AS`` bounds each process of a worker on its own, so a program that forks (or
fills its tmpfs folders) could use ``max_procs`` times ``memory_mb`` and more. Where the
machine lets this process make memory cgroups (cgroup v2 with the memory controller
delegated, or cgroup v1's memory hierarchy), each worker gets a group of its own with
``memory_mb`` of resident memory for all its processes and the files it writes in its
tmpfs folders together; the kernel stops the worker when it goes over (the host reads the
group's OOM count and reports ``memory``).

Where it cannot, :func:`resident_bytes` is the host's fallback, checked once a second as
calls come (like the CPU budget): the memory the worker's processes have written
themselves (private dirty pages: the zygote's imports they share do not count) plus what
their tmpfs folders hold.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

#: set to 1 in the host's environment to use the host-side check even where cgroups work (tests)
NO_GROUP_ENV = "LLM4RL_SANDBOX_NO_MEMORY_GROUP"
_PREFIX = "llm4rl-"
_counter = itertools.count()
_stale: list[Path] = []  # groups whose removal failed (a process was still leaving); retried later
_swept: set[Path] = set()  # parents already cleared of dead hosts' groups by this process


@dataclass(frozen=True)
class MemoryGroup:
    path: Path
    version: int  # 1 or 2

    def oom_kills(self) -> int:
        """How many times the kernel killed a process of the group for going over its limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        if self.version == 1:  # kernels before 4.13 say only that the limit was hit
            with contextlib.suppress(OSError, ValueError):
                return int((self.path / "memory.failcnt").read_text()) and 1
        return 0

    def remove(self, wait_s: float = 0.5) -> None:
        """Remove the group once its processes are gone (they are killed before this)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() >= deadline:
                    _stale.append(self.path)
                    return
                time.sleep(0.02)


def _own_groups() -> list[tuple[int, Path]]:
    """(version, folder) of this process's memory cgroups, where cgroupfs is mounted."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        membership = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[int, Path]] = []
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            wanted = next((m.split(":", 2)[2] for m in membership if m.startswith("0::")), None)
            version = 2
        elif fstype == "cgroup" and "memory" in options:
            wanted = next((m.split(":", 2)[2] for m in membership if "memory" in m.split(":", 2)[1].split(",")), None)
            version = 1
        else:
            continue
        if wanted is None or not (wanted == root or wanted.startswith(root.rstrip("/") + "/") or root == "/"):
            continue
        inside = wanted[len(root) :] if root != "/" else wanted
        found.append((version, Path(point.replace("\\040", " ")) / inside.lstrip("/")))
    return sorted(found, key=lambda f: f[0], reverse=True)  # v2 first


def _sweep(parent: Path) -> None:
    """Our own groups that could not be removed at once, and (once per parent) those of host processes that are gone."""
    for path in list(_stale):
        with contextlib.suppress(OSError):
            os.rmdir(path)
            _stale.remove(path)
    if parent in _swept:
        return
    _swept.add(parent)
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            owner = entry.name[len(_PREFIX) :].split("-")[0] if entry.name.startswith(_PREFIX) else ""
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    entry.rmdir()  # fails while a process is still in it


def create(limit_bytes: int) -> MemoryGroup | None:
    """A new memory group under this process's own with ``limit_bytes`` of memory; None where not allowed.

    The caller puts the worker in it (:func:`join`) and removes it after the worker ends.
    """
    if os.environ.get(NO_GROUP_ENV, "") not in ("", "0"):
        return None
    for version, parent in _own_groups():
        _sweep(parent)
        path = parent / f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            if version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):  # no swap either, where the kernel accounts it
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            return MemoryGroup(path, version)
        except OSError:  # the controller is not delegated to us here
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


def join(path: str) -> bool:
    """Put the calling process (and so everything it starts) in the group at ``path``."""
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return True
    except OSError:
        return False


def _private_dirty(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Private_Dirty:"))
    except (OSError, ValueError, IndexError):
        return 0


def resident_bytes(server: int, folders: tuple[str, ...] | list[str]) -> int:
    """The host's fallback measure: memory the worker wrote itself, all its processes, plus its tmpfs files.

    The worker's processes are those in the server's PID namespace (the server is its
    process 1), or, without one, the server alone. ``folders`` are the worker's private
    tmpfs folders, seen through ``/proc/<server>/root``.
    """
    try:
        space = os.readlink(f"/proc/{server}/ns/pid")
    except OSError:
        return 0
    total = 0
    host_space = os.readlink("/proc/self/ns/pid")
    for entry in os.listdir("/proc") if space != host_space else [str(server)]:
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/pid") == space:
                    total += _private_dirty(int(entry))
    for folder in folders:
        with contextlib.suppress(OSError):
            st = os.statvfs(f"/proc/{server}/root{folder}")
            total += (st.f_blocks - st.f_bfree) * st.f_frsize
    return total
