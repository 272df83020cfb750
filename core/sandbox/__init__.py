"""The sandbox for LLM-written code: a static filter, then a worker process per candidate.

- :mod:`core.sandbox.policy`: the AST allow-list (the first, cheap filter).
- :mod:`core.sandbox.reports`: reports, failure categories, :class:`Limits` (the run's
  ``sandbox:`` config: :class:`core.config.SandboxConfig` is this class).
- :mod:`core.sandbox.programs`: checking and compiling programs (compiling only in a
  worker), and what their values must look like.
- :mod:`core.sandbox.host`: :class:`ProgramWorker`, the host's handle on a worker, with
  deadlines and the time budget.
- :mod:`core.sandbox.worker`: the zygote and the worker processes (namespaces, limits,
  an unprivileged user).
- :mod:`core.sandbox.wire`: batches and results in shared memory.
- :mod:`core.sandbox.functions`: reward and state programs as callables for the trainer.

The reports and limits load with the package (no torch: the config schema is
:class:`Limits`); every other name loads its module on first use.

See ``docs/sandbox.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from core.sandbox.reports import CATEGORIES, DEFAULT_IMPORTS, KINDS, Limits, SandboxError, SandboxReport

#: name -> the module that defines it, imported on first access (they import torch)
_LAZY = {
    **dict.fromkeys(
        (
            "RewardFunction",
            "StateFunction",
            "prepare_reward",
            "prepare_state",
            "probe",
            "probe_batch",
            "role_of",
            "run_isolated",
        ),
        "core.sandbox.functions",
    ),
    **dict.fromkeys(
        (
            "UID_BASE",
            "ProgramWorker",
            "Zygote",
            "candidate_scope",
            "hidden_records",
            "hide_from_programs",
            "in_candidate_scope",
        ),
        "core.sandbox.host",
    ),
    **dict.fromkeys(
        (
            "PER_ROW_RETRY_KINDS",
            "REWARD_ARGS",
            "STATE_ARGS",
            "CompiledProgram",
            "Invalid",
            "OutputLimit",
            "batch_size",
            "call_per_row",
            "check_source",
            "compile_program",
            "normalize_reward",
            "normalize_state",
            "normalize_value",
            "report_exception",
            "split_fields",
            "task_fields",
            "validate_reward",
            "validate_state",
        ),
        "core.sandbox.programs",
    ),
}
_RENAMED = {"ALLOWED_SUBMODULES_TO_PRELOAD": ("core.sandbox.worker", "PRELOAD")}

__all__ = ["CATEGORIES", "DEFAULT_IMPORTS", "KINDS", "Limits", "SandboxError", "SandboxReport", *_LAZY, *_RENAMED]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name], name
    elif name in _RENAMED:
        module, attr = _RENAMED[name]
    else:
        raise AttributeError(f"module 'core.sandbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover - what the lazy names are, for type checkers
    from core.sandbox.functions import (
        RewardFunction as RewardFunction,
        StateFunction as StateFunction,
        prepare_reward as prepare_reward,
        prepare_state as prepare_state,
        probe as probe,
        probe_batch as probe_batch,
        role_of as role_of,
        run_isolated as run_isolated,
    )
    from core.sandbox.host import (
        UID_BASE as UID_BASE,
        ProgramWorker as ProgramWorker,
        Zygote as Zygote,
        candidate_scope as candidate_scope,
        hidden_records as hidden_records,
        hide_from_programs as hide_from_programs,
        in_candidate_scope as in_candidate_scope,
    )
    from core.sandbox.programs import (
        PER_ROW_RETRY_KINDS as PER_ROW_RETRY_KINDS,
        REWARD_ARGS as REWARD_ARGS,
        STATE_ARGS as STATE_ARGS,
        CompiledProgram as CompiledProgram,
        Invalid as Invalid,
        OutputLimit as OutputLimit,
        batch_size as batch_size,
        call_per_row as call_per_row,
        check_source as check_source,
        compile_program as compile_program,
        normalize_reward as normalize_reward,
        normalize_state as normalize_state,
        normalize_value as normalize_value,
        report_exception as report_exception,
        split_fields as split_fields,
        task_fields as task_fields,
        validate_reward as validate_reward,
        validate_state as validate_state,
    )
    from core.sandbox.worker import PRELOAD as ALLOWED_SUBMODULES_TO_PRELOAD  # noqa: F401 - in __all__ through _RENAMED
