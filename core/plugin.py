"""The plugin API: the one module a plugin imports from the framework.

``from core.plugin import hookimpl, PluginConfig, RewardProgram, ...``. Everything else
under ``core`` is the framework's machinery and may change without notice; what is here
is the surface plugins are written against, and ``tests/core/test_plugin_api.py`` fails
when it changes unannounced. The contract (:mod:`core.testing.contract`) refuses any
other ``core`` import in a plugin (``from core import hookimpl, PluginConfig`` still works).

The groups:

- **Hooks and config**: the marker for hook implementations, the base of a plugin's
  ``Config`` dataclass, and the typed ``sandbox:`` limits a context carries.
- **Contexts**: what hooks receive (``run``, ``train``, ``batch``) and what
  ``action_prior`` returns.
- **Records**: what a plugin proposes (programs, macros, env configs, plans) and what
  it reads back (candidates, results, fitness).
- **The task**: the environment as the framework describes it, its trajectories, and
  stepping its vector env with the true last observation of each episode.
- **Errors**: a mistake the user must fix, an LLM that cannot answer, a program the
  sandbox refused.
- **LLM code**: code out of a reply, checked before anything runs (the names it reads,
  the builtins a program may call).
- **Prompting**: the calling convention of programs with the shapes of a real batch,
  shared prompt text, request options for code, short summaries of results.
- **The LLM in the background**: loading the model before training, a worker thread
  for calls during training, a blocking phase of batched calls.
- **Plans and goals**: the task's goals, matching text to them, following a plan.
- **The sandbox**: running an LLM-written program in a worker process and checking
  what it returns.
- **Training pieces**: macro-actions as extra discrete actions; population training
  (candidates trained jointly, one SAC agent each over one shared replay).
- **Progress**: a progress bar that respects the run's ``progress`` setting.

This module imports eagerly (torch included); ``core`` itself stays light.
"""

# --- hooks and config ----------------------------------------------------------------
from core import PluginConfig, hookimpl
from core.config import SandboxConfig
from core.hookspecs import hookspec

# --- contexts ------------------------------------------------------------------------
from core.context import ActionPrior, RunContext, StepBatch, TrainContext

# --- records -------------------------------------------------------------------------
from core.records import (
    Candidate,
    EnvConfig,
    Fitness,
    IterationResult,
    MacroAction,
    Plan,
    PlanStep,
    Program,
    RewardProgram,
    StartPolicy,
    StateProgram,
    TrainResult,
)

# --- the task ------------------------------------------------------------------------
from core.envs.task import Task, Trajectory, VectorStep, task_steps

# --- errors --------------------------------------------------------------------------
from core.errors import UserError
from core.llm.errors import LLMError
from core.sandbox import SandboxError

# --- LLM code ------------------------------------------------------------------------
from core.codegen import extract_code, extract_function, program_from_reply, without_prelude
from core.namecheck import check_names, state_arguments
from core.sandbox.policy import SAFE_BUILTIN_NAMES

# --- prompting -----------------------------------------------------------------------
from core.prompting import (
    Shapes,
    action_text,
    batch_shapes,
    candidate_line,
    code_options,
    fence,
    field_bindings,
    fields_text,
    interface_of,
    program_fields,
    repair_messages,
    reply_counts,
    reward_interface,
    sample_evenly,
    sign_rule,
    state_interface,
    summarize_series,
    task_description,
)

# --- the LLM in the background -------------------------------------------------------
from core.llm.background import BackgroundCalls, ask_in_batches, warm_up

# --- plans and goals -----------------------------------------------------------------
from core.plan import PlanFollower, check_plan, goal_names, match_goal, newly_achieved

# --- the sandbox ---------------------------------------------------------------------
from core.sandbox import (
    SandboxReport,
    normalize_reward,
    prepare_reward,
    prepare_state,
    probe_batch,
    run_isolated,
    validate_state,
)

# --- training pieces -----------------------------------------------------------------
from core.train.macros import MacroSet
from core.train.population import Member, Population, population_settings

# --- progress ------------------------------------------------------------------------
from core.progress import make_progress

__all__ = [
    # hooks and config
    "hookimpl",
    "hookspec",
    "PluginConfig",
    "SandboxConfig",
    # contexts
    "RunContext",
    "TrainContext",
    "StepBatch",
    "ActionPrior",
    # records
    "Program",
    "RewardProgram",
    "StateProgram",
    "MacroAction",
    "EnvConfig",
    "StartPolicy",
    "Plan",
    "PlanStep",
    "Candidate",
    "Fitness",
    "TrainResult",
    "IterationResult",
    # the task
    "Task",
    "Trajectory",
    "VectorStep",
    "task_steps",
    # errors
    "UserError",
    "LLMError",
    "SandboxError",
    # LLM code
    "extract_code",
    "extract_function",
    "program_from_reply",
    "without_prelude",
    "check_names",
    "state_arguments",
    "SAFE_BUILTIN_NAMES",
    # prompting
    "Shapes",
    "batch_shapes",
    "action_text",
    "fields_text",
    "field_bindings",
    "program_fields",
    "sign_rule",
    "task_description",
    "reward_interface",
    "state_interface",
    "interface_of",
    "code_options",
    "repair_messages",
    "fence",
    "reply_counts",
    "candidate_line",
    "summarize_series",
    "sample_evenly",
    # the LLM in the background
    "warm_up",
    "BackgroundCalls",
    "ask_in_batches",
    # plans and goals
    "goal_names",
    "match_goal",
    "newly_achieved",
    "check_plan",
    "PlanFollower",
    # the sandbox
    "prepare_reward",
    "prepare_state",
    "probe_batch",
    "run_isolated",
    "validate_state",
    "normalize_reward",
    "SandboxReport",
    # training pieces
    "MacroSet",
    "Population",
    "Member",
    "population_settings",
    # progress
    "make_progress",
]
