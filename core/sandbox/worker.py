"""The child process of :func:`core.sandbox.run_isolated` (``python -m core.sandbox.worker``).

Order matters: read the request, import and warm up everything trusted (torch, numpy,
the allowed submodules), then set resource limits, drop root privileges, and only then
run the program's module body and its entry function. The one line of JSON written to
the original stdout is the only thing the parent reads; everything else (stray writes
to fd 1 or 2) goes to ``/dev/null``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import resource
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38


def _prctl(option: int, value: int) -> None:
    """Best effort: Linux only; failure leaves the other layers in place."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _set_limits(limits: Any) -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_used = used.ru_utime + used.ru_stime  # start-up time does not count against the program
    soft_cpu = int(cpu_used + limits.cpu_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft_cpu, soft_cpu + 1))
    memory = int(limits.memory_mb) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))


def _drop_privileges(uid: int, gid: int) -> None:
    """Become an unprivileged user so that RLIMIT_NPROC applies (root ignores it)."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.getuid() == 0 or os.geteuid() == 0:  # pragma: no cover - would be a kernel surprise
            raise RuntimeError("could not drop root privileges")
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _prctl(_PR_SET_PDEATHSIG, 9)  # die with the parent (credentials changes clear it: set after)


def main() -> None:
    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    out = os.fdopen(result_fd, "w")

    request = pickle.loads(sys.stdin.buffer.read())  # from the parent: trusted
    os.dup2(devnull, 0)
    os.close(devnull)

    import torch

    from core.sandbox import programs as sb

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    for module in sb.ALLOWED_SUBMODULES_TO_PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    (torch.ones(2) + 1).sum().item()  # warm up lazily created state before the limits

    program = request["program"]
    limits = request["limits"]
    args = request["args"]
    validate = request["validate"]

    def send(report: Any) -> None:
        out.write(sb.report_to_json(report)[:1_000_000] + "\n")
        out.flush()

    try:
        _set_limits(limits)
        _drop_privileges(limits.uid, limits.gid)
    except Exception as e:  # noqa: BLE001 - never run the program without its limits
        send(sb.SandboxReport(False, "crash", f"sandbox setup failed: {type(e).__name__}: {e}"))
        os._exit(3)

    try:
        compiled = sb.compile_program(
            program,
            allowed_imports=request["allowed_imports"],
            max_output_chars=limits.max_output_chars,
            timeout_s=limits.call_timeout_s,
            _skip_check=request["skip_check"],
        )
        report = _probe(sb, compiled, args, validate, limits, per_row=False)
        if not report.ok and report.kind in sb.PER_ROW_RETRY_KINDS and request.get("per_row_retry"):
            # written for one state rather than a batch? mapped over the rows, it may work
            per_row = _probe(sb, compiled, args, validate, limits, per_row=True)
            if per_row.ok:
                per_row.data["per_row"] = True
                per_row.detail = (f"the batched call failed ({report.message.splitlines()[-1][:200]}); "
                                  f"called once per state instead\n{per_row.detail}").strip()
                report = per_row
    except sb.SandboxError as e:
        report = e.report
    except BaseException as e:  # noqa: BLE001 - every failure is data
        report = sb.report_exception(e, f"<{program.entry}>")
    try:
        send(report)
    except BaseException:  # noqa: BLE001
        os._exit(4)
    os._exit(0)  # skip interpreter teardown (torch atexit hooks, the program's objects)


def _probe(sb: Any, compiled: Any, args: tuple[Any, ...], validate: Any, limits: Any, *, per_row: bool) -> Any:
    """Call the program on the probe batch (or row by row) and validate what it returned."""
    try:
        result = compiled(*args, timeout_s=limits.call_timeout_s, per_row=per_row)
        report = validate(result, args) if validate is not None else None
    except sb.SandboxError as e:
        return e.report
    except sb._Invalid as e:
        return sb._fail(e.kind, str(e))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - every failure is data
        return sb.report_exception(e, f"<{compiled.program.entry}>")
    report = report or sb.SandboxReport(True, "ok", "")
    report.detail = (report.detail + ("\n[stdout]\n" + compiled.printer.text[-2000:] if compiled.printer.text else "")).strip()
    return report


if __name__ == "__main__":
    main()
