"""Preflight: check each new reward program before it trains, and repair a failing one.

Called by the loop (:meth:`core.loop.Loop.iterate`) on an iteration's candidates before
any of them is dispatched to training. For every reward program proposed this iteration:

1. **check and probe** it in the sandbox (:func:`core.sandbox.prepare_reward`: the AST
   policy, then one call on real states), as training would first;
2. **vet** it on the task's reference trajectories (:mod:`core.vetting`) when
   ``vetting.enabled``: a program that ranks failed episodes above successful ones, or
   pays for prolonging an episode the task wants ended, is rejected with feedback;
3. **repair, not resample**: a program that fails 1 or 2, or a reply that held no usable
   program (``Program.rejected``), is sent back to the LLM in a short request of its own
   (:func:`core.prompting.repair_messages`: the task's fields, the failing function, the
   error and the rule it broke) at ``code.repair_temperature``, up to ``vetting.repair``
   rounds (a repair that returns the same code ends them); each repaired program is
   checked again and, once it passes, trains in the original's place. With
   ``code.interface=dict`` (the earlier interface, kept for comparison) the proposing
   plugin's ``repair_program`` hook repairs instead, as before;
4. a program still failing never trains: its candidates get a failed
   :class:`core.records.TrainResult` (``error_kind="vetting"``, or the sandbox's category),
   whose error reaches the plugin's ``reflect`` like any failed training's. A reply that
   still holds no usable program stays the loop's rejected candidate (``Program.rejected``).

Each verdict is logged on the run: ``vetting/it<k>-<candidate>.md`` (text) and the
``vetting/*`` figures (``vetting/pair_accuracy``, ``vetting/step_reward``, ...) as metrics;
a rejected candidate is also recorded as a failed nested run with them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from core.context import RunContext
from core.records import Candidate, RewardProgram, TrainResult
from core.registry import call_plugin
from core.vetting import Verdict, reference_set, vet


@dataclass
class Examined:
    """One program's check: ``error`` ("" when it may train), its ``kind``, the vetting verdict."""

    program: RewardProgram
    error: str = ""
    kind: str = ""
    verdict: Verdict | None = None
    repairs: int = 0


def preflight(
    run: RunContext, candidates: list[Candidate], totals: dict[str, int] | None = None
) -> dict[str, TrainResult]:
    """Check, vet and repair the candidates' new reward programs; the failed result of each rejected one.

    Candidates whose program was repaired hold the repaired program afterwards. Programs
    kept from earlier iterations (a role that proposed nothing keeps the best's part) are
    not checked again. ``totals``: a round checked group by group (as its samples arrive)
    passes one dict to every call, and the counts logged are the round's so far.

    :return: candidate id -> failed :class:`TrainResult`, for the candidates that must not train.
    """
    cfg = run.settings.run.vetting
    if not cfg.enabled and cfg.repair <= 0:
        return {}
    seen = {id(c.reward) for it in run.history for c in it.candidates if c.reward is not None}
    fresh: dict[int, list[Candidate]] = {}
    for c in candidates:
        if isinstance(c.reward, RewardProgram) and id(c.reward) not in seen:
            fresh.setdefault(id(c.reward), []).append(c)
    checker = _Checker(run)
    rejected: dict[str, TrainResult] = {}
    repaired = 0
    for group in fresh.values():
        first = group[0]
        outcome = checker.settle(first)
        repaired += outcome.repairs > 0 and not outcome.error
        for c in group:
            c.reward = outcome.program
            if outcome.error and not outcome.program.rejected:  # an unusable reply is the loop's to record
                rejected[c.id] = _failed(c, outcome)
    if fresh:
        iteration = candidates[0].iteration
        counts = {"vetting/checked": len(fresh), "vetting/rejected": len(rejected), "vetting/repaired": repaired}
        if totals is not None:
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
            counts = dict(totals)
        run.log_metrics(counts, step=iteration)  # type: ignore[arg-type]  # ints are floats to a tracker
    _record(run, [c for c in candidates if c.id in rejected], rejected)
    return rejected


class _Checker:
    """Checks programs for one call of :func:`preflight`; builds the reference set once."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.cfg = run.settings.run.vetting
        self._references: list[Any] | None = None
        self._reference_error = ""
        self._step = 0
        self._shapes: Any = None

    def settle(self, candidate: Candidate) -> Examined:
        """Examine the candidate's program; repair it while it fails and repairs are left.

        A reply that hands the function back unchanged uses up its round without a check (the
        verdict would be the same); the next round says so and samples at
        ``code.retry_temperature``.
        """
        program = candidate.reward
        assert isinstance(program, RewardProgram)
        outcome = self.examine(program)
        self._log(candidate, outcome, 0)
        rounds = unchanged = 0
        last_unchanged = False
        while outcome.error and rounds < self.cfg.repair:
            rounds += 1
            fixed = self.repair(outcome.program, outcome.error, outcome.kind, rounds, unchanged=last_unchanged)
            if fixed is None:
                rounds -= 1
                break  # nothing came: not an LLM's program, or no plugin repairs it
            last_unchanged = fixed.source.strip() == outcome.program.source.strip()
            if last_unchanged:
                unchanged += 1
                continue
            outcome = self.examine(fixed)
            self._log(candidate, outcome, rounds)
        outcome.repairs = rounds
        outcome.program.meta["unchanged_repairs"] = unchanged
        return outcome

    def examine(self, program: RewardProgram) -> Examined:
        """Check and probe ``program`` in the sandbox, then vet it (when enabled)."""
        from core.sandbox import SandboxError, prepare_reward

        if program.rejected:  # the reply held no usable program: only a repair can help
            return Examined(program, program.rejected, str(program.meta.get("rejected_kind", "rejected")))
        sandbox = self.run.sandbox
        try:
            fn = prepare_reward(program, self.run.task, limits=sandbox.limits(), allowed_imports=sandbox.imports)
        except SandboxError as e:
            return Examined(program, f"{e.report.kind}: {e.report.message}", e.report.kind or "sandbox")
        try:
            if not self.cfg.enabled:
                return Examined(program)
            references = self.references()
            if not references:
                return Examined(program, verdict=Verdict(True, checks=[f"not vetted: {self._reference_error}"]))
            verdict = vet(fn, program, self.run.task, references)
        finally:
            fn.close()
        return Examined(program, verdict.reason, "" if verdict.ok else "vetting", verdict)

    def references(self) -> list[Any]:
        """The task's reference trajectories for the run's seed (built once, cached on disk)."""
        if self._references is None:
            try:
                self._references = reference_set(
                    self.run.task,
                    self.cfg.episodes,
                    self.run.seed,
                    max_steps=self.cfg.max_steps,
                    cache_dir=self.run.settings.run.cache_dir or None,
                )
            except Exception as exc:  # a task that cannot roll out is not vetted, never a crash
                self._references, self._reference_error = [], f"the reference episodes could not be made ({exc!r})"
        return self._references

    def repair(
        self, program: RewardProgram, error: str, kind: str = "", attempt: int = 1, unchanged: bool = False
    ) -> RewardProgram | None:
        """The repaired program (possibly rejected again, with its new reason), or None when none came.

        ``unchanged``: the previous reply returned the function as it was; this request says
        so and samples at ``code.retry_temperature``.
        """
        if self.run.settings.run.code.interface == "dict":
            return self._plugin_repair(program, error)
        if not program.reply:  # not an LLM's code (a plugin or a person wrote it): nothing to send back
            return None
        from core.codegen import program_from_reply, without_prelude
        from core.prompting import CODE_STOP, batch_shapes, repair_messages
        from core.sandbox import REWARD_ARGS

        code, task = self.run.settings.run.code, self.run.task
        self._shapes = self._shapes or batch_shapes(task, self.run.seed)
        msgs = repair_messages(
            task,
            without_prelude(program) or program.reply,
            error,
            kind,
            entry=program.entry,
            shapes=self._shapes,
            unchanged=unchanged,
        )
        tag = f"{program.origin or 'program'}-repair"
        temperature = code.retry_temperature if unchanged else code.repair_temperature
        reply = self.run.llm.chat(
            msgs,
            n=1,
            temperature=temperature,
            max_tokens=code.repair_max_tokens,
            stop=CODE_STOP if code.stop_at_code_end else None,
            seed=self.run.seed * 1000 + 500 + attempt,
            tag=tag,
        )[0]
        found = program_from_reply(
            RewardProgram,
            reply.text,
            program.entry,
            list(REWARD_ARGS),
            state_fields=task.field_names(),
            prelude=str(program.meta.get("prelude", "")),
            meta={**program.meta, "repairs": attempt},
        )
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        return replace(
            program, source=found.source, reply=reply.text, prompt=prompt, meta=found.meta, rejected=found.rejected
        )

    def _plugin_repair(self, program: RewardProgram, error: str) -> RewardProgram | None:
        """The proposing plugin's ``repair_program`` (the one ``program.origin`` names), or None."""
        pm = self.run.pluginmanager
        if not program.origin:
            return None
        if pm is None:  # a silent None here would read as "the plugin could not repair it"
            raise RuntimeError(
                "code.interface=dict repairs a program through its plugin's repair_program hook, and this "
                "run context has no plugin manager: make it with RunContext(pluginmanager=...)"
            )
        fixed = call_plugin(pm, "repair_program", program.origin, run=self.run, program=program, error=error)
        if not isinstance(fixed, RewardProgram):
            return None
        fixed.origin = fixed.origin or program.origin
        return fixed

    def _log(self, candidate: Candidate, outcome: Examined, attempt: int) -> None:
        suffix = f"-repair{attempt}" if attempt else ""
        verdict = outcome.verdict
        if verdict is not None:
            text = verdict.text()
        else:
            text = "# Reward check: " + (
                f"failed ({outcome.kind})\n\n{outcome.error}\n" if outcome.error else "passed (not vetted)\n"
            )
        self.run.log_text(f"vetting/it{candidate.iteration}-{candidate.id}{suffix}.md", text)
        figures = dict(verdict.figures) if verdict is not None else {"vetting/passed": 0.0 if outcome.error else 1.0}
        self.run.log_metrics(figures, step=candidate.iteration * 1000 + self._step)
        self._step += 1


def _failed(candidate: Candidate, outcome: Examined) -> TrainResult:
    """The result of a candidate whose program never trains."""
    verdict = outcome.verdict
    repairs = f" (after {outcome.repairs} repair{'s' if outcome.repairs != 1 else ''})" if outcome.repairs else ""
    return TrainResult(
        candidate_id=candidate.id,
        ok=False,
        error=outcome.error,
        error_kind=outcome.kind or "vetting",
        metrics={**(verdict.figures if verdict is not None else {}), "vetting/repairs": float(outcome.repairs)},
        texts={
            "vetting.md": (
                verdict.text()
                if verdict is not None
                else f"# Reward check: failed ({outcome.kind})\n\n{outcome.error}\n"
            )
            + (f"\nRejected{repairs}.\n" if repairs else "")
        },
    )


def _record(run: RunContext, candidates: list[Candidate], rejected: dict[str, TrainResult]) -> None:
    """A failed nested run per rejected candidate, as the loop records trained ones."""
    log = getattr(run.tracker, "log_candidate", None)
    if log is None:
        return
    for c in candidates:
        log(c, rejected[c.id], {"seed": str(run.seed), "rejected_by": "preflight"})
