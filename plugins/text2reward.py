"""text2reward: dense reward code from an environment abstraction (Text2Reward, ICLR 2024).

Method (Xie et al., "Text2Reward: Reward Shaping with Language Models for Reinforcement
Learning"):

1. Zero-shot: the LLM sees a compact Pythonic abstraction of the environment (a
   class-style view of the state's attributes, the action, and helper functions it may
   call) and the instruction, and writes ``compute_dense_reward`` with staged terms.
   A reply is retried, with the error shown, until its code parses and passes the
   sandbox probe on real states.
2. Few-shot: the ``shots`` most similar examples (by instruction text) are retrieved
   from a library of ``(instruction, reward code)`` pairs and shown before the task.
   The plugin builds that library from its own successful runs (``library_min_fitness``).
3. Optional human feedback: after training, a user's comment on the trained behaviour
   (``feedback`` or ``feedback_file``) and the previous code go back to the LLM for a
   revised reward; without one, ``auto_feedback`` writes a short factual comment.

Config: ``conf/plugins/text2reward.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.plugin import (
    Candidate,
    IterationResult,
    PluginConfig,
    RewardProgram,
    SandboxError,
    Shapes,
    Task,
    TrainResult,
    action_text,
    batch_shapes,
    candidate_line,
    code_options,
    fence,
    hookimpl,
    interface_of,
    prepare_reward,
    program_fields,
    program_from_reply,
    repair_messages,
    reply_counts,
    sign_rule,
    without_prelude,
)

NAME = "text2reward"
ENTRY = "compute_dense_reward"
ARGS = ["state", "action", "next_state"]


@dataclass
class Config(PluginConfig):
    """``plugins.text2reward``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 1  # 1 = zero-/few-shot only; more = feedback rounds (user comment, or auto_feedback)
    samples: int = 4  # reward functions sampled per round, each trained
    # sampling temperature; None: by the number of samples (core.prompting.sampling_temperature)
    temperature: float | None = None
    max_tokens: int = 768  # cap on each reply
    retries: int = 2  # re-asks per sample, with the error, until the code parses and validates
    validate: bool = True  # probe each program in the sandbox before accepting it (else only parse)
    instruction: str | None = None  # the instruction in words; null = the task's goal
    few_shot: bool = True  # show retrieved examples from the library (zero-shot while it is empty)
    shots: int = 1  # examples retrieved per prompt (most similar instructions)
    include_same_task: bool = True  # may retrieve examples written for this very task (false: other tasks only)
    # JSON library of (instruction, code) pairs; null = <cache_dir>/text2reward_library.json
    library_path: str | None = None
    library_min_fitness: float = 0.5  # a run's best reward joins the library when its fitness reaches this
    feedback: str | None = None  # a user's comment on the trained behaviour, used in the next round
    # or a text file holding it (read at each round, so it can be edited between rounds)
    feedback_file: str | None = None
    auto_feedback: bool = False  # with no user comment, write a factual one from the results (else no feedback round)
    final_seeds: int = 0  # retrain the best reward on this many more seeds after the loop

    def check(self) -> None:
        super().check()
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.shots < 0:
            raise ValueError(f"shots must be >= 0, got {self.shots}")
        if not math.isfinite(self.library_min_fitness):
            raise ValueError(f"library_min_fitness must be a finite number, got {self.library_min_fitness}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You are an expert in robotics and reinforcement learning. Given a Pythonic
abstraction of an environment and an instruction, you write a dense reward function
in Python that lets an RL agent learn to follow the instruction. Reply with one
```python code block."""

#: helpers prepended to every program: the abstraction promises them to the LLM
HELPERS = '''import torch


def distance(a, b):
    """Euclidean distance over the last axis; |a - b| for scalar fields."""
    d = a - b
    return torch.sqrt((d * d).sum(dim=-1)) if d.dim() > 1 else torch.abs(d)


def tolerance(x, lower, upper, margin):
    """1 inside [lower, upper], falling smoothly to 0 at `margin` outside it."""
    below = torch.clamp(lower - x, min=0.0) / margin
    above = torch.clamp(x - upper, min=0.0) / margin
    return torch.exp(-(below + above) ** 2)


def stage(done, value):
    """`value` where the stage condition `done` holds, else 0 (a staged term)."""
    return torch.where(done, value, torch.zeros_like(value))
'''

ABSTRACTION = """```python
class {cls}:
    \"\"\"The state of the environment, batched over B parallel envs.
    Read an attribute as state.{read} (and next_state.{read} after the action);
    each is a float32 torch.Tensor of shape [B] unless its shape is given. It has
    no attributes but these.\"\"\"
{attributes}

# {action}

# Helper functions (already defined; call them, do not redefine them):
def distance(a, b) -> torch.Tensor:            # Euclidean distance (|a - b| for scalars)
def tolerance(x, lower, upper, margin) -> torch.Tensor:  # 1 in [lower, upper], smooth 0 outside
def stage(done, value) -> torch.Tensor:        # value where bool tensor `done` holds, else 0
```"""

TASK = """Environment abstraction:

{abstraction}

{description}

Instruction: {instruction}

Write the reward with exactly this signature:

```python
def compute_dense_reward(state, action, next_state):
    ...
    return reward, components
```

`reward` is a float tensor [B]; `components` a dict of the named [B] terms you add up.
Shape the reward in stages (for example: first approach, then make progress, then
finish), each stage a term that switches on with torch.where when the previous one is
done. Use only vectorised torch operations on whole batches: no `if` on tensors, no
math.* on tensors, no Python loops over envs. You may import only: {imports}.
{sign_rule}{ending}"""

EXAMPLE = """An example reward that worked. Instruction: {instruction}

```python
{code}
```"""

RETRY = """That code cannot be used: {error}
The only keys of `state` and `next_state` are: {fields}.
Fix it and reply with the complete `compute_dense_reward` in a ```python block."""

FEEDBACK = """We trained a policy with the reward function above. Its result: {summary}

Feedback from the user on the trained behaviour: {comment}

Revise the reward function accordingly and reply with the complete
`compute_dense_reward` in a ```python block."""

WORD = re.compile(r"[a-z0-9_]+")


# -- library of (instruction, code) examples ------------------------------------------------


@dataclass
class Example:
    """One successful reward function: the instruction it was written for and its code."""

    task: str
    instruction: str
    code: str
    fitness: float


def _bag(text: str) -> Counter[str]:
    return Counter(WORD.findall(text.lower()))


def similarity(a: str, b: str) -> float:
    """Cosine similarity of the two texts' word counts (0 when either is empty)."""
    x, y = _bag(a), _bag(b)
    dot = sum(x[w] * y[w] for w in x)
    norm = math.sqrt(sum(v * v for v in x.values())) * math.sqrt(sum(v * v for v in y.values()))
    return dot / norm if norm else 0.0


def retrieve(library: list[Example], instruction: str, k: int) -> list[Example]:
    """The ``k`` examples whose instructions are most similar to ``instruction``."""
    if k <= 0:
        return []
    ranked = sorted(library, key=lambda e: (similarity(e.instruction, instruction), e.fitness), reverse=True)
    return ranked[:k]


def load_library(path: Path | None) -> list[Example]:
    if path is None or not path.exists():
        return []
    try:
        return [Example(**item) for item in json.loads(path.read_text())]
    except (ValueError, TypeError):
        return []  # a damaged library only costs the few-shot examples


def add_example(library: list[Example], example: Example) -> list[Example]:
    """Add ``example``, keeping one entry per (task, instruction): the fittest."""
    same = [e for e in library if e.task == example.task and e.instruction == example.instruction]
    if same and max(e.fitness for e in same) >= example.fitness:
        return library
    rest = [e for e in library if not (e.task == example.task and e.instruction == example.instruction)]
    return rest + [example]


# -- prompts ----------------------------------------------------------------------------------


def abstraction(task: Task, shapes: Shapes | None = None, interface: str = "fields") -> str:
    """The Pythonic class-style view of the task's state (derived fields included), action
    and helpers, with the shapes a real batch of the task has (:func:`core.prompting.batch_shapes`)."""
    shapes = shapes or batch_shapes(task)
    cls = "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", task.name) if part) + "State"
    rows = []
    for f in program_fields(task) if interface == "fields" else task.state_fields:
        dims = shapes.fields[f.name]
        shape = f" shape {Shapes.text(dims)};" if dims else ""
        unit = f" [{f.unit}]" if f.unit else ""
        rows.append(f"    {f.name}: torch.Tensor  #{shape}{unit} {f.description}")
    text = ABSTRACTION.format(cls=cls, attributes="\n".join(rows), action=action_text(task, shapes), read="name")
    return text if interface == "fields" else text.replace("state.name", 'state["name"]')


def task_prompt(
    task: Task, instruction: str, allowed: list[str], shapes: Shapes | None = None, interface: str = "fields"
) -> str:
    description = task.description.split("\n\n")[0]  # the prose, not the schema repeated
    fields = interface == "fields"
    return TASK.format(
        abstraction=abstraction(task, shapes, interface),
        description=description,
        instruction=instruction,
        imports=", ".join(allowed),
        sign_rule=sign_rule(task) + "\n" if fields else "",
        ending="Reply with the complete function in one ```python block and nothing after it." if fields else "",
    )


def messages(
    task: Task,
    instruction: str,
    allowed: list[str],
    examples: list[Example],
    shapes: Shapes | None = None,
    interface: str = "fields",
) -> list[dict[str, str]]:
    """System + (retrieved examples) + the task prompt."""
    user = task_prompt(task, instruction, allowed, shapes, interface)
    if examples:
        shown = "\n\n".join(EXAMPLE.format(instruction=e.instruction, code=e.code.strip()) for e in examples)
        user = shown + "\n\nNow your task.\n\n" + user
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def behaviour_summary(result: TrainResult, fitness_name: str) -> str:
    """A one-line factual account of what the trained policy did."""
    parts = [f"{fitness_name} = {result.fitness.value:.3g}" if result.fitness else "no fitness"]
    if result.episodes:
        lengths = [e.length for e in result.episodes]
        returns = [e.ret for e in result.episodes]
        parts.append(f"episode length {min(lengths)}-{max(lengths)} (mean {sum(lengths) / len(lengths):.0f})")
        parts.append(f"env return mean {sum(returns) / len(returns):.3g}")
    for name, series in sorted(result.components.items()):
        if series:
            parts.append(f"{name} {series[0][1]:.3g} -> {series[-1][1]:.3g}")
    return "; ".join(parts) + "."


def auto_comment(result: TrainResult, fitness_name: str) -> str:
    """Stands in for a user's comment when none is given: says what went wrong."""
    value = result.fitness.value if result.fitness else 0.0
    if value <= 0.0:
        return (
            "The agent never achieves the goal. The reward must guide it more directly toward the instruction's goal."
        )
    return (
        f"The agent sometimes achieves the goal ({fitness_name} {value:.2f}) but not reliably. "
        "Make the final stage more rewarding."
    )


def program_of(reply: str, prompt: str, sample: int, call: str = "", fields: list[str] | None = None) -> RewardProgram:
    """The reward program in ``reply`` with the helpers prepended, or the same record
    rejected with the reason (:func:`core.codegen.program_from_reply`); with ``fields``
    (the task's field names) the names it reads are checked and mended first."""
    meta: dict[str, Any] = {"sample": sample, **({"call": call} if call else {})}
    return program_from_reply(
        RewardProgram, reply, ENTRY, ARGS, state_fields=fields, prelude=HELPERS, origin=NAME, prompt=prompt, meta=meta
    )


# -- helpers reading the config ----------------------------------------------------------------


def instruction_of(cfg: Config, task: Task) -> str:
    """The instruction in words: the configured one, else the task's goal."""
    return cfg.instruction or task.goal


def user_comment(cfg: Config) -> str:
    """The user's comment for a feedback round: the file's text if it has any, else ``feedback``."""
    path = cfg.feedback_file
    if path and Path(path).exists():
        text = Path(path).read_text().strip()
        if text:
            return text
    return (cfg.feedback or "").strip()


def sandbox_error(run: Any, program: RewardProgram) -> str:
    """'' when the sandbox accepts the program on real states, else the reason."""
    try:
        prepare_reward(program, run.task, limits=run.sandbox.limits(), allowed_imports=run.sandbox.imports)
    except SandboxError as e:
        return f"{e.report.kind}: {e.report.message}"
    return ""


# -- hooks -------------------------------------------------------------------------------------


class Plugin:
    """One Text2Reward run: the few-shot library, the latest best reward and the run's best."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.library: list[Example] = []
        self.library_path: Path | None = None
        self.best: tuple[RewardProgram, TrainResult] | None = None  # the latest iteration's best
        self.best_score = float("-inf")
        self.best_source = ""  # the fittest program over the run
        self.shapes: Shapes | None = None  # what the code receives, read off a real batch once per run

    @hookimpl
    def on_run_start(self, run) -> None:
        path = self.cfg.library_path
        self.library_path = Path(path) if path else Path(run.settings.run.cache_dir) / "text2reward_library.json"
        self.library = load_library(self.library_path)

    @hookimpl
    def propose_rewards(self, run, iteration: int) -> list[RewardProgram] | None:
        cfg = self.cfg
        allowed = list(run.sandbox.imports)
        instruction = instruction_of(cfg, run.task)
        self.shapes = self.shapes or batch_shapes(run.task, run.seed)
        if iteration > 0 and self.best is not None:
            comment = user_comment(cfg) or (
                auto_comment(self.best[1], run.task.fitness_name) if cfg.auto_feedback else ""
            )
            if not comment:
                return None  # no feedback round: keep the zero-/few-shot reward
            msgs = messages(run.task, instruction, allowed, [], self.shapes, interface_of(run))
            msgs += [
                {"role": "assistant", "content": self.best[0].reply},
                {
                    "role": "user",
                    "content": FEEDBACK.format(
                        summary=behaviour_summary(self.best[1], run.task.fitness_name), comment=comment
                    ),
                },
            ]
        else:
            shots = cfg.shots if cfg.few_shot else 0
            pool = [e for e in self.library if cfg.include_same_task or e.task != run.task.name]
            msgs = messages(
                run.task, instruction, allowed, retrieve(pool, instruction, shots), self.shapes, interface_of(run)
            )
        return self.generate(run, msgs, iteration)

    def generate(self, run: Any, msgs: list[dict[str, str]], iteration: int) -> list[RewardProgram]:
        """``samples`` programs, each retried with its error until it parses and validates.

        A retry is the core's short repair request (:func:`core.prompting.repair_messages`:
        the fields, the function, the error, the rule) with ``code.interface=fields``, and
        the conversation with the error appended (the paper's) with ``dict``. A sample
        still unusable after its retries is returned rejected, with the last error as its
        reason and its earlier errors in ``meta["errors"]`` (recorded, not trained).
        """
        cfg = self.cfg
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        tag = f"{NAME}-it{iteration}"
        options = code_options(run, cfg.samples, cfg.temperature)
        replies = run.llm.chat(
            msgs, n=cfg.samples, max_tokens=cfg.max_tokens, seed=run.seed * 1000 + iteration, tag=tag, **options
        )
        fields = interface_of(run) == "fields"
        names = run.task.field_names() if fields else None
        programs: list[RewardProgram] = []
        for i, reply in enumerate(replies):
            text, convo = reply.text, list(msgs)
            errors: list[str] = []
            for attempt in range(cfg.retries + 1):
                program = program_of(
                    text, prompt, i, tag, names
                )  # the sample index of the first request, whichever attempt
                if not program.rejected and cfg.validate:
                    error = sandbox_error(run, program)
                    if error:  # parses, but fails on real states: rejected with the sandbox's reason
                        program.rejected, program.meta["rejected_kind"] = error, "sandbox"
                program.meta["attempts"] = attempt + 1
                if not program.rejected or attempt == cfg.retries:
                    program.meta["errors"] = errors
                    programs.append(program)
                    break
                errors.append(program.rejected)
                seed = run.seed * 1000 + iteration * 100 + i * 10 + attempt
                if fields:
                    code = run.settings.run.code
                    kind = str(program.meta.get("rejected_kind", ""))
                    kind = program.rejected.split(":")[0] if kind == "sandbox" else kind  # the sandbox's own kind
                    request = repair_messages(
                        run.task,
                        without_prelude(program) or text,
                        program.rejected,
                        kind,
                        entry=ENTRY,
                        shapes=self.shapes,
                    )
                    text = run.llm.chat(
                        request,
                        n=1,
                        temperature=code.repair_temperature,
                        max_tokens=code.repair_max_tokens,
                        stop=options["stop"],
                        seed=seed,
                        tag=f"{tag}-retry",
                    )[0].text
                    continue
                listed = ", ".join(f'"{f.name}"' for f in run.task.state_fields)
                convo = convo + [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": RETRY.format(error=program.rejected[-1200:], fields=listed)},
                ]
                text = run.llm.chat(
                    convo,
                    n=1,
                    temperature=options["temperature"],
                    max_tokens=cfg.max_tokens,
                    seed=seed,
                    tag=f"{tag}-retry",
                )[0].text
        return programs

    @hookimpl
    def reflect(self, run, result: IterationResult) -> str | None:
        mine = [(c, r) for c, r in zip(result.candidates, result.results) if _is_mine(c, result.iteration)]
        if not mine:
            return None
        ok = [(c, r) for c, r in mine if r.ok]
        lines = [f"### Iteration {result.iteration}: {reply_counts(mine)}", ""]
        lines += [candidate_line(c, r, c.reward) for c, r in mine]
        if not ok:
            return "\n".join(lines)
        best_c, best_r = max(ok, key=lambda cr: cr[1].score)
        assert best_c.reward is not None
        self.best = (best_c.reward, best_r)
        if best_r.score > self.best_score:
            self.best_score, self.best_source = best_r.score, best_c.reward.source
        code = without_prelude(best_c.reward, HELPERS).strip()
        sample = best_c.reward.meta.get("sample")
        lines += [
            "",
            f"### `{best_c.id}`{f' (reply {sample})' if sample is not None else ''}, the best of this iteration",
            "",
            "Its reward function (the helpers omitted):",
            "",
            fence(code, "python"),
            "",
            "- behaviour: " + behaviour_summary(best_r, run.task.fitness_name),
        ]
        if best_r.score >= self.cfg.library_min_fitness:
            self.library = add_example(
                self.library, Example(run.task.name, instruction_of(self.cfg, run.task), code, best_r.score)
            )
            self.save_library()
            lines.append(f"- added `{best_c.id}` to the few-shot library ({len(self.library)} examples)")
        return "\n".join(lines)

    @hookimpl
    def on_run_end(self, run, best: tuple[Candidate, TrainResult] | None) -> None:
        if self.best_source:
            run.log_text(f"{NAME}/best_reward.py", self.best_source)

    def save_library(self) -> None:
        if self.library_path is None:
            return
        self.library_path.parent.mkdir(parents=True, exist_ok=True)
        self.library_path.write_text(json.dumps([asdict(e) for e in self.library], indent=1))

    @hookimpl
    def repair_program(self, run, program: RewardProgram, error: str) -> RewardProgram | None:
        """The task prompt, the failing reply and its error back to the LLM; the corrected function.

        Used with ``code.interface=dict`` only: the core repairs every other run's programs."""
        cfg = self.cfg
        msgs = messages(run.task, instruction_of(cfg, run.task), list(run.sandbox.imports), [], self.shapes, "dict")
        fields = ", ".join(f'"{f.name}"' for f in run.task.state_fields)
        msgs += [
            {"role": "assistant", "content": program.reply or f"```python\n{program.source}\n```"},
            {"role": "user", "content": RETRY.format(error=error.strip()[-1200:], fields=fields)},
        ]
        attempt = int(program.meta.get("repairs", 0)) + 1
        reply = run.llm.chat(
            msgs,
            n=1,
            temperature=0.7 if cfg.temperature is None else cfg.temperature,
            max_tokens=cfg.max_tokens,
            seed=run.seed * 1000 + 900 + attempt,
            tag=f"{NAME}-repair",
        )[0]
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        repaired = program_of(reply.text, prompt, int(program.meta.get("sample", 0)), str(program.meta.get("call", "")))
        if repaired.rejected:
            return None
        repaired.meta["repairs"] = attempt
        return repaired


def _is_mine(candidate: Candidate, iteration: int) -> bool:
    return candidate.reward is not None and candidate.reward.origin == NAME and candidate.iteration == iteration
