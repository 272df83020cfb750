"""eureka: the LLM writes reward code, improved by reward reflection (Eureka, ICLR 2024).

Method (Ma et al., "Eureka: Human-Level Reward Design via Coding Large Language Models"):

1. The LLM sees the environment as context (its observation code or state schema) and
   the task goal, and writes a reward function returning the total reward and a dict of
   named components.
2. Each iteration samples K reward functions; each trains a policy for a fixed budget;
   each is scored on the task's ground-truth fitness; the best is kept.
3. Reward reflection: the best candidate's components and fitness, sampled over
   training (with max/mean/min), go back to the LLM with tips on how to read them.
   Failed candidates send their error instead; when no reply held a usable function,
   the reason goes back with the next request.

The K samples are handed to the loop in groups as the LLM's requests land
(:meth:`core.llm.LLMClient.chat_groups`), so the first ones train while the rest are sampled.

Every reply becomes a candidate: an unusable one (no code, no ``compute_reward``, a
syntax error, the wrong signature) is recorded as a rejected candidate with its reason
and never trained; a lone function of the right arity under another name
(``improved_compute_reward``) is renamed and trained, and the rename recorded.
4. The context is system + task + the latest best reply + its feedback; after N
   iterations the best reward is retrained on more seeds (``final_seeds``).

Config: ``conf/plugins/eureka.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from core.plugin import (
    Candidate,
    IterationResult,
    PluginConfig,
    RewardProgram,
    Shapes,
    TrainResult,
    batch_shapes,
    candidate_line,
    code_options,
    fence,
    hookimpl,
    interface_of,
    program_from_reply,
    reply_counts,
    reward_interface,
    sample_evenly,
    summarize_series,
    task_description,
)

NAME = "eureka"
ENTRY = "compute_reward"
ARGS = ["state", "action", "next_state"]


@dataclass
class Config(PluginConfig):
    """``plugins.eureka``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 5  # outer rounds of sampling + training + reflection (paper: 5)
    samples: int = 16  # reward functions sampled per round, each trained (paper: 16)
    # sampling temperature; None: by the number of samples (1.0 at 16, the paper's; less for fewer)
    temperature: float | None = None
    max_tokens: int = 1024  # cap on each reply

    def check(self) -> None:
        super().check()
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You are a reward engineer. You write reward functions that make reinforcement
learning agents learn the task as quickly and reliably as possible. Your reward
function should use useful variables from the environment as inputs. Reply with one
```python code block holding the reward function (helpers may sit in the same block)."""

TASK = """The environment:

{description}

{interface}

Task goal: {goal}

Tips for the components: if you transform a component (for example with torch.exp),
introduce a named temperature variable for that transformation inside the function, so
that its scale can be tuned. Return every term you add up as a named component."""

REFLECTION = """We trained a policy with the reward function above and tracked the value of
each reward component and the task fitness ({fitness_name}) at regular intervals over
training, with their maximum, mean and minimum:

{series}

Analyse this feedback and write an improved reward function:
(1) If the fitness is always near zero, rewrite the entire reward function.
(2) If a component's values are nearly identical throughout, RL cannot optimise it:
    change its scale or the temperature of its transformation, rewrite it, or drop it.
(3) If one component's magnitude is much larger than the others, rescale it.
Think through each component, then reply with the new function in a ```python block."""

FAILURE = """Running the reward function above failed ({kind}):

{error}

Fix the problem and reply with the complete corrected reward function in a ```python block."""

NO_CODE = """Your reply could not be used: {error}
Reply with the complete reward function in a ```python block."""


# -- prompts -------------------------------------------------------------------------------


def task_prompt(run, shapes: Shapes | None = None) -> str:
    """The user message describing the environment, the interface and the goal.

    :param shapes: the task's :func:`core.prompting.batch_shapes` (computed when not given).
    """
    interface = reward_interface(run.task, list(run.sandbox.imports), shapes, interface=interface_of(run))
    return TASK.format(
        description=task_description(run.task, interface_of(run)), interface=interface, goal=run.task.goal
    )


def messages(run, best_reply: str, feedback: str, shapes: Shapes | None = None) -> list[dict[str, str]]:
    """System + task + (latest best reply + its feedback), Eureka's context policy."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task_prompt(run, shapes)}]
    if best_reply and feedback:
        msgs += [{"role": "assistant", "content": best_reply}, {"role": "user", "content": feedback}]
    elif feedback:  # nothing usable came back yet: say why and ask again
        msgs[-1]["content"] += "\n\n" + feedback
    return msgs


def reflection(result: TrainResult, fitness_name: str, failure_modes: str = "") -> str:
    """Eureka's reward reflection: components and fitness sampled over training.

    ``failure_modes`` is the task's summary of how evaluation episodes ended (e.g. the
    Kuka grasp's "never reached the block"), appended when the task provides one.
    """
    lines = []
    for name, series in sorted(result.components.items()):
        values = [v for _, v in sample_evenly(series, 10)]
        lines.append(f"{name}: {summarize_series(values)}")
    fitness = [p.fitness for p in sample_evenly(result.curve, 10)]
    if result.fitness is not None and not fitness:
        fitness = [result.fitness.value]
    lines.append(f"fitness ({fitness_name}): {summarize_series(fitness)}")
    lengths = [e.length for e in result.episodes]
    if lengths:
        lines.append(f"episode length: {summarize_series([float(n) for n in lengths])}")
    text = REFLECTION.format(fitness_name=fitness_name, series="\n".join(lines))
    if failure_modes:
        text += "\n\nHow the evaluation episodes ended:\n" + failure_modes
    return text


# -- hooks ---------------------------------------------------------------------------------


class Plugin:
    """One Eureka search; its state is the conversation it carries between iterations."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.best_reply = ""  # the latest best (or failing) reply, shown as the assistant turn
        self.feedback = ""  # reflection on it, shown as the next user turn
        self.best_score = float("-inf")
        self.best_source = ""
        self.shapes: Shapes | None = None  # what the code receives, read off a real batch once per run

    @hookimpl
    def propose_rewards(self, run, iteration: int) -> Iterator[list[RewardProgram]]:
        """The round's K programs, in groups as the LLM's requests land (the loop trains the
        first while the rest are sampled)."""
        self.shapes = self.shapes or batch_shapes(run.task, run.seed)
        return self._sample(run, messages(run, self.best_reply, self.feedback, self.shapes), iteration)

    def _sample(self, run, msgs: list[dict[str, str]], iteration: int) -> Iterator[list[RewardProgram]]:
        cfg = self.cfg
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        tag = f"{NAME}-it{iteration}"
        programs: list[RewardProgram] = []
        fields = run.task.field_names()
        for replies in run.llm.chat_groups(
            msgs,
            n=cfg.samples,
            max_tokens=cfg.max_tokens,
            seed=run.seed * 1000 + iteration,
            tag=tag,
            **code_options(run, cfg.samples, cfg.temperature),
        ):
            # every reply becomes a program: usable, or rejected with its reason (recorded, not trained)
            group = [
                program_from_reply(
                    RewardProgram,
                    reply.text,
                    ENTRY,
                    ARGS,
                    state_fields=fields,
                    origin=NAME,
                    prompt=prompt,
                    meta={"sample": len(programs) + j, "call": tag},
                )
                for j, reply in enumerate(replies)
            ]
            programs += group
            if len(programs) == cfg.samples and all(p.rejected for p in programs):
                # no usable code at all: the next iteration says why (Eureka resamples)
                self.feedback = NO_CODE.format(error=programs[0].rejected)
            yield group

    @hookimpl
    def reflect(self, run, result: IterationResult) -> str | None:
        mine = [(c, r) for c, r in zip(result.candidates, result.results) if _is_mine(c, result.iteration)]
        if not mine:
            return self.feedback or None
        ok = [(c, r) for c, r in mine if r.ok]
        failed = [(c, r) for c, r in mine if not r.ok and not c.rejected]
        about: Candidate | None = None  # the candidate whose reply and code the feedback answers
        if ok:
            best_c, best_r = max(ok, key=lambda cr: cr[1].score)
            about = best_c
            self.best_reply = best_c.reward.reply  # type: ignore[union-attr]
            self.feedback = reflection(best_r, run.task.fitness_name, run.task.failure_modes(best_r.episodes))
            for c, r in ok:
                modes = run.task.failure_modes(r.episodes)
                if modes:
                    run.log_text(f"{NAME}/{c.id}/failure_modes.txt", modes)
            if best_r.score > self.best_score:
                self.best_score, self.best_source = best_r.score, best_c.reward.source  # type: ignore[union-attr]
        elif failed:
            about, failed_r = failed[0]
            self.best_reply = about.reward.reply  # type: ignore[union-attr]
            self.feedback = FAILURE.format(kind=failed_r.error_kind or "error", error=failed_r.error.strip()[-1500:])
        else:  # every reply rejected: propose_rewards set the reason as the next request's feedback
            about = mine[0][0]
        return reflection_markdown(result.iteration, mine, about, self.feedback)

    @hookimpl
    def on_run_end(self, run, best: tuple[Candidate, TrainResult] | None) -> None:
        if self.best_source:
            run.log_text(f"{NAME}/best_reward.py", self.best_source)

    @hookimpl
    def repair_program(self, run, program: RewardProgram, error: str) -> RewardProgram | None:
        """Send the failing reply back in its conversation with the error; the corrected function.

        Used with ``code.interface=dict`` only (the earlier interface, for comparison): the
        core repairs every other run's programs with a short request of its own."""
        msgs = messages(run, self.best_reply, self.feedback, self.shapes)  # the context the program was sampled in
        msgs += [
            {"role": "assistant", "content": program.reply or f"```python\n{program.source}\n```"},
            {"role": "user", "content": FAILURE.format(kind="checked before training", error=error.strip()[-1500:])},
        ]
        attempt = int(program.meta.get("repairs", 0)) + 1
        reply = run.llm.chat(
            msgs,
            n=1,
            temperature=1.0 if self.cfg.temperature is None else self.cfg.temperature,
            max_tokens=self.cfg.max_tokens,
            seed=run.seed * 1000 + 500 + attempt,
            tag=f"{NAME}-repair",
        )[0]
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        repaired = program_from_reply(
            RewardProgram,
            reply.text,
            ENTRY,
            ARGS,
            origin=NAME,
            prompt=prompt,
            meta={**program.meta, "repairs": attempt},
        )
        return None if repaired.rejected else repaired


def reflection_markdown(
    iteration: int, mine: list[tuple[Candidate, TrainResult]], about: Candidate | None, feedback: str
) -> str:
    """The iteration's record as markdown: the counts, one line per candidate, then the
    candidate the feedback is about, its reward code, and the feedback itself."""
    lines = [f"### Iteration {iteration}: {reply_counts(mine)}", ""]
    lines += [candidate_line(c, r, c.reward) for c, r in mine]
    if about is not None and about.reward is not None:
        program = about.reward
        sample = program.meta.get("sample")
        which = "the best of this iteration" if not about.rejected else "rejected"
        lines += ["", f"### Feedback on `{about.id}`{f' (reply {sample})' if sample is not None else ''}, {which}", ""]
        if program.source.strip():
            lines += [f"Its reward function (`{program.entry}`):", "", fence(program.source, "python"), ""]
        else:
            lines += ["Its reply held no code:", "", fence(program.reply, "text"), ""]
    if feedback:
        lines += ["Sent to the LLM with the next request:", "", fence(feedback, "text")]
    return "\n".join(lines)


def _is_mine(candidate: Candidate, iteration: int) -> bool:
    return candidate.reward is not None and candidate.reward.origin == NAME and candidate.iteration == iteration
