"""llm_state_repr: the LLM writes state features and an intrinsic reward over them (LESR, ICML 2024).

Method (Wang et al., "LLM-Empowered State Representation for Reinforcement Learning"):

1. From a per-dimension description of the state and the task goal, the LLM writes
   ``revise_state(state)`` (extra task-relevant features appended to the original state)
   and ``intrinsic_reward(state, features)`` over the revised state.
2. Each sample is checked on real random states before it trains (finite features,
   finite and bounded intrinsic reward); failing samples are sent back with the error and
   resampled (``retries``).
3. K samples per iteration each train briefly with ``r_env + w * r_int``. Feedback lists
   each sample's score and, per dimension of the revised state, the Lipschitz constant
   between that dimension and the (binned mean) env reward over the collected states; the next prompt
   holds earlier code, scores and suggestions. The best pair is retrained at the end
   (``final_seeds``).

Prompt (``code.interface=fields``, the default): the task's fields (derived ones
included) with their shapes and meanings and the skeleton that binds each as
``state.<name>`` (:func:`core.prompting.state_interface`), the intrinsic reward's
signature and the method's rules; no example from another task. The names a reply reads
are checked before anything runs (:mod:`core.namecheck`): an unknown field or a name
never assigned sends the pair back with the valid fields, a unique close field is
renamed (``meta["fixes"]``). A pair that fails a check is repaired with the core's short
request (:func:`core.prompting.repair_messages`: the fields, the code, the error, the
rule) at ``code.repair_temperature``. ``code.interface=dict`` keeps the earlier prompt
(dict reads and a worked example of a made-up task with fields x, y, vx, vy) and the
conversation retry, for comparison.

Design: a candidate holds one :class:`StateProgram` (the revised state reaches the policy
through the core's ``ProgramState`` TorchRL transform) whose ``meta["intrinsic"]`` holds
the paired intrinsic-reward program. That program is prepared through the sandbox in
``on_train_start`` and added per step by this plugin's ``compute_reward`` hook. Proposing
the reward through ``propose_rewards`` instead would make the loop pair every state program
with every reward program (K x K candidates), and would take the reward role away from
plugins that combine with this one (e.g. ``+plugins=[llm_state_repr,eureka]``).

Config: ``conf/plugins/llm_state_repr.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import ast
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.plugin import (
    SAFE_BUILTIN_NAMES,
    Candidate,
    IterationResult,
    PluginConfig,
    RewardProgram,
    SandboxConfig,
    SandboxReport,
    Shapes,
    StateProgram,
    TrainResult,
    batch_shapes,
    candidate_line,
    check_names,
    code_options,
    extract_code,
    extract_function,
    fence,
    fields_text,
    hookimpl,
    interface_of,
    normalize_reward,
    prepare_reward,
    probe_batch,
    repair_messages,
    reply_counts,
    run_isolated,
    state_arguments,
    state_interface,
    validate_state,
)

NAME = "llm_state_repr"
STATE_ENTRY, REWARD_ENTRY = "revise_state", "intrinsic_reward"


@dataclass
class Config(PluginConfig):
    """``plugins.llm_state_repr``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 3  # outer rounds of sampling + short training + Lipschitz feedback (paper: 3)
    samples: int = 3  # feature/reward pairs sampled per round, each trained (paper: 6)
    retries: int = 1  # resample a pair that fails the check on real states, with the error, this many times
    weight: float = 0.1  # w in r_env + w * r_int
    reward_bound: float = 100.0  # a sample whose |intrinsic reward| exceeds this on the probe states is rejected
    history: int = 3  # earlier attempts (code, score, feedback) shown in the next prompt
    lipschitz_samples: int = 20000  # collected states per candidate used to estimate the Lipschitz constants
    # sampling temperature; None: by the number of samples (core.prompting.sampling_temperature; the
    # paper fixes none, its code defaults to 1.0)
    temperature: float | None = None
    max_tokens: int = 700  # cap on each reply (a pair takes ~150-600 tokens; small models list every field)
    final_seeds: int = 0  # retrain the best pair on this many more seeds after the loop

    def check(self) -> None:
        super().check()
        for name in ("samples", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("retries", "history", "lipschitz_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number, got {self.weight}")
        if not self.reward_bound > 0:
            raise ValueError(f"reward_bound must be > 0, got {self.reward_bound}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You are an expert in reinforcement learning and state representation. You write
Python functions over batched torch tensors. Reply with one ```python code block."""

#: the request with ``code.interface=fields``: the core's state interface (the task's fields and a skeleton
#: binding each), the intrinsic reward's signature, and the method's rules (no example of another task)
TASK = """Task goal: {goal}

{interface}

In the same ```python block, also write the intrinsic reward over the revised state:

```python
def intrinsic_reward(state, features):
    # features: what revise_state(state) returns, a float tensor [B, k]; read fields as state.<name>
    ...
    return reward  # float tensor [B] that rewards progress on the task, between about -1 and 1
```

Rules: write 2 to 4 new features: the policy already sees every field, so combine fields rather than
copy them, and keep each function a few lines long. Every feature is a [B] tensor computed from the
fields (not a constant, a Python number or a [B, 1] tensor), stacked with torch.stack(..., dim=-1).
No `if` on tensors (use torch.where), no loops over the batch, no in-place edits of the inputs.
Do not define compute_reward.
Reply with both functions in one ```python block and nothing after it."""

#: the earlier request (``code.interface=dict``), kept for comparison: dict reads and a worked example of a made-up task
TASK_DICT = """Task goal: {goal}

The state is a dict of named float32 tensors over B environments, with these shapes:
{schema}

Write two functions in one ```python block:
- revise_state(state): k extra task-relevant features computed from the fields
  (distances, relative positions, velocities, energies, ...), a float tensor [B, k].
- intrinsic_reward(state, features): a float tensor [B] that rewards progress on the
  task, between about -1 and 1; `features` is the output of revise_state(state).

Worked example for a made-up task (not yours) with fields x, y (position) and vx, vy
(velocity), whose goal is to reach the origin:

```python
import torch

def revise_state(state):
    distance = torch.sqrt(state["x"] ** 2 + state["y"] ** 2)  # [B]
    speed = torch.sqrt(state["vx"] ** 2 + state["vy"] ** 2)  # [B]
    approach = -(state["x"] * state["vx"] + state["y"] * state["vy"]) / (distance + 1e-6)  # [B]
    return torch.stack([distance, speed, approach], dim=-1)  # [B, 3]

def intrinsic_reward(state, features):
    distance, approach = features[:, 0], features[:, 2]
    return torch.tanh(approach) - 0.1 * torch.tanh(distance)  # [B]
```

Rules: the example's fields (x, y, vx, vy) are not yours: use only the field names
listed above. Write 2 to 4 new features: the policy already sees every field, so combine
fields rather than copy them, and keep each function a few lines long. Every feature is
a [B] tensor computed from the fields (not a constant, a Python number or a [B, 1]
tensor), stacked with torch.stack(..., dim=-1). Vectorised torch operations only (torch.where, torch.clamp,
torch.tanh; no `if` on tensors, no loops over the batch, no in-place edits of the
inputs). You may import only: {imports}."""

HISTORY = """Earlier attempts (code, score of the trained policy on {fitness_name}, and feedback):

{attempts}

Write an improved pair of functions, using the feedback."""

SUGGESTIONS = """Suggestions: dimensions with a Lipschitz constant near 0 barely relate to the
reward (drop or rework the features among them); features with large constants change the
reward sharply and are promising; keep the features of the best-scoring sample and add ones
that explain what it still misses."""

#: appended to the core's repair request: it asks for one function, LESR's reply needs both
REPAIR_BOTH = "Keep both functions, revise_state and intrinsic_reward, in the block."

INVALID = """The code above failed a check on real states ({kind}):
{error}
{hint}Fix it and reply with both functions in one ```python block."""

#: error text -> a hint sent with it (the mistakes small models make most)
HINTS = (
    (
        "stack expects each tensor to be equal size",
        "Every feature passed to torch.stack must have shape [B]: no constants, Python numbers or [B, 1] tensors.",
    ),
    ("KeyError", "Use only these field names: {fields}."),
    ("was never closed", "The reply was cut off at its length limit: write shorter functions (2 to 4 features)."),
    ("Boolean value of Tensor", "Do not use `if` on tensors: use torch.where(condition, a, b)."),
    ("must be a torch tensor", "revise_state must return one float tensor [B, k] (torch.stack([...], dim=-1))."),
    ("shape", "revise_state returns [B, k]; intrinsic_reward returns [B]."),
)


def hint_for(error: str, fields: list[str]) -> str:
    """A one-line fix hint for a known kind of error (with a trailing newline), or ""."""
    for needle, text in HINTS:
        if needle.lower() in error.lower():
            return text.format(fields=", ".join(fields)) + "\n"
    return ""


WRAPPER = f"""

def compute_reward(state, action, next_state):
    features = {STATE_ENTRY}(next_state)
    if features.dim() == 1:
        features = features.unsqueeze(-1)
    reward = {REWARD_ENTRY}(next_state, features)
    return reward, {{"feature_" + str(i): features[:, i] for i in range(features.shape[1])}}
"""


# -- code assembly and checks ----------------------------------------------------------------


def defined_functions(source: str) -> set[str]:
    """Top-level function names of ``source`` (empty when it does not parse)."""
    try:
        return {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    except SyntaxError:
        return set()


def extract_pair(reply: str) -> tuple[str, str]:
    """The reply's code defining both functions (and helpers), or ``("", error)``."""
    source, error, _ = extract_pair_kind(reply)
    return source, error


def extract_pair_kind(
    reply: str, fields: list[str] | None = None, fixes: list[str] | None = None
) -> tuple[str, str, str]:
    """``(source, error, kind)``: :func:`extract_pair` with the failure's kind
    (:data:`core.codegen.KINDS`, or ``compute_reward`` when the reply defines its own).

    With ``fields`` (the task's :meth:`~core.envs.task.Task.field_names`) the names both
    functions read are checked (:func:`check_pair_names`): the fixes are applied (and
    appended to ``fixes``); an unknown field or a name never assigned gives kind
    ``names`` with the valid fields, and the checked source (nothing was run).

    Neither function is renamed: with two entries and helpers of the same arity, a
    misnamed function could not be told from a helper.
    """
    found = extract_function(reply, STATE_ENTRY, ["state"])
    if not found.ok:
        return "", found.error, found.kind
    source = found.source
    if REWARD_ENTRY not in defined_functions(source):
        other = extract_function(reply, REWARD_ENTRY, ["state", "features"])
        if not other.ok:
            return "", other.error, other.kind
        source = source.rstrip() + "\n\n" + other.source
    if "compute_reward" in defined_functions(source):
        return (
            "",
            "Do not define `compute_reward`; write only `revise_state` and `intrinsic_reward` (and helpers).",
            "compute_reward",
        )
    if fields is not None:
        names = check_pair_names(source, fields)
        if fixes is not None:
            fixes.extend(names.fixes)
        if not names.ok:
            return names.source, names.message(fields), "names"
        source = names.source
    return source, "", ""


def check_pair_names(source: str, fields: list[str]) -> Any:
    """:func:`core.namecheck.check_names` over the pair: the state each of ``revise_state``
    and ``intrinsic_reward`` takes (whatever it calls it) may hold only ``fields``."""
    states = tuple(
        dict.fromkeys(
            state_arguments(source, STATE_ENTRY, ["state"])
            + state_arguments(source, REWARD_ENTRY, ["state", "features"])
        )
    )
    return check_names(source, fields, available=SAFE_BUILTIN_NAMES, state_args=states)


def intrinsic_program(source: str, weight: float) -> RewardProgram:
    """The paired intrinsic reward as a reward program on the task's original state fields:
    ``compute_reward(s, a, s') = intrinsic_reward(s', revise_state(s'))`` with the
    features as components (the Lipschitz feedback reads them)."""
    return RewardProgram(
        source=source.rstrip() + "\n" + WRAPPER, entry="compute_reward", origin=NAME, mode="add", weight=weight
    )


def validate_bounded(result: Any, args: tuple[Any, ...], bound: float) -> SandboxReport:
    """Probe validator (runs in the sandbox child): finite ``[B]`` reward with ``|r| <= bound``."""
    try:
        reward, _ = normalize_reward(result, int(next(iter(args[0].values())).shape[0]))
    except Exception as e:  # the sandbox's own invalid-output error
        return SandboxReport(False, getattr(e, "kind", "output"), str(e))
    peak = float(reward.abs().max()) if reward.numel() else 0.0
    if peak > bound:
        return SandboxReport(
            False, "output", f"the intrinsic reward reaches {peak:.3g}; keep it within +-{bound:g} (scale or clamp it)."
        )
    return SandboxReport(True, "ok", "")


def check_pair(source: str, states: tuple[Any, ...], cfg: Config, sandbox: SandboxConfig) -> SandboxReport:
    """Run both functions once on real states in the sandbox child and validate the outputs.

    A failed report names the function that failed in ``data["entry"]``.

    :param sandbox: the run's sandbox settings (``run.sandbox``): limits and allowed imports.
    """
    limits, imports = sandbox.limits(), sandbox.imports
    state, action, next_state = states
    report = run_isolated(
        StateProgram(source, STATE_ENTRY), (state,), limits=limits, validate=validate_state, allowed_imports=imports
    )
    if not report.ok:
        report.data["entry"] = STATE_ENTRY  # which function failed
        return report
    program = intrinsic_program(source, cfg.weight)
    check = functools.partial(validate_bounded, bound=cfg.reward_bound)
    report = run_isolated(program, (state, action, next_state), limits=limits, validate=check, allowed_imports=imports)
    if not report.ok:
        report.data["entry"] = REWARD_ENTRY
    return report


def lipschitz(values: np.ndarray, reward: np.ndarray, eps: float = 1e-6, bins: int = 100) -> np.ndarray:
    """Per dimension ``d``: the Lipschitz constant of the mean reward as a function of ``s_d``.

    ``values`` is ``[N, D]``, ``reward`` ``[N]``. The samples are sorted by ``s_d`` and cut
    into at most ``bins`` equal-count bins; the estimate is ``max |dr| / |ds|`` between the
    means of neighbouring bins (pairs closer than ``eps`` skipped; a constant dimension
    gets 0). Averaging first keeps the many near-equal neighbours of a large sample from
    turning reward noise into constants of 1e6.
    """
    out = np.zeros(values.shape[1])
    n = len(reward)
    for d in range(values.shape[1]):
        order = np.argsort(values[:, d], kind="stable")
        groups = np.array_split(np.arange(n), min(bins, n)) if n else []
        s = np.array([values[order[g], d].mean() for g in groups])
        r = np.array([reward[order[g]].mean() for g in groups])
        ds, dr = np.diff(s), np.abs(np.diff(r))
        keep = ds > eps
        out[d] = float(np.max(dr[keep] / ds[keep])) if keep.any() else 0.0
    return out


def dimension_names(task: Any, extra_dim: int) -> list[str]:
    """A name per dimension of the revised state: the task's fields, then ``feature_i``."""
    names = []
    for f in task.state_fields:
        names += [f.name] if f.size == 1 else [f"{f.name}.{i}" for i in range(f.size)]
    return names + [f"feature_{i}" for i in range(extra_dim)]


def format_lipschitz(metrics: dict[str, float]) -> str:
    items = [(k.split("/", 2)[-1], v) for k, v in metrics.items() if k.startswith(f"{NAME}/lipschitz/")]
    return ", ".join(f"{k}: {v:.3g}" for k, v in items) or "not measured"


# -- state and prompts ------------------------------------------------------------------------


@dataclass
class Attempt:
    """One trained pair, as the next prompt shows it."""

    source: str
    score: float
    feedback: str


@dataclass
class Training:
    """One candidate's training (in ``train.state[NAME]``): its prepared intrinsic reward and
    the (revised state, env reward) rows kept for the Lipschitz estimate."""

    fn: Any  # the sandboxed ``compute_reward`` wrapper of the pair
    weight: float
    rows: list[np.ndarray] = field(default_factory=list)
    rewards: list[np.ndarray] = field(default_factory=list)
    kept: int = 0


def messages(run: Any, cfg: Config, attempts: list[Attempt], shapes: Shapes | None = None) -> list[dict[str, str]]:
    """System + task + the best ``history`` earlier attempts.

    The task part follows the run's ``code.interface``: ``fields`` gives the core's state
    interface (the task's fields, a skeleton binding each, the allowed imports) and the
    intrinsic reward's signature; ``dict`` the earlier prompt (the schema, a worked
    example of a made-up task, the allowed imports).

    :param shapes: the task's :func:`core.prompting.batch_shapes` (made when None), for each field's shape.
    """
    shapes = shapes or batch_shapes(run.task, run.seed)
    imports = list(run.sandbox.imports)
    if interface_of(run) == "dict":
        user = TASK_DICT.format(goal=run.task.goal, schema=fields_text(run.task, shapes), imports=", ".join(imports))
    else:
        user = TASK.format(goal=run.task.goal, interface=state_interface(run.task, imports, shapes, interface="fields"))
    shown = sorted(attempts, key=lambda a: a.score)[-cfg.history :] if cfg.history else []
    if shown:
        text = "\n\n".join(f"```python\n{a.source.strip()}\n```\nScore: {a.score:.4g}\n{a.feedback}" for a in shown)
        user += "\n\n" + HISTORY.format(fitness_name=run.task.fitness_name, attempts=text) + "\n" + SUGGESTIONS
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """One LESR run: earlier attempts and the probe states (main process); the training
    hooks keep each candidate's objects in ``train.state[NAME]``."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.attempts: list[Attempt] = []
        self.probe: tuple[Any, ...] | None = None  # (state, action, next_state) of real steps, made once
        self.shapes: Shapes | None = None  # each field's shape, read off a real batch once per run

    # proposal and reflection (main process)

    @hookimpl
    def propose_state_reprs(self, run, iteration: int) -> list[StateProgram] | None:
        cfg = self.cfg
        if self.probe is None:
            obs, action, next_obs = probe_batch(run.task, num_envs=4, steps=8, seed=run.seed)
            self.probe = (run.task.split_state(obs), action, run.task.split_state(next_obs))
        self.shapes = self.shapes or batch_shapes(run.task, run.seed)
        msgs = messages(run, cfg, self.attempts, self.shapes)
        prompt = msgs[-1]["content"]
        programs: list[StateProgram] = []
        rejected: list[StateProgram] = []  # samples still unusable after their retries: recorded, not trained
        checked = interface_of(run) == "fields"  # the earlier interface (dict) reads no names before running
        fields = run.task.field_names()
        code = run.settings.run.code
        options = code_options(run, cfg.samples, cfg.temperature)
        # (sample, request, earlier errors, whether the request is a repair)
        pending: list[tuple[int, list[dict[str, str]], list[str], bool]] = [
            (j, list(msgs), [], False) for j in range(cfg.samples)
        ]
        for attempt in range(1 + cfg.retries):
            if not pending:
                break
            replies = []
            tag = f"{NAME}-it{iteration}-try{attempt}"
            for k, (_, conv, _, repair) in enumerate(pending):
                seed = run.seed * 10_000 + iteration * 100 + attempt * 10 + k
                if repair:  # the core's short repair request
                    replies += run.llm.chat(
                        conv,
                        n=1,
                        temperature=code.repair_temperature,
                        max_tokens=code.repair_max_tokens,
                        stop=options["stop"],
                        seed=seed,
                        tag=f"{tag}-repair",
                    )
                else:
                    replies += run.llm.chat(conv, n=1, max_tokens=cfg.max_tokens, seed=seed, tag=tag, **options)
            retry = []
            for (j, conv, errors, _), reply in zip(pending, replies):
                fixes: list[str] = []
                source, error, kind = extract_pair_kind(reply.text, fields if checked else None, fixes)
                repairable = bool(source)  # the pair was extracted (a names refusal included): it can be mended
                if source and not error:
                    report = check_pair(source, self.probe, cfg, run.sandbox)
                    kind, error = (report.kind, report.message) if not report.ok else ("", "")
                    if kind == "invalid_value" and report.data.get("entry") == STATE_ENTRY:
                        kind = "exception"  # the core's rule for this kind is a reward's ([B]); the features are [B, k]
                meta: dict[str, Any] = {"sample": j, "call": tag, "attempts": attempt + 1}
                if fixes:
                    meta["fixes"] = fixes
                if not error:
                    meta |= {
                        "pair": len(programs),
                        "intrinsic": intrinsic_program(source, cfg.weight).source,
                        "weight": cfg.weight,
                    }
                    programs.append(
                        StateProgram(
                            source=source, entry=STATE_ENTRY, origin=NAME, prompt=prompt, reply=reply.text, meta=meta
                        )
                    )
                elif attempt == cfg.retries:
                    meta |= {"rejected_kind": kind, "errors": errors}
                    rejected.append(
                        StateProgram(
                            source=source or extract_code(reply.text),
                            entry=STATE_ENTRY,
                            origin=NAME,
                            prompt=prompt,
                            reply=reply.text,
                            meta=meta,
                            rejected=error,
                        )
                    )
                elif not repairable:  # cut off or incomplete: shown its own reply, the model repeats it; sample afresh
                    retry.append((j, list(msgs), errors + [error], False))
                elif checked:
                    retry.append((j, self.repair_request(run, source, error, kind, fields), errors + [error], True))
                else:
                    follow = conv + [
                        {"role": "assistant", "content": reply.text},
                        {
                            "role": "user",
                            "content": INVALID.format(kind=kind, error=error, hint=hint_for(error, fields)),
                        },
                    ]
                    retry.append((j, follow, errors + [error], False))
            pending = retry
        if not programs:
            run.log_text(f"{NAME}/it{iteration}-no-valid-sample.txt", "\n\n".join(p.rejected for p in rejected))
        return (programs + rejected) or None

    def repair_request(self, run: Any, source: str, error: str, kind: str, fields: list[str]) -> list[dict[str, str]]:
        """The core's short repair request for a pair (:func:`core.prompting.repair_messages`),
        with the hint for a known mistake and the reminder that both functions come back."""
        msgs = repair_messages(
            run.task,
            source,
            error + "\n" + hint_for(error, fields),
            kind,
            entry=STATE_ENTRY,
            shapes=self.shapes,
            role="state",
        )
        msgs[-1]["content"] += "\n" + REPAIR_BOTH
        return msgs

    @hookimpl
    def reflect(self, run, result: IterationResult) -> str | None:
        mine = [
            (c, r) for c, r in zip(result.candidates, result.results) if _is_mine(c) and c.iteration == result.iteration
        ]
        if not mine:
            return None
        lines = [f"### Iteration {result.iteration}: {reply_counts(mine)}", ""]
        for c, r in mine:
            assert c.state is not None
            if c.rejected:  # retried with its error already; no training to learn from
                lines.append(candidate_line(c, r, c.state))
                continue
            sample = c.state.meta.get("sample")
            where = f"`{c.id}`" + (f" (reply {sample})" if sample is not None else "")
            if r.ok and r.fitness is not None:
                feedback = f"Lipschitz constant of each dimension with the env reward: {format_lipschitz(r.metrics)}"
                lines.append(f"- {where}: score {r.score:.4g}; {feedback}")
            else:
                feedback = f"Training failed ({r.error_kind}): {r.error.strip()[-400:]}"
                lines.append(f"- {where}: {' '.join(feedback.split())}")
            self.attempts.append(Attempt(c.state.source, r.score if r.ok else float("-inf"), feedback))
        ok = [(c, r) for c, r in mine if r.ok]
        if ok:
            best_c, _ = max(ok, key=lambda cr: cr[1].score)
            sample = best_c.state.meta.get("sample")  # type: ignore[union-attr]
            lines += [
                "",
                f"### `{best_c.id}`{f' (reply {sample})' if sample is not None else ''}, the best of this iteration",
                "",
                "Its state features and intrinsic reward:",
                "",
                fence(best_c.state.source, "python"),  # type: ignore[union-attr]
            ]
        return "\n".join(lines) + "\n\n" + SUGGESTIONS

    # training (the process that trains a candidate)

    @hookimpl
    def on_train_start(self, train) -> None:
        _training(train)

    @hookimpl
    def compute_reward(self, train, batch) -> torch.Tensor | None:
        session = _training(train)
        if session is None:
            return None
        r_int, feats = session.fn(batch.state, batch.action, batch.next_state)
        if session.kept < self.cfg.lipschitz_samples:
            features = (
                torch.stack([feats[k] for k in sorted(feats, key=lambda k: int(k.split("_")[-1]))], -1)
                if feats
                else batch.next_obs[:, :0]
            )
            session.rows.append(torch.cat([batch.next_obs, features], -1).numpy().copy())
            session.rewards.append(batch.env_reward.numpy().copy())
            session.kept += int(batch.env_reward.shape[0])
        train.log_metric(f"{NAME}/intrinsic_reward", float(r_int.mean()))
        return session.weight * r_int

    @hookimpl
    def on_train_end(self, train, result: TrainResult) -> None:
        session = train.state.pop(NAME, None)
        if session is None or not session.rows:
            return
        values, reward = np.concatenate(session.rows), np.concatenate(session.rewards)
        names = dimension_names(train.task, values.shape[1] - train.task.obs_dim)
        for name, value in zip(names, lipschitz(values, reward)):
            result.metrics[f"{NAME}/lipschitz/{name}"] = float(value)


def _training(train: Any) -> Training | None:
    """This training's prepared intrinsic reward and Lipschitz rows, made on first use;
    None when the candidate holds no pair of this plugin."""
    state = train.candidate.state
    if state is None or state.origin != NAME or "intrinsic" not in state.meta:
        return None
    if NAME not in train.state:
        weight = float(state.meta["weight"])
        program = RewardProgram(
            source=state.meta["intrinsic"], entry="compute_reward", origin=NAME, mode="add", weight=weight
        )
        fn = prepare_reward(program, train.task, limits=train.sandbox.limits(), allowed_imports=train.sandbox.imports)
        train.state[NAME] = Training(fn=fn, weight=program.weight)
    return train.state[NAME]


def _is_mine(candidate: Candidate) -> bool:
    return candidate.state is not None and candidate.state.origin == NAME
