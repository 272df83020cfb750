"""The sandbox for LLM-written code: a static filter, then a worker process per candidate.

- :mod:`core.sandbox.policy`: the AST allow-list (the first, cheap filter).
- :mod:`core.sandbox.reports`: reports, failure categories, :class:`Limits`.
- :mod:`core.sandbox.programs`: checking and compiling programs (compiling only in a
  worker), and what their values must look like.
- :mod:`core.sandbox.host`: :class:`ProgramWorker`, the host's handle on a worker, with
  deadlines and the time budget.
- :mod:`core.sandbox.worker`: the zygote and the worker processes (namespaces, limits,
  an unprivileged user).
- :mod:`core.sandbox.wire`: batches and results in shared memory.
- :mod:`core.sandbox.functions`: reward and state programs as callables for the trainer.

See ``docs/sandbox.md``.
"""

from core.sandbox.functions import (  # noqa: F401
    RewardFunction,
    StateFunction,
    prepare_reward,
    prepare_state,
    probe,
    probe_batch,
    role_of,
    run_isolated,
)
from core.sandbox.host import (  # noqa: F401
    UID_BASE,
    ProgramWorker,
    Zygote,
    candidate_scope,
    hidden_records,
    hide_from_programs,
    in_candidate_scope,
)
from core.sandbox.programs import (  # noqa: F401
    PER_ROW_RETRY_KINDS,
    REWARD_ARGS,
    STATE_ARGS,
    CompiledProgram,
    Invalid,
    OutputLimit,
    batch_size,
    call_per_row,
    check_source,
    compile_program,
    normalize_reward,
    normalize_state,
    normalize_value,
    report_exception,
    split_fields,
    task_fields,
    validate_reward,
    validate_state,
)
from core.sandbox.reports import (  # noqa: F401
    CATEGORIES,
    DEFAULT_IMPORTS,
    KINDS,
    Limits,
    SandboxError,
    SandboxReport,
    settings_from_config,
)
from core.sandbox.worker import PRELOAD as ALLOWED_SUBMODULES_TO_PRELOAD  # noqa: F401
