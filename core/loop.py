"""The agent loop: propose candidates, train and score them, reflect, repeat.

Outer loop (one iteration per LLM round)::

    plan -> propose_rewards / propose_state_reprs / propose_actions / generate_envs
         -> candidates (cartesian product of the roles that proposed something)
         -> prepare_candidates (how they train: e.g. continuing an earlier policy)
         -> preflight (reward programs checked, vetted on reference episodes, repaired)
         -> executor trains each (per-step hooks run inside as TorchRL transforms)
         -> fitness on the task's ground truth -> reflect -> next iteration

With no plugin enabled there is one iteration with one candidate: plain PPO on the
env's own reward. A plugin whose ``iterations`` are over is no longer asked to plan,
propose or reflect (:meth:`Loop.retired`).

Arriving proposals: a proposal hook may return an iterator of groups of parts instead
of a list (Eureka does: each group is the samples of one LLM request, as it lands). When
that role is the only one proposing, and no plugin prepares or trains candidates
jointly, the loop checks (preflight) and submits each group's candidates as it arrives,
so a pool's workers train the first samples while the LLM writes the rest
(:meth:`Loop.train_each`; in process, training only starts earlier; Ray takes the
whole round first). ``train/overlap_s`` is how long workers trained while the loop waited
on the LLM, ``llm/overlap_s`` how long LLM requests ran while the loop worked (trained in
process, checked programs). Otherwise the loop reads the iterators to their end first,
and nothing changes.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.config import config_key
from core.context import RunContext
from core.contributions import Contribution, contributions
from core.executor import Executor, Runtime, TrainJob, build_runtime, make_executor
from core.preflight import preflight
from core.progress import LLMCallView, make_progress
from core.records import Candidate, IterationResult, Plan, StartPolicy, TrainResult
from core.registry import call_each, call_first
from core.sandbox import hide_from_programs
from core.store import ResultStore, job_key, results_path
from core.tracking import Tracker, format_llm_call, tracking_failure

log = logging.getLogger("core.loop")

#: the jobs a run's executor is made for: any number (it sizes each batch itself)
RUN_JOBS = sys.maxsize

#: proposal hook -> the Candidate field it fills
ROLE_HOOKS = {
    "propose_rewards": "reward",
    "propose_state_reprs": "state",
    "propose_actions": "macros",
    "generate_envs": "envs",
}


@dataclass
class RunSummary:
    """What ``python -m core`` prints at the end."""

    fitness_name: str
    fitness: float
    frames: int
    seconds: float
    candidates: int
    failed: int
    run_id: str
    ui_hint: str
    best_id: str = ""
    final_fitness: list[float] = field(default_factory=list)
    llm: dict[str, float] = field(default_factory=dict)
    reused: int = 0  # trainings taken from an earlier identical run (resume=true)
    results_store: str = ""  # where finished trainings are kept (and reused from)
    first_error: str = ""  # the first failed candidate's error, shown when nothing succeeded
    rejected: int = 0  # candidates from replies that held no usable program (recorded, not trained; within ``failed``)
    llm_cache: str = ""  # the LLM reply cache the run read and wrote ("" when it made no LLM call or had none)
    contributions: list[Contribution] = field(default_factory=list)  # per plugin, what its LLM put into the run

    @property
    def counts(self) -> str:
        """``8 sampled, 6 usable, 5 trained``: candidates, those not rejected, those that trained."""
        return (
            f"{self.candidates} sampled, {self.candidates - self.rejected} usable, "
            f"{self.candidates - self.failed} trained"
        )


def combine(iteration: int, proposals: dict[str, list[Any]], previous_best: Candidate | None) -> list[Candidate]:
    """Candidates from the roles' alternatives: their cartesian product.

    A role that proposed nothing this iteration keeps the previous best candidate's part
    (or the task's default when there is none).
    """
    roles = list(ROLE_HOOKS.values())
    choices: list[list[Any]] = []
    for role in roles:
        options = proposals.get(role) or []
        if options:
            choices.append(options)
        elif previous_best is not None:
            choices.append([getattr(previous_best, role)])
        else:
            choices.append([[] if role in ("macros", "envs") else None])
    candidates = []
    for i, combo in enumerate(itertools.product(*choices)):
        parts = dict(zip(roles, combo))
        candidates.append(Candidate(id=f"it{iteration}-c{i}", iteration=iteration, **parts))
    return candidates


class Loop:
    """Runs one experiment run: iterations of propose -> train -> reflect."""

    def __init__(self, config: DictConfig, runtime: Runtime | None = None, tracker: Tracker | None = None) -> None:
        self.config = config
        self.container: dict[str, Any] = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
        self.container.pop("hydra", None)
        self.run_key = uuid.uuid4().hex
        self.runtime = runtime or build_runtime(self.container, run_key=self.run_key)
        self.runtime.run_key = self.runtime.run_key or self.run_key
        self.settings = self.runtime.settings
        self.tracker = tracker
        self.store_path = results_path(self.settings)
        self.store = ResultStore(self.store_path) if self.settings.run.resume else None
        self.reused = 0
        self._executor: Executor | None = None  # made on first use (:meth:`executor`), closed at the run's end
        self.overlap_s = 0.0  # how long the last training's workers trained while the loop waited on the LLM
        self._llm_calls = 0  # LLM calls of this process logged so far
        self._training_llm: dict[str, float] = {}  # LLM totals of the trainings this run made
        self._llm_view = LLMCallView()  # a live line per LLM call, on the run's progress
        self._outer: Any = None  # the iteration bar while iterating
        self.run = RunContext(
            settings=self.settings,
            task=self.runtime.task,
            seed=self.settings.run.seed,
            pluginmanager=self.runtime.pluginmanager,
            llm_factory=self._make_llm,
            tracker=tracker,
            iterations=self.settings.iterations,
        )

    def _make_llm(self) -> Any:
        from core.llm import make_client

        return make_client(
            self.config.llm,
            on_call=self._log_llm_call,
            on_progress=self._llm_view if self.settings.run.progress else None,
            scope=config_key(self.config),  # a replay finds a reply by its place in this run
        )

    def _log_llm_call(self, record: Any) -> None:
        if self.tracker is None:
            return
        self._llm_calls += 1
        self.tracker.log_text(format_llm_call(record), f"llm/{self._llm_calls:04d}-{record.tag or 'call'}.md")

    def executor(self, progress: Any = None) -> Executor:
        """The run's executor, made on first use and kept for the run (workers start once per run).

        It sizes each batch itself (``workers: auto`` to the free cores; a batch of one
        trains in this process), so it is made for no particular number of jobs.
        """
        if self._executor is None:
            self._executor = make_executor(self.config.executor, self.runtime, RUN_JOBS, progress)
        return self._executor

    # -- one iteration ------------------------------------------------------------------
    def retired(self, iteration: int) -> frozenset[str]:
        """The plugins whose ``iterations`` are over at ``iteration``: the loop no longer asks them to
        plan, propose or reflect (a plugin never checks its own ``iterations``)."""
        return frozenset(name for name, cfg in self.settings.plugins.items() if iteration >= cfg.iterations)

    def propose(self, iteration: int, sources: dict[str, list[Iterable[list[Any]]]] | None = None) -> list[Candidate]:
        """The iteration's candidates, every proposal read to its end (see :func:`combine`);
        ``sources``: the proposal hooks' answers when :meth:`_ask` was called already."""
        return self._combined(iteration, self._ask(iteration) if sources is None else sources)

    def _ask(self, iteration: int) -> dict[str, list[Iterable[list[Any]]]]:
        """Make the plan and call the proposal hooks: per role, each proposing plugin's groups
        of parts (a list holding its one list, or its iterator of groups, not read yet)."""
        run, pm = self.run, self.runtime.pluginmanager
        run.plan = Plan.of(call_first(pm, "plan", skip=self.retired(iteration), run=run, iteration=iteration))
        if run.plan is not None and self.tracker is not None:
            self.tracker.log_text(run.plan.text, f"plan/it{iteration}.md")
        return {role: self._proposals(name, iteration) for name, role in ROLE_HOOKS.items()}

    def _combined(self, iteration: int, sources: dict[str, list[Iterable[list[Any]]]]) -> list[Candidate]:
        hook, run = self.run.hook, self.run
        proposals = {
            role: [p for source in groups for group in source for p in group] for role, groups in sources.items()
        }
        previous = run.best[0] if run.best else None
        rejected = {role: [p for p in options if _rejected(p)] for role, options in proposals.items()}
        proposals = {role: [p for p in options if not _rejected(p)] for role, options in proposals.items()}
        candidates = combine(iteration, proposals, previous)
        for c in candidates:
            c.plan = run.plan
        hook.prepare_candidates(run=run, candidates=candidates)
        # a reply with no usable program: a candidate of its own that is recorded, never trained
        for role, part in ((role, part) for role, parts in rejected.items() for part in parts):
            candidates.append(
                Candidate(id=f"it{iteration}-c{len(candidates)}", iteration=iteration, plan=run.plan, **{role: part})
            )
        return candidates

    def _proposals(self, hook: str, iteration: int) -> list[Iterable[list[Any]]]:
        """Every plugin's alternatives for one role (proposal hook ``hook``), each part marked with its
        plugin (``origin``): a list result as one group (``[result]``), an iterator as its groups,
        marked as they are read."""
        out: list[Iterable[list[Any]]] = []
        for name, result in call_each(
            self.runtime.pluginmanager, hook, skip=self.retired(iteration), run=self.run, iteration=iteration
        ):
            if isinstance(result, list):
                if result:
                    out.append([_marked(name, result)])
            elif result is not None:
                out.append(_marked(name, group) for group in result)
        return out

    def _arriving_role(self, sources: dict[str, list[Iterable[list[Any]]]]) -> str | None:
        """The role whose arriving proposals can train as they come (see the module docstring), or None."""
        proposing = [role for role, groups in sources.items() if groups]
        hook = self.run.hook
        if len(proposing) != 1 or hook.prepare_candidates.get_hookimpls() or hook.train_candidates.get_hookimpls():
            return None
        role = proposing[0]
        return role if any(not isinstance(groups, list) for groups in sources[role]) else None

    def _arrivals(
        self, iteration: int, role: str, sources: list[Iterable[list[Any]]]
    ) -> Iterator[tuple[Candidate, TrainResult | None]]:
        """The candidates of one role's groups as they arrive, checked (:func:`preflight`) group by
        group, each with its preflight failure or None; named as :meth:`propose` names them (the
        usable parts in order, then the rejected replies, which come last)."""
        run = self.run
        previous = run.best[0] if run.best else None
        held: list[Any] = []  # rejected replies: candidates after every usable one
        count = 0
        totals: dict[str, int] = {}  # the round's vetting counts, logged as they grow
        for group in (g for source in sources for g in source):
            usable = [p for p in group if not _rejected(p)]
            held += [p for p in group if _rejected(p)]
            fresh = [
                replace(c, id=f"it{iteration}-c{count + j}", plan=run.plan)
                for j, c in enumerate(combine(iteration, {role: usable}, previous) if usable else [])
            ]
            count += len(fresh)
            failed = preflight(run, fresh, totals) if fresh else {}
            yield from ((c, failed.get(c.id)) for c in fresh)
        last = [
            Candidate(id=f"it{iteration}-c{count + j}", iteration=iteration, plan=run.plan, **{role: part})
            for j, part in enumerate(held)
        ]
        failed = preflight(run, last, totals) if last else {}  # a repaired reply trains like any other
        yield from ((c, failed.get(c.id)) for c in last)

    def train(self, candidates: list[Candidate], seed: int, progress: Any) -> list[TrainResult]:
        """Train every candidate (reusing finished trainings), log each as a nested run: :meth:`train_each`
        for candidates that are all there."""
        return self.train_each([(c, None) for c in candidates], seed, progress)[1]

    def _landed(self, key: str, result: TrainResult) -> float:
        """A training came back: keep a successful one in the results store; when (its MLflow run's end)."""
        if self.store is not None and result.ok:
            self._store_put(key, result)
        return time.time()

    def _record(
        self,
        candidates: list[Candidate],
        results: list[TrainResult],
        todo: list[int],
        keys: list[str],
        ended: dict[int, float],
        seed: int,
        skip: frozenset[int] = frozenset(),
    ) -> list[TrainResult]:
        """Each training's result under its candidate's id, logged as a nested run; policies cleaned up.
        ``skip``: candidates whose result is final already (recorded by :func:`preflight`)."""
        final: list[TrainResult] = []
        for i, (candidate, result) in enumerate(zip(candidates, results)):
            assert result is not None
            if i in skip:
                final.append(result)
                continue
            result = replace(result, candidate_id=candidate.id)
            if self.tracker is not None:
                reused = i not in todo and not candidate.rejected
                tags = {"seed": str(seed), "resumed": str(reused), **_reply_tags(candidate)}
                if candidate.start is not None:
                    tags["start_policy"] = f"{candidate.start.source} ({candidate.start.sha256[:12]})"
                if reused:  # say where the reused training was recorded first
                    tags["reused_from_run"] = result.run_id or "unknown"
                    tags["results_store"] = str(self.store_path)
                self._log_candidate(candidate, result, tags, ended.get(i))
                if i in todo and self.store is not None and result.ok and result.run_id:
                    self._store_put(keys[i], result)  # again, now with its MLflow run id
            if i in todo:
                self._count_training_llm(result)
            if (
                i in todo and result.policy_path
            ):  # uploaded by the tracker or wanted by nobody: never left in the temp folder
                Path(result.policy_path).unlink(missing_ok=True)
            final.append(result)
        return final

    def _log_candidate(
        self, candidate: Candidate, result: TrainResult, tags: dict[str, str], ended: float | None
    ) -> None:
        """Record a candidate's nested run; a failure to record it is the candidate's own.

        :meth:`core.tracking.Tracker.log_candidate` does not raise; should a tracker raise all
        the same, ``result`` becomes a ``tracking`` failure, the run it made (or a small one)
        ends FAILED with the reason, and the loop goes on with the next candidate.
        """
        assert self.tracker is not None
        before = result.run_id
        try:
            self.tracker.log_candidate(candidate, result, tags, ended=ended)
        except Exception as exc:  # one candidate's recording never ends the run
            log.warning(
                "candidate %s could not be recorded (%s: %s); the run goes on",
                candidate.id,
                type(exc).__name__,
                str(exc)[:300],
            )
            tracking_failure(result, exc)
            made = result.run_id if result.run_id != before else ""
            try:
                result.run_id = self.tracker.fail_candidate(candidate, result, run_id=made)
            except Exception:  # a tracker without it, or one that fails again
                result.run_id = made

    def _store_put(self, key: str, result: TrainResult) -> None:
        """Keep a result in the results store; one that cannot be kept is said in the log, and the run goes on."""
        assert self.store is not None
        try:
            self.store.put(key, result)
        except Exception as exc:  # the store is for resuming: losing an entry costs a retraining
            log.warning(
                "candidate %s: the results store could not keep its result (%s: %s)",
                result.candidate_id,
                type(exc).__name__,
                str(exc)[:300],
            )

    def train_each(
        self, arrivals: Iterable[tuple[Candidate, TrainResult | None]], seed: int, progress: Any, expected: int = 0
    ) -> tuple[list[Candidate], list[TrainResult]]:
        """Train candidates as they arrive, each with its preflight failure or None: the loop's one
        training path. :meth:`_arrivals` yields them while the LLM writes the next; a list is
        there at once.

        Each candidate's result is the results store's when an identical training finished
        before (``resume``), a ``rejected`` failure for a reply that held no usable program,
        its preflight failure (recorded by :func:`preflight`, not trained), or else a
        training: the ``train_candidates`` hook's for a population method, the run's
        executor's for the rest, each handed over once it is there. Every result that
        preflight did not record is logged as a nested run.

        :param expected: about how many will arrive when ``arrivals`` is an iterator (0:
            unknown), for sizing the executor.
        :return: the candidates in arrival order and their results.
        """
        listed = isinstance(arrivals, list)
        expected = len(arrivals) if isinstance(arrivals, list) else expected  # a list: exactly
        candidates: list[Candidate] = []
        keys: list[str] = []
        results: list[TrainResult | None] = []
        todo: list[int] = []  # candidates handed on for training, in the order they were
        checked: set[int] = set()  # candidates that failed preflight (recorded there)
        ended: dict[int, float] = {}  # when each training came back (its MLflow run's end)
        # no total while more may come: "1/?", never "1/1" with a second on its way
        bar = progress.add_task("candidates", total=expected if listed else None) if progress else None
        share = 1 / expected if listed and expected and progress is not None and self._outer is not None else 0.0

        def jobs() -> Iterator[TrainJob]:
            for candidate, failed in arrivals:
                i = len(candidates)
                candidates.append(candidate)
                keys.append(job_key(candidate, self.container, seed, self.runtime.fingerprint))
                known = failed or (
                    TrainResult(candidate.id, ok=False, error=candidate.rejected, error_kind="rejected")
                    if candidate.rejected
                    else self.store.get(keys[i])
                    if self.store
                    else None
                )
                results.append(known)
                if failed is not None:
                    checked.add(i)
                if progress is not None and known is not None:
                    progress.advance(bar)
                if known is None:
                    todo.append(i)
                    yield TrainJob(self.container, candidate, seed, self.runtime.run_key)
                elif not failed and not candidate.rejected:
                    self.reused += 1
            if progress is not None:  # every candidate is in
                progress.update(bar, total=len(candidates))

        def finish(i: int, result: TrainResult) -> None:  # candidate i's training came back
            results[i], ended[i] = result, self._landed(keys[i], result)
            if progress is not None:
                progress.advance(bar)
                if share:  # the iteration bar moves by each candidate's share
                    progress.advance(self._outer, share)

        pending: Iterable[TrainJob] = list(jobs()) if listed else jobs()  # a list: no executor for nothing to train
        if share and len(todo) < len(candidates):  # those settled already (reused, rejected) move it at once
            progress.advance(self._outer, (len(candidates) - len(todo)) * share)
        sent = todo  # the candidates of the executor's jobs, in order
        if isinstance(pending, list) and pending and self.run.hook.train_candidates.get_hookimpls():
            # a population method takes its candidates first; None in place of each it leaves to the executor
            joint = self.run.hook.train_candidates(run=self.run, candidates=[candidates[i] for i in todo], seed=seed)
            left = list(range(len(todo))) if joint is None else [j for j, r in enumerate(joint) if r is None]
            for i, result in zip(todo, joint or []):
                if result is not None:
                    finish(i, result)
            pending, sent = [pending[j] for j in left], [todo[j] for j in left]
        self.overlap_s = 0.0
        if not isinstance(pending, list) or pending:
            executor = self.executor(progress)
            executor.overlap_s = 0.0
            executor.stream(pending, lambda k, result: finish(sent[k], result), expected=expected)
            self.overlap_s = executor.overlap_s
        if progress is not None:
            progress.remove_task(bar)
        return candidates, self._record(candidates, results, todo, keys, ended, seed, frozenset(checked))  # type: ignore[arg-type]

    def iterate(self, iteration: int, progress: Any = None) -> IterationResult:
        """One outer iteration: propose, train, score, reflect (each plugin's text under its name)."""
        run, hook = self.run, self.run.hook
        hook.on_iteration_start(run=run, iteration=iteration)
        sources = self._ask(iteration)
        role = self._arriving_role(sources)
        arrivals: Iterable[tuple[Candidate, TrainResult | None]]
        if role is not None:  # train the first proposals while the rest arrive
            arrivals = self._arrivals(iteration, role, sources[role])
        else:
            proposed = self.propose(iteration, sources)
            rejected = preflight(run, proposed)  # reward programs checked, vetted and repaired before any RL
            arrivals = [(c, rejected.get(c.id)) for c in proposed]
        # about as many as last iteration when they arrive (unknown at first: the pool sizes to the free cores)
        candidates, results = self.train_each(
            arrivals, run.seed, progress, expected=len(run.history[-1].candidates) if run.history else 0
        )
        # trainings in workers while the loop waited on the LLM for the next samples
        run.log_metrics({"train/overlap_s": self.overlap_s}, step=iteration)
        result = IterationResult(iteration, candidates, results)
        run.history.append(result)
        for plugin, text in call_each(
            self.runtime.pluginmanager, "reflect", skip=self.retired(iteration), run=run, result=result
        ):
            if text:
                run.log_text(f"reflection/it{iteration}-{plugin}.md", text)
        best = run.best
        if best is not None:
            run.log_metrics({"best_fitness": best[1].score, "iteration_best": _iteration_best(result)}, step=iteration)
        self._log_llm_stats(step=iteration)
        hook.on_iteration_end(run=run, result=result)
        return result

    # -- the whole run ----------------------------------------------------------------
    def execute(self) -> RunSummary:
        start = time.perf_counter()
        run, hook = self.run, self.run.hook
        hook.on_run_start(run=run)
        with make_progress(enabled=self.settings.run.progress) as progress:
            self._llm_view.attach(progress)
            self._outer = outer = progress.add_task("iterations", total=run.iterations) if progress else None
            for iteration in range(run.iterations):
                self.iterate(iteration, progress)
                if progress is not None and outer is not None:
                    progress.update(outer, completed=iteration + 1)
            self._outer = None
            final = self.final_seeds(progress)
            self._llm_view.attach(None)
        if self._executor is not None:
            self._executor.close()
        best = run.best
        hook.on_run_end(run=run, best=best)
        return self.summarize(best, final, time.perf_counter() - start)

    def final_seeds(self, progress: Any) -> list[float]:
        """Retrain the best candidate on ``final_seeds`` more seeds (Eureka's final evaluation).

        A candidate that continues earlier ones' policy (``start``) is retrained with its
        whole chain, oldest first, each continuing the fresh seed's previous training.

        Logs ``final/fitness_mean`` over the search's score and the fresh seeds together,
        ``final/fresh_mean`` over the fresh seeds alone (the chosen candidate's score free of
        the selection), and what the retraining cost: ``final/frames``, ``final/seconds``.
        """
        n = self.settings.final_seeds
        best = self.run.best
        if n <= 0 or best is None:
            return []
        start = time.perf_counter()
        fresh, frames = [], 0
        chain = self.lineage(best[0])
        for k in range(1, n + 1):
            seed, policy = self.run.seed + k, None
            for j, member in enumerate(chain):  # a continued candidate: its whole chain, on the fresh seed
                candidate = replace(
                    member,
                    id=f"{member.id}-seed{seed}",
                    start=policy,
                    keep_policy=member.keep_policy or j < len(chain) - 1,
                )
                (result,) = self.train([candidate], seed, progress)
                frames += result.frames
                if not result.ok:
                    break
                policy = StartPolicy.of(candidate, result) if j < len(chain) - 1 else None
            fresh.append(result.score)
        values = [best[1].score, *fresh]
        self.run.log_metrics(
            {
                "final/fitness_mean": sum(values) / len(values),
                "final/seeds": len(values),
                "final/fresh_mean": sum(fresh) / len(fresh),
                "final/frames": frames,
                "final/seconds": time.perf_counter() - start,
            }
        )
        return values

    def lineage(self, candidate: Candidate) -> list[Candidate]:
        """The candidates whose trainings ``candidate`` continues, oldest first, then itself."""
        by_id = {c.id: c for it in self.run.history for c in it.candidates}
        chain = [candidate]
        while chain[0].start is not None and chain[0].start.source in by_id:
            chain.insert(0, by_id[chain[0].start.source])
        return chain

    def _count_training_llm(self, result: TrainResult) -> None:
        """Add the LLM calls a training made (``llm/*`` of its series, see :func:`core.executor.run_job`)."""
        for key, points in result.series.items():
            if key.startswith("llm/") and points:
                self._training_llm[key] = self._training_llm.get(key, 0.0) + points[-1][1]

    def _log_llm_stats(self, step: int | None = None) -> dict[str, float]:
        """The run's LLM totals: the loop's own calls and those its trainings made (a judge's, a labeller's)."""
        metrics = self.run.llm_metrics()
        for key, value in self._training_llm.items():
            metrics[key] = metrics.get(key, 0.0) + value
        if metrics:
            self.run.log_metrics(metrics, step=step)
        return metrics

    def summarize(self, best: tuple[Candidate, TrainResult] | None, final: list[float], seconds: float) -> RunSummary:
        results = [r for it in self.run.history for r in it.results]
        frames = sum(r.frames for r in results)
        fitness = best[1].score if best else float("nan")
        name = best[1].fitness.name if best and best[1].fitness else self.run.task.fitness_name
        llm = self._log_llm_stats()
        rejected = sum(r.error_kind == "rejected" for r in results)
        pairs = [(c, r) for it in self.run.history for c, r in zip(it.candidates, it.results)]
        # what an LLM's code put into training: candidates that trained with a program an LLM wrote
        llm_trained = sum(r.ok and any(getattr(p, "reply", "") for _, p in c.programs) for c, r in pairs)
        llm_cache = self._llm_cache() if llm else ""
        writers = frozenset(impl.plugin_name for impl in self.run.hook.generate_envs.get_hookimpls())
        parts = contributions(sorted((self.config.get("plugins") or {}).keys()), pairs, best, writers)
        if self.tracker is not None and parts:
            self.tracker.set_tags({f"llm4rl.contribution.{c.plugin}": c.text[:250] for c in parts})
        if self.tracker is not None:
            if llm_cache:  # where the replies were kept (and where cache hits came from)
                self.tracker.set_tags({"llm.cache": llm_cache})
            self.tracker.log_metrics(
                {
                    "fitness": fitness,
                    "frames": frames,
                    "seconds": seconds,
                    "candidates": len(results),
                    "candidates_rejected": rejected,
                    "candidates_trained": sum(r.ok for r in results),
                    "llm_programs_trained": llm_trained,
                }
            )
            self.tracker.set_tags({"best_candidate": best[0].id if best else "none", "fitness_name": name})
            self.tracker.describe_run(
                task=self.run.task.name,
                fitness_name=name,
                history=self.run.history,
                best=best,
                llm=llm,
                seconds=seconds,
                final=final,
            )
            curves = {f"{c.id}": r.curve for it in self.run.history for c, r in zip(it.candidates, it.results) if r.ok}
            if curves and self.config.tracking.get("log_plots", True):
                from core.plots import learning_curve

                self.tracker.log_figure(
                    learning_curve(curves, title=f"{self.run.task.name}: {name}"), "learning_curves.png"
                )
        return RunSummary(
            fitness_name=name,
            fitness=fitness,
            frames=frames,
            seconds=seconds,
            candidates=len(results),
            failed=sum(not r.ok for r in results),
            run_id=self.tracker.parent_id if self.tracker else "",
            ui_hint=self.tracker.ui_hint() if self.tracker else "",
            best_id=best[0].id if best else "",
            final_fitness=final,
            llm=llm,
            reused=self.reused,
            results_store=str(self.store_path) if self.store is not None else "",
            first_error=next((r.error for r in results if not r.ok), ""),
            rejected=rejected,
            llm_cache=llm_cache,
            contributions=parts,
        )

    def _llm_cache(self) -> str:
        """The LLM reply cache file of this run ("" with llm.cache=false)."""
        from core.llm.client import cache_file

        llm = self.config.get("llm") or {}
        return str(cache_file(llm.get("cache_path"))) if llm.get("cache", True) else ""


def _marked(name: str, group: list[Any]) -> list[Any]:
    """``group``'s parts with ``origin=name`` where they name none (a macro-action's program too)."""
    for item in group:
        for part in item if isinstance(item, list) else [item]:
            program: Any = getattr(part, "program", part)
            if hasattr(program, "origin") and not program.origin:
                program.origin = name
    return group


def _rejected(part: Any) -> bool:
    """Whether a proposed part (a program, a macro-action list) holds a rejected reply."""
    parts = part if isinstance(part, list) else [part]
    return any(getattr(getattr(p, "program", p), "rejected", "") for p in parts)


def _reply_tags(candidate: Candidate) -> dict[str, str]:
    """Tags that link a candidate to the LLM replies it came from, and say why it did not train.

    ``sample`` (the reply's index in its LLM call; ``reward:3,state:1`` when several roles
    have one), ``llm_call`` (the call's tag, as in the ``llm/`` records), ``renamed_from``,
    ``name_fixes`` (the names :mod:`core.namecheck` mended), and for a rejected reply
    ``status=rejected``, ``rejected_kind`` and the reason's first line.
    """
    tags: dict[str, str] = {}
    programs = candidate.programs
    samples = [(role, p.meta["sample"]) for role, p in programs if "sample" in p.meta]
    if samples:
        tags["sample"] = str(samples[0][1]) if len(samples) == 1 else ",".join(f"{r}:{i}" for r, i in samples)
    calls = sorted({str(p.meta["call"]) for _, p in programs if p.meta.get("call")})
    if calls:
        tags["llm_call"] = ",".join(calls)
    renamed = [f"{p.meta['renamed_from']} -> {p.entry}" for _, p in programs if p.meta.get("renamed_from")]
    if renamed:
        tags["renamed_from"] = ", ".join(renamed)
    fixes = [fix for _, p in programs for fix in p.meta.get("fixes", ())]
    if fixes:  # what core.namecheck mended before the program ran
        tags["name_fixes"] = "; ".join(fixes)[:1000]
    if candidate.rejected:
        tags["status"] = "rejected"
        tags["rejected_kind"] = ",".join(str(p.meta.get("rejected_kind", "other")) for _, p in programs if p.rejected)
        tags["rejected"] = candidate.rejected.strip().splitlines()[0][:250]
    return tags


def _iteration_best(result: IterationResult) -> float:
    best = result.best
    return best[1].score if best else float("nan")


def run_folders(config: DictConfig, settings: Any) -> list[str]:
    """The run's own folders and files besides MLflow's: Hydra's output folder, the results store, the LLM cache."""
    from hydra.core.hydra_config import HydraConfig

    from core.llm.client import cache_file

    found = [str(results_path(settings))]
    if HydraConfig.initialized():
        found.append(str(HydraConfig.get().runtime.output_dir))
    llm = config.get("llm") or {}
    if llm.get("cache", True):
        found.append(str(cache_file(llm.get("cache_path"))))
    return found


def run_experiment(
    config: DictConfig, extra_plugins: tuple[object, ...] = (), tags: dict[str, str] | None = None
) -> RunSummary:
    """Run one experiment as the config describes; the programmatic entry point.

    ``tags`` are added to the MLflow parent run's own (``plugins``, ``env``, ``seed``), e.g.
    a study's arm and cell (:mod:`core.study`).
    """
    from core.quiet import quiet_third_party

    quiet_third_party()
    container: dict[str, Any] = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
    container.pop("hydra", None)
    runtime = build_runtime(container, extra_plugins, run_key=uuid.uuid4().hex)  # validates before any work
    tracker = Tracker(config.tracking, config.experiment)
    hide_from_programs(*tracker.local_paths(), *run_folders(config, runtime.settings))
    plugins = sorted((config.get("plugins") or {}).keys())
    run_tags = {
        "plugins": ",".join(plugins) or "none",
        "env": str(config.env.name),
        "seed": str(config.seed),
        **(tags or {}),
    }
    name = config.get("run_name") or f"{'+'.join(plugins) or 'baseline'}-{config.env.name}-s{config.seed}"
    with tracker.experiment_run(config, name, run_tags):
        return Loop(config, runtime, tracker).execute()
