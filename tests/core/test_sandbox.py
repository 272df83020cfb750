"""The sandbox: hostile and broken programs are contained and reported by kind."""

from __future__ import annotations

import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import sandbox_programs as P
from core.records import RewardProgram, StateProgram
from core.sandbox import (
    Limits,
    SandboxError,
    check_source,
    compile_program,
    prepare_reward,
    prepare_state,
    run_isolated,
    validate_reward,
)

REWARD_ARGS = ["state", "action", "next_state"]
FAST = Limits(wall_s=15, cpu_s=5, call_timeout_s=1.0, memory_mb=2048)
TASK = P.CartPoleTask()


def _args(batch: int = 6) -> tuple:
    g = torch.Generator().manual_seed(0)
    state = {f.name: torch.randn(batch, generator=g) for f in TASK.state_fields}
    nxt = {k: v + 0.01 for k, v in state.items()}
    return state, torch.randint(0, 2, (batch,), generator=g), nxt


def _nobody_procs() -> int:
    """Processes of the sandbox user now alive (zombies awaiting reaping included)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += os.stat(f"/proc/{pid}").st_uid == Limits().uid
            except FileNotFoundError:
                pass
    return n


def _wait_no_sandbox_procs(timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _nobody_procs() and time.monotonic() < deadline:
        time.sleep(0.1)
    return _nobody_procs()


# -- static check: every escape is refused before anything runs ----------------------------


@pytest.mark.parametrize("name", sorted(P.FORBIDDEN))
def test_escape_is_forbidden_statically(name: str) -> None:
    report = check_source(P.FORBIDDEN[name], "compute_reward", arg_names=REWARD_ARGS)
    assert not report.ok
    assert report.kind == "forbidden", (name, report)
    assert "line" in report.message


def test_forbidden_programs_never_run_even_in_the_isolated_runner() -> None:
    report = run_isolated(RewardProgram(P.FORK_BOMB_OS), _args(), limits=FAST)
    assert report.kind == "forbidden"
    with pytest.raises(SandboxError) as err:
        compile_program(RewardProgram(P.OPEN_PASSWD))
    assert err.value.report.kind == "forbidden" and "open" in err.value.report.message


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        (P.SYNTAX_ERROR, "syntax"),
        (P.WRONG_SIGNATURE, "signature"),
        (P.MISSING_ENTRY, "signature"),
        ("", "no_code"),
        ("   \n", "no_code"),
    ],
)
def test_broken_source_is_reported(source: str, kind: str) -> None:
    report = check_source(source, "compute_reward", arg_names=REWARD_ARGS)
    assert (report.ok, report.kind) == (False, kind)
    assert report.message


def test_allowed_program_passes_the_check() -> None:
    assert check_source(P.REWARD_OK, "compute_reward", arg_names=REWARD_ARGS).ok
    assert check_source(P.STATE_OK, "revise_state", arg_names=["state"]).ok


def test_allowed_imports_are_configurable() -> None:
    report = check_source(P.REWARD_OK, "compute_reward", allowed_imports=("math", "torch"))
    assert report.kind == "forbidden" and "numpy" in report.message


def test_restricted_namespace_has_no_open_or_import_escape() -> None:
    fn = compile_program(RewardProgram("def compute_reward(s, a, n):\n    return abs(-2) + max(1, 3)"))
    assert fn(None, None, None) == 5
    assert "open" not in fn.fn.__globals__["__builtins__"]
    with pytest.raises(ImportError):
        fn.fn.__globals__["__builtins__"]["__import__"]("os")


# -- isolated runs: real child processes under limits ---------------------------------------

RUNTIME_CASES = {
    "INFINITE_LOOP": (P.INFINITE_LOOP, "timeout"),
    "RECURSION_BOMB": (P.RECURSION_BOMB, "exception"),
    "RUNTIME_ALLOC": (P.RUNTIME_ALLOC, "memory"),
    "RUNTIME_LIST_ALLOC": (P.RUNTIME_LIST_ALLOC, "memory"),
    "RAISES_KEYERROR": (P.RAISES_KEYERROR, "exception"),
    "RETURNS_NAN": (P.RETURNS_NAN, "nonfinite"),
    "WRONG_SHAPE": (P.WRONG_SHAPE, "shape"),
    "STDOUT_FLOOD": (P.STDOUT_FLOOD, "output"),
}
#: Programs run with the test-only `_skip_check=True`: the process limits alone must hold.
BYPASS_CASES = {
    "BYPASS_WHOAMI": P.BYPASS_WHOAMI,
    "BYPASS_WRITE_FILE": P.BYPASS_WRITE_FILE,
    "BYPASS_MEMORY": P.BYPASS_MEMORY,
}
_PROBE_FILE = "/tmp/llm4rl-sandbox-probe.txt"


@pytest.fixture(scope="module")
def runtime_reports() -> dict:
    """Every isolated case in its own child, two at a time (each child starts torch)."""
    args = _args()
    jobs = [(name, source, False) for name, (source, _) in RUNTIME_CASES.items()]
    jobs += [(name, source, True) for name, source in BYPASS_CASES.items()]

    def run(job):
        name, source, bypass = job
        return name, run_isolated(RewardProgram(source), args, limits=FAST, validate=validate_reward, _skip_check=bypass)

    try:
        with ThreadPoolExecutor(2) as pool:
            reports = dict(pool.map(run, jobs))
        reports["probe_file_size"] = os.path.getsize(_PROBE_FILE) if os.path.exists(_PROBE_FILE) else 0
    finally:
        if os.path.exists(_PROBE_FILE):
            os.remove(_PROBE_FILE)
    return reports


@pytest.mark.parametrize("name", sorted(RUNTIME_CASES))
def test_isolated_run_reports_kind(name: str, runtime_reports: dict) -> None:
    report = runtime_reports[name]
    assert report.kind == RUNTIME_CASES[name][1], (name, report)
    assert not report.ok and report.message and len(report.message) <= 1500


def test_isolated_exception_feedback_has_the_traceback(runtime_reports: dict) -> None:
    message = runtime_reports["RAISES_KEYERROR"].message
    assert "Traceback" in message and "line 2" in message
    assert "s['pole_velocity']" in message and "KeyError: 'pole_velocity'" in message


def test_child_runs_unprivileged(runtime_reports: dict) -> None:
    assert f"uid={Limits().uid} euid={Limits().uid}" in runtime_reports["BYPASS_WHOAMI"].message


def test_file_writes_are_blocked_when_the_check_is_bypassed(runtime_reports: dict) -> None:
    report = runtime_reports["BYPASS_WRITE_FILE"]
    assert not report.ok and "wrote" not in report.message.splitlines()[-1]
    assert runtime_reports["probe_file_size"] == 0


def test_memory_limit_holds_when_the_check_is_bypassed(runtime_reports: dict) -> None:
    assert runtime_reports["BYPASS_MEMORY"].kind == "memory"


def test_process_limit_holds_when_the_check_is_bypassed() -> None:
    """The safe containment test: 20 forks under a limit of 5 must mostly fail."""
    before = len(os.listdir("/proc"))
    assert _wait_no_sandbox_procs() == 0
    report = run_isolated(RewardProgram(P.BYPASS_FORK_20), _args(), limits=Limits(max_procs=5, wall_s=15), _skip_check=True)
    assert report.kind == "exception", report
    last = report.message.splitlines()[-1]  # "RuntimeError: made=4 errors=16"
    made = int(last.split("made=")[1].split()[0])
    assert made < 5 and "errors=" in last
    assert _wait_no_sandbox_procs() == 0
    # machine-wide sanity (other work on the machine comes and goes, hence the slack)
    assert len(os.listdir("/proc")) < before + 50


def test_fork_bomb_is_contained_when_the_check_is_bypassed() -> None:
    """Run only after the safe test above; limited to 5 processes and a few seconds."""
    limits = Limits(max_procs=5, wall_s=4, call_timeout_s=1.0, cpu_s=3)
    for source in (P.BYPASS_FORK_BOMB, P.BYPASS_MULTIPROCESSING_BOMB):
        start = time.monotonic()
        report = run_isolated(RewardProgram(source), _args(), limits=limits, _skip_check=True)
        assert not report.ok and report.kind in ("timeout", "exception"), report
        assert time.monotonic() - start < limits.wall_s + 3
        last = report.message.splitlines()[-1]
        if "started=" in last:
            assert int(last.split("started=")[1].split()[0]) < limits.max_procs
        assert _wait_no_sandbox_procs() == 0


# -- probed reward/state functions on a real task ------------------------------------------


@pytest.fixture(scope="module")
def reward_fn():
    return prepare_reward(RewardProgram(P.REWARD_OK), TASK, limits=FAST)


def test_prepare_reward_returns_a_batched_float_reward(reward_fn) -> None:
    state, action, nxt = _args(8)
    reward, comps = reward_fn(state, action, nxt)
    assert reward.shape == (8,) and reward.dtype == torch.float32
    assert set(comps) == {"upright", "centered"} and comps["upright"].shape == (8,)
    assert reward_fn.component_names == ("centered", "upright")  # learned by the isolated probe


def test_reward_function_pickles_by_recompiling(reward_fn) -> None:
    clone = pickle.loads(pickle.dumps(reward_fn))
    args = _args(3)
    assert torch.equal(clone(*args)[0], reward_fn(*args)[0])


def test_prepare_state_finds_the_feature_width() -> None:
    program = StateProgram(P.STATE_OK)
    fn = prepare_state(program, TASK, limits=FAST)
    feats = fn(_args(5)[0])
    assert fn.extra_dim == 3 == program.extra_dim and feats.shape == (5, 3) and feats.dtype == torch.float32


def test_prepare_reward_raises_the_probe_report() -> None:
    with pytest.raises(SandboxError) as err:
        prepare_reward(RewardProgram(P.RAISES_ZERODIVISION.replace("/ 0", "/ s['no_such_field']")), TASK, limits=FAST)
    assert err.value.report.kind == "exception" and "no_such_field" in err.value.report.message
    with pytest.raises(SandboxError) as err:
        prepare_reward(RewardProgram(P.IMPORT_OS), TASK, limits=FAST)
    assert err.value.report.kind == "forbidden"


# -- per-step in-process calls: the same checks, and a timer ----------------------------------


def _inprocess(source: str, timeout: float = 0.3):
    from core.sandbox import RewardFunction

    return RewardFunction(compile_program(RewardProgram(source), timeout_s=timeout), call_timeout_s=timeout)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("SLOW_CODE", "timeout"),
        ("INFINITE_LOOP", "timeout"),
        ("RECURSION_BOMB", "exception"),
        ("RAISES_ZERODIVISION", "exception"),
        ("RETURNS_NAN", "nonfinite"),
        ("RETURNS_INF", "nonfinite"),
        ("NAN_COMPONENT", "nonfinite"),
        ("WRONG_SHAPE", "shape"),
        ("SCALAR_REWARD", "dtype"),
        ("WRONG_DTYPE", "dtype"),
        ("RETURNS_NONE", "dtype"),
        ("STDOUT_FLOOD", "output"),
    ],
)
def test_in_process_call_failures_raise_sandbox_error(name: str, kind: str) -> None:
    fn = _inprocess(getattr(P, name))
    start = time.monotonic()
    with pytest.raises(SandboxError) as err:
        fn(*_args())
    assert err.value.report.kind == kind, err.value.report
    assert time.monotonic() - start < 3.0
    # the caller is intact: the timer is off and a good program still runs
    assert fn is not None and _inprocess(P.REWARD_PLAIN_TENSOR)(*_args())[0].shape == (6,)


def test_in_process_calls_cannot_mutate_the_callers_tensors() -> None:
    state, action, nxt = _args()
    before = (state["pole_angle"].clone(), nxt["pole_angle"].clone())
    _inprocess(P.MUTATES_INPUT)(state, action, nxt)
    assert torch.equal(state["pole_angle"], before[0]) and torch.equal(nxt["pole_angle"], before[1])


def test_module_level_loop_cannot_hang_compile() -> None:
    with pytest.raises(SandboxError) as err:
        compile_program(RewardProgram(P.MODULE_LEVEL_LOOP), timeout_s=0.3)
    assert err.value.report.kind == "timeout"


def test_key_error_feedback_names_the_real_fields():
    from core.envs import make_task

    task = make_task({"name": "pendulum"})
    program = RewardProgram(source="def compute_reward(state, action, next_state):\n    return state['theta']\n")
    with pytest.raises(SandboxError) as err:
        prepare_reward(program, task)
    assert "KeyError" in err.value.report.message
    assert "cos_theta, sin_theta, angular_velocity" in err.value.report.message


# -- programs written for one state, not a batch --------------------------------------

PER_STATE_REWARD = '''def compute_reward(state, action, next_state):
    angle = next_state["pole_angle"]
    if abs(float(angle)) < 0.1:          # a Python branch on one value
        bonus = 1.0
    else:
        bonus = 0.0
    return bonus - abs(float(next_state["cart_position"])), {"bonus": bonus}
'''

PER_STATE_FEATURES = '''import torch


def revise_state(state):
    return torch.stack([state["pole_angle"] ** 2, state["cart_velocity"] * 2.0])
'''


def _cartpole():
    from core.envs import make_task

    return make_task({"name": "cartpole"})


def test_per_state_reward_runs_once_per_row() -> None:
    task = _cartpole()
    program = RewardProgram(source=PER_STATE_REWARD)
    fn = prepare_reward(program, task)
    assert fn.per_row and program.meta["per_row"] is True
    obs = torch.tensor([[0.5, 0.0, 0.05, 0.0], [-1.0, 0.0, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0]])
    state = task.split_state(obs)
    reward, comps = fn(state, torch.zeros(3, dtype=torch.long), state)
    assert reward.shape == (3,) and torch.allclose(reward, torch.tensor([0.5, -1.0, 1.0]))
    assert torch.equal(comps["bonus"], torch.tensor([1.0, 0.0, 1.0]))
    assert pickle.loads(pickle.dumps(fn)).per_row  # workers rebuild it in the same mode


def test_batched_reward_stays_batched() -> None:
    program = RewardProgram(source="def compute_reward(state, action, next_state):\n    return -next_state['pole_angle'].abs()\n")
    assert not prepare_reward(program, _cartpole()).per_row
    assert "per_row" not in program.meta


def test_per_row_fallback_can_be_switched_off() -> None:
    with pytest.raises(SandboxError) as err:
        prepare_reward(RewardProgram(source=PER_STATE_REWARD), _cartpole(), limits=Limits(per_row_fallback=False))
    assert err.value.report.kind == "exception"  # the batched call's error, as feedback


def test_per_row_keeps_the_batched_error_when_rows_fail_too() -> None:
    program = RewardProgram(source="def compute_reward(state, action, next_state):\n    return state['pole_angle'] / 0 + state['nope']\n")
    with pytest.raises(SandboxError) as err:
        prepare_reward(program, _cartpole())
    assert "KeyError" in err.value.report.message


def test_per_row_results_still_checked_for_nan() -> None:
    program = RewardProgram(source="def compute_reward(state, action, next_state):\n    return float('nan') if float(state['pole_angle']) > -9 else 0.0\n")
    with pytest.raises(SandboxError) as err:
        prepare_reward(program, _cartpole())
    assert err.value.report.kind in ("nonfinite", "exception", "dtype")


def test_per_state_features_stack_to_a_matrix() -> None:
    task = _cartpole()
    program = StateProgram(source=PER_STATE_FEATURES)
    fn = prepare_state(program, task)
    assert fn.per_row and program.extra_dim == 2
    obs = torch.tensor([[0.0, 1.0, 0.5, 0.0], [0.0, -2.0, 0.1, 0.0]])
    feats = fn(task.split_state(obs))
    assert torch.allclose(feats, torch.tensor([[0.25, 2.0], [0.01, -4.0]]))
