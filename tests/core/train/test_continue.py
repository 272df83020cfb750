"""Continuing a policy: a training that starts from another's final state, keeps its own,
finishes on the original env, and is keyed and chosen accordingly."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from core.context import RunContext
from core.records import Candidate, EnvConfig, Fitness, IterationResult, StartPolicy, TrainResult
from core.store import job_key
from core.train import ppo


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """candidate id -> (flat parameters before, after) per training stage, as the trainer ran them."""
    record: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    stage = ppo._Run.train_stage

    def spy(self: ppo._Run, batches: int) -> None:
        before = self.model.params.clone()
        # the modules' parameters are still views of the flat tensor that the update steps
        storage = self.model.params.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == storage for p in self.nets.parameters())
        stage(self, batches)
        record.setdefault(self.candidate.id, []).append((before, self.model.params.clone()))

    monkeypatch.setattr(ppo._Run, "train_stage", spy)
    return record


def test_a_continued_training_starts_from_the_previous_final_state(task, tiny_cfg, seen):
    first = ppo.train(task, Candidate("a", 0, keep_policy=True), tiny_cfg, seed=0)
    assert first.ok and first.final_policy, first.error
    start = StartPolicy.of(Candidate("a", 0), first)
    assert start.frames == first.frames and start.source == "a"
    second = ppo.train(task, Candidate("b", 1, start=start, keep_policy=True), tiny_cfg, seed=0)
    assert second.ok, second.error
    ((_, a_final),) = seen["a"]
    ((b_initial, b_final),) = seen["b"]
    assert torch.equal(b_initial, a_final)  # actor and critic, exactly
    assert not torch.equal(b_final, b_initial)  # and it trained on
    state = torch.load(__import__("io").BytesIO(second.final_policy), weights_only=True)
    assert state["frames"] == first.frames + second.frames  # counted over the chain
    assert state["optimizer"]["steps"] > 0 and second.metrics["train/start_frames"] == first.frames
    assert StartPolicy.of(Candidate("b", 1, start=start), second).frames == first.frames + second.frames


def test_a_fresh_training_does_not_start_from_a_kept_policy(task, tiny_cfg, seen):
    first = ppo.train(task, Candidate("a", 0, keep_policy=True), tiny_cfg, seed=0)
    fresh = ppo.train(task, Candidate("b", 1), tiny_cfg, seed=0)
    assert fresh.ok and fresh.final_policy == b""  # kept only when asked
    assert torch.equal(seen["b"][0][0], seen["a"][0][0])  # the same seed's initialisation
    assert not torch.equal(seen["b"][0][0], seen["a"][0][1])
    assert first.ok


def test_adam_state_continues(task, tiny_cfg):
    first = ppo.train(task, Candidate("a", 0, keep_policy=True), tiny_cfg, seed=0)
    run = ppo._Run(
        task,
        Candidate("b", 1, start=StartPolicy.of(Candidate("a", 0), first)),
        tiny_cfg,
        0,
        None,
        None,
        None,
        TrainResult("b", False),
    )
    saved = run.start_state()
    assert saved is not None
    batches = tiny_cfg.frames // tiny_cfg.frames_per_batch
    assert int(saved["optimizer"]["steps"]) == batches * tiny_cfg.epochs * (
        tiny_cfg.frames_per_batch // tiny_cfg.minibatch
    )


def test_a_start_policy_that_does_not_fit_fails_the_candidate(task, tiny_cfg):
    first = ppo.train(task, Candidate("a", 0, keep_policy=True), tiny_cfg, seed=0)
    start = StartPolicy.of(Candidate("a", 0), first)
    wider = ppo.train(task, Candidate("b", 1, start=start), replace(tiny_cfg, hidden=[32]), seed=0)
    assert not wider.ok and "does not fit" in wider.error
    tampered = ppo.train(task, Candidate("c", 1, start=replace(start, sha256="0" * 64)), tiny_cfg, seed=0)
    assert not tampered.ok and "sha256" in tampered.error


def test_start_policy_of_a_result_without_weights_says_why():
    with pytest.raises(ValueError, match="keep_policy"):
        StartPolicy.of(Candidate("a", 0), TrainResult("a", True))
    with pytest.raises(ValueError, match="failed"):
        StartPolicy.of(Candidate("a", 0), TrainResult("a", False, final_policy=b"x"))


def test_own_frames_and_the_original_env_last(task, tiny_cfg, seen):
    """``frames`` is the candidate's budget; ``original_after`` trains the last share of it on the original env."""
    cfg = replace(tiny_cfg, frames=100_000)
    result = ppo.train(task, Candidate("a", 0, frames=4 * cfg.frames_per_batch, original_after=0.25), cfg, seed=0)
    assert result.ok, result.error
    assert result.frames == 4 * cfg.frames_per_batch
    assert len(seen["a"]) == 2  # two stages (CartPole has no params: both on the original env), one network
    assert torch.equal(seen["a"][1][0], seen["a"][0][1])
    mix = [EnvConfig("other", {"size": 2}, weight=1.0)]
    stages = ppo._Run(
        task,
        Candidate("x", 0, envs=mix, frames=4 * cfg.frames_per_batch, original_after=0.25),
        replace(cfg, frames=4 * cfg.frames_per_batch),
        0,
        None,
        None,
        None,
        TrainResult("x", False),
    ).stages()
    assert [(c.envs, n) for c, n in stages] == [(mix, 3), ([], 1)]
    whole = ppo._Run(
        task, Candidate("y", 0, envs=mix, original_after=1.0), cfg, 0, None, None, None, TrainResult("y", False)
    )
    assert [(c.envs, n) for c, n in whole.stages()] == [([], cfg.frames // cfg.frames_per_batch)]


def test_a_chain_follows_one_learning_rate_schedule(task, tiny_cfg, monkeypatch):
    """Two halves of a budget, the second continuing the first, anneal like one training of the whole."""
    rates: dict[str, list[float]] = {}
    update = ppo._Run._update

    def spy(self, frames, optim, clip):
        rates.setdefault(self.candidate.id, []).append(optim.lr)
        return update(self, frames, optim, clip)

    monkeypatch.setattr(ppo._Run, "_update", spy)
    half = tiny_cfg.frames // 2
    ppo.train(task, Candidate("whole", 0), tiny_cfg, seed=0)
    first = ppo.train(task, Candidate("a", 0, frames=half, keep_policy=True), tiny_cfg, seed=0)
    ppo.train(task, Candidate("b", 1, frames=half, start=StartPolicy.of(Candidate("a", 0), first)), tiny_cfg, seed=0)
    assert rates["a"] + rates["b"] == pytest.approx(rates["whole"])


def test_the_store_key_names_the_start_policy_by_its_weights():
    config = {"env": {"name": "cartpole"}, "trainer": {"frames": 512}}
    start = StartPolicy("it0-c0", b"weights", "a" * 64, 256)
    base = Candidate("it1-c0", 1, start=start, frames=256, keep_policy=True)
    key = job_key(base, config, 0)
    assert job_key(replace(base, id="other", start=replace(start, source="elsewhere")), config, 0) == key
    assert job_key(replace(base, start=replace(start, sha256="b" * 64)), config, 0) != key
    assert job_key(replace(base, start=None), config, 0) != key
    assert job_key(replace(base, frames=512), config, 0) != key
    assert job_key(replace(base, original_after=0.5), config, 0) != key
    assert job_key(replace(base, keep_policy=False), config, 0) != key  # a result without weights cannot start a chain
    assert pickle.loads(pickle.dumps(base)) == base  # it travels to worker processes


def _history(*iterations: list[tuple[Candidate, float | None]]) -> list[IterationResult]:
    out = []
    for k, pairs in enumerate(iterations):
        out.append(
            IterationResult(
                k,
                [c for c, _ in pairs],
                [
                    TrainResult(c.id, s is not None, fitness=Fitness("f", s) if s is not None else None)
                    for c, s in pairs
                ],
            )
        )
    return out


def test_the_best_is_a_policy_no_later_training_continued():
    a = Candidate("it0-c0", 0, keep_policy=True)
    side = Candidate("it0-c1", 0)
    b = Candidate("it1-c0", 1, start=StartPolicy("it0-c0", b"", "", 0))
    run = RunContext(settings=None, task=None, seed=0, history=_history([(a, 9.0), (side, 1.0)], [(b, 5.0)]))  # type: ignore[arg-type]
    assert run.best[0] is b  # a scored higher, but its training went on in b
    run = RunContext(settings=None, task=None, seed=0, history=_history([(a, 9.0)], [(b, None)]))  # type: ignore[arg-type]
    assert run.best[0] is a  # b failed: a is the last policy that trained
    plain = RunContext(settings=None, task=None, seed=0, history=_history([(side, 1.0)], [(Candidate("x", 1), 3.0)]))  # type: ignore[arg-type]
    assert plain.best[0].id == "x"
