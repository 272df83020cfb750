"""The sandbox for LLM-written code: static policy, restricted namespace, isolated worker.

- :mod:`core.sandbox.policy`: the AST allow-list (the first, cheap filter).
- :mod:`core.sandbox.programs`: compiling, probing and calling programs, the reports.
- :mod:`core.sandbox.worker`: the child process that runs a program under OS limits.
"""

from core.sandbox.programs import (  # noqa: F401
    DEFAULT_IMPORTS,
    KINDS,
    REWARD_ARGS,
    STATE_ARGS,
    PER_ROW_RETRY_KINDS,
    ALLOWED_SUBMODULES_TO_PRELOAD,
    SandboxReport,
    SandboxError,
    Limits,
    settings_from_config,
    CallTimeout,
    OutputLimit,
    check_source,
    call_deadline,
    CompiledProgram,
    compile_program,
    report_exception,
    call_per_row,
    normalize_reward,
    normalize_state,
    validate_reward,
    validate_state,
    run_isolated,
    report_to_json,
    probe_batch,
    RewardFunction,
    StateFunction,
    prepare_reward,
    prepare_state,
)
