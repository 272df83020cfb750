"""Training overlapped with the LLM wait: samples handed over in groups as they land, and
the loop training the first candidates while the rest are sampled."""

from __future__ import annotations

import itertools
import math
import time
import uuid
from typing import Any

import pytest
from omegaconf import OmegaConf

from core import hookimpl
from core.executor import build_runtime
from core.llm.client import LLMClient, covered
from core.loop import Loop
from core.testing import fakes
from core.testing.fakes import ScriptedLLM

#: the fake LLM's reward with a weight of its own, so that every sample is a different program
REWARD = fakes.REWARD.format(entry="compute_reward")
NO_CODE = "I would reward the pole for staying up."


def reward(k: int) -> str:
    return REWARD.replace("0.1 * level", f"0.{k} * level")


def client(tmp_path, **settings: Any) -> LLMClient:
    cfg = {
        "model": "openai/fake-llm",
        "api_key_env": None,
        "retries": 0,
        "cache_path": str(tmp_path / "llm"),
        **settings,
    }
    return LLMClient(cfg)


def staggered(monkeypatch, step_s: float):
    """The shared fake backend, each request answering ``step_s`` later than the one before
    and with a text of its own (so a reply can only come back from the cache)."""
    from core.llm.client import import_litellm

    backend = fakes.FakeLiteLLM()
    count = itertools.count(1)

    def completion(**kwargs: Any) -> Any:
        k = next(count)
        time.sleep(step_s * k)
        backend.reply = lambda messages, k=k: reward(k)
        return backend(**kwargs)

    monkeypatch.setattr(import_litellm(), "completion", completion)
    return backend


MESSAGES = [{"role": "user", "content": "Write compute_reward."}]


# -- the client: groups as requests land ---------------------------------------------------------


def test_groups_join_to_the_same_replies_as_chat_and_come_back_from_the_cache(tmp_path, monkeypatch):
    backend = staggered(monkeypatch, 0.0)
    llm = client(tmp_path, max_n=1, concurrency=1)
    groups = list(llm.chat_groups(MESSAGES, n=4, seed=7, tag="t"))
    assert [len(g) for g in groups] == [1, 1, 1, 1]  # one request per sample, each handed over as it lands
    texts = [r.text for g in groups for r in g]
    assert len(set(texts)) == 4 and len(backend.calls) == 4
    assert len(llm.records) == 1 and [r.text for r in llm.records[0].replies] == texts
    again = client(tmp_path, max_n=1, concurrency=1)
    assert [r.text for r in again.chat(MESSAGES, n=4, seed=7, tag="t")] == texts  # chat: the same, in order
    (whole,) = list(again.chat_groups(MESSAGES, n=4, seed=7, tag="t"))  # all cached: one group at once
    assert [r.text for r in whole] == texts and all(r.cached for r in whole)
    assert len(backend.calls) == 4


def test_time_spent_on_a_group_while_requests_run_counts_as_overlap_not_wait(tmp_path, monkeypatch):
    staggered(monkeypatch, 0.3)  # requests land at about 0.3, 0.6 and 0.9 s (3 at once)
    llm = client(tmp_path, max_n=1, concurrency=3, cache=False)
    start = time.perf_counter()
    for _ in llm.chat_groups(MESSAGES, n=3, seed=1):
        time.sleep(0.4)  # the caller works on each group (trains it) while the rest are sampled
    total = time.perf_counter() - start
    assert llm.stats.overlap_s >= 0.3
    assert llm.stats.wait_s <= total - llm.stats.overlap_s + 0.05
    assert llm.stats.as_metrics()["llm/overlap_s"] == llm.stats.overlap_s


def test_requests_made_one_after_another_overlap_nothing(tmp_path, monkeypatch):
    """With one request at a time, the next starts only when the caller asks: no request runs meanwhile."""
    staggered(monkeypatch, 0.1)
    llm = client(tmp_path, max_n=1, concurrency=1, cache=False)
    for _ in llm.chat_groups(MESSAGES, n=3, seed=1):
        time.sleep(0.3)
    assert llm.stats.overlap_s == 0.0 and llm.stats.wait_s >= 0.5


def test_covered_counts_each_second_once():
    assert covered(0.0, 10.0, [(1.0, 3.0), (2.0, 4.0), (8.0, 20.0), (-5.0, -1.0)]) == pytest.approx(5.0)
    assert covered(2.0, 3.0, [(0.0, math.inf)]) == pytest.approx(1.0)
    assert covered(0.0, 1.0, []) == 0.0


# -- the loop: candidates train as their samples arrive --------------------------------------------


class Starts:
    """Registered beside Eureka: when each candidate's training started."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}

    @hookimpl
    def on_train_start(self, train: Any) -> None:
        self.started[train.candidate.id] = time.time()


def eureka_loop(tiny_run, llm: Any = None, *overrides: str) -> tuple[Loop, Starts]:
    cfg = tiny_run(
        "+plugins=[eureka]",
        "plugins.eureka.iterations=1",
        "plugins.eureka.samples=4",
        "resume=false",
        "save_policy=false",
        "progress=false",
        *overrides,
    )
    starts = Starts()
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    loop = Loop(cfg, build_runtime(container, (starts,), run_key=uuid.uuid4().hex))
    if llm is not None:
        loop.run._llm = llm
    return loop, starts


def summary(loop: Loop) -> list[tuple[Any, ...]]:
    (it,) = loop.run.history
    return [
        (
            c.id,
            c.reward.meta.get("sample"),
            c.reward.source,
            bool(c.rejected),
            r.ok,
            r.frames,
            r.error_kind,
            round(r.score, 6) if r.ok else None,
        )
        for c, r in zip(it.candidates, it.results)
    ]


SCRIPT = [reward(1), NO_CODE, reward(2), reward(3)]


def test_the_first_candidates_train_before_the_last_samples_arrive_with_the_same_results(tiny_run, monkeypatch):
    llm = ScriptedLLM(list(SCRIPT), group=1, group_delay_s=0.3)
    loop, starts = eureka_loop(tiny_run, llm, "vetting.repair=0")  # the reply without code stays rejected
    loop.iterate(0)
    assert len(llm.delivered) == 4
    assert min(starts.started.values()) < llm.delivered[-1]  # training began while the LLM still sampled
    assert starts.started["it0-c0"] < llm.delivered[1]  # the first sample trained before the second came
    overlapped = summary(loop)
    # the rejected reply (sample 1) comes last, as when the samples are read to their end first
    assert [(cid, sample, rejected) for cid, sample, _, rejected, *_ in overlapped] == [
        ("it0-c0", 0, False),
        ("it0-c1", 2, False),
        ("it0-c2", 3, False),
        ("it0-c3", 1, True),
    ]
    assert all(row[4] for row in overlapped[:3]) and overlapped[3][6] == "rejected"

    collected, _ = eureka_loop(tiny_run, ScriptedLLM(list(SCRIPT), group=1), "vetting.repair=0")
    monkeypatch.setattr(collected, "_arriving_role", lambda sources: None)  # the path that reads every sample first
    collected.iterate(0)
    assert summary(collected) == overlapped


def test_a_cached_rerun_gives_the_same_candidates(tiny_run, monkeypatch, tmp_path):
    backend = staggered(monkeypatch, 0.2)
    llm_cfg = [*fakes.FAKE_LLM_OVERRIDES, "llm.cache=true", f"llm.cache_path={tmp_path / 'llm'}", "llm.max_n=1"]
    first, _ = eureka_loop(tiny_run, None, *llm_cfg)
    first.iterate(0)
    assert len(backend.calls) == 4
    assert first.run.llm.stats.overlap_s > 0  # the later requests ran while the first candidates trained
    rerun, _ = eureka_loop(tiny_run, None, *llm_cfg)
    rerun.iterate(0)
    assert len(backend.calls) == 4  # every sample from the cache
    assert summary(rerun) == summary(first)
    assert len({row[2] for row in summary(first)}) == 4


@pytest.mark.slow
def test_a_pool_trains_the_first_job_while_the_next_is_awaited(tiny_run):
    from core.executor import PoolExecutor, TrainJob
    from core.records import Candidate

    container = OmegaConf.to_container(tiny_run("save_policy=false", "progress=false"), resolve=True)
    container.pop("hydra", None)
    asked: dict[str, float] = {}

    def jobs():
        yield TrainJob(container, Candidate("it0-c0", 0), 0)
        time.sleep(20)  # the LLM still writing the next sample: time for a worker to start and train the first
        asked["second"] = time.time()
        yield TrainJob(container, Candidate("it0-c1", 0), 0)

    done: dict[int, float] = {}
    pool = PoolExecutor(2)
    try:
        results = pool.stream(jobs(), lambda i, result: done.setdefault(i, time.time()), expected=2)
    finally:
        pool.close()
    assert [r.ok for r in results] == [True, True] and [r.candidate_id for r in results] == ["it0-c0", "it0-c1"]
    assert (
        pool.last_plan == 2 and pool.overlap_s > 0.2
    )  # the first job (a training of under a second) ran during the 20 s wait
    assert done[0] - asked["second"] < 1.0  # had finished during the wait: collected at once after it


def test_a_reply_repaired_before_training_trains_as_when_every_sample_is_read_first(tiny_run, monkeypatch):
    """The reply without code goes back to Eureka (``vetting.repair``) after the usable ones;
    its repair (the script's next reply) trains under the same name on both paths."""
    overlapped, _ = eureka_loop(tiny_run, ScriptedLLM(list(SCRIPT), group=1))
    overlapped.iterate(0)
    collected, _ = eureka_loop(tiny_run, ScriptedLLM(list(SCRIPT), group=1))
    monkeypatch.setattr(collected, "_arriving_role", lambda sources: None)
    collected.iterate(0)
    rows = summary(overlapped)
    assert rows == summary(collected)
    assert rows[3][:2] == ("it0-c3", 1) and rows[3][4] and "0.1 * level" in rows[3][2]  # repaired, trained
