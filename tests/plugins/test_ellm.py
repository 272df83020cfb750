"""ellm: free-form suggestions parsed, cached per caption, matched to step captions by cosine, paid once per episode."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from core import hookimpl
from core.config import typed
from core.context import StepBatch
from core.envs import make_task
from core.envs.crafter import VIEW_IDS
from core.errors import UserError
from core.records import TrainResult
from core.testing import fakes
from core.testing.fakes import ScriptedLLM, make_run, make_train, plugin_object
from plugins import ellm


@pytest.fixture(scope="module")
def task():
    return make_task({"name": "minecraft", "max_episode_steps": 60, "pixels": False})


class FakeEmbedder:
    """A deterministic embedder: texts in ``known`` get their vector, others a unit vector
    drawn from a generator seeded by the text (so nearly orthogonal to everything); calls counted."""

    def __init__(self, known: dict[str, np.ndarray] | None = None, dim: int = 64, fail: bool = False) -> None:
        self.known, self.dim, self.fail = dict(known or {}), dim, fail
        self.calls: list[list[str]] = []

    def vector(self, text: str) -> np.ndarray:
        if text in self.known:
            v = np.asarray(self.known[text], np.float64)
        else:
            v = np.random.default_rng(zlib.crc32(text.encode())).normal(size=self.dim)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def __call__(self, texts, *, model=None, tag=""):
        self.calls.append(list(texts))
        if self.fail:
            raise RuntimeError("embedding backend down")
        return np.stack([self.vector(t) for t in texts])


def axis(k: int, dim: int = 64) -> np.ndarray:
    v = np.zeros(dim)
    v[k] = 1.0
    return v


#: "chop a tree" is 0.9 cosine from "collect wood", "craft a pickaxe" 0.5 (below the default 0.64)
KNOWN = {
    "collect wood": axis(0),
    "chop a tree": 0.9 * axis(0) + np.sqrt(1 - 0.81) * axis(1),
    "craft a pickaxe": 0.5 * axis(0) + np.sqrt(0.75) * axis(2),
    "place table": axis(3),
    "build a table": axis(3),
}


def with_embedder(llm: ScriptedLLM, embedder: FakeEmbedder) -> ScriptedLLM:
    llm.embed = embedder  # the client's embed(texts, model=..., tag=...) API
    return llm


def make(task, llm, **overrides):
    overrides = {"center": False, "presuggest_episodes": 0, "resuggest_at": [], **overrides}
    train = make_train(task, llm, plugin=ellm.NAME, module=ellm, overrides=overrides)
    plugin = ellm.Plugin(train.plugin_config(ellm.NAME))
    plugin.on_train_start(train)
    return plugin, train


#: view cells next to the player (the view is [dx + 4, dy + 3] of a 9x7 window, flattened); the
#: first is the one faced (right)
NEAR = [5 * 7 + 3, 3 * 7 + 3, 4 * 7 + 4, 4 * 7 + 2]


def _obs(task, *, see=(), have=(), done=(), food=9, **counts):
    obs = torch.zeros(task.obs_dim)
    at = {f.name: f for f in task.state_fields}
    obs[at["food"].start] = food
    for v in ("health", "drink", "energy"):
        obs[at[v].start] = 9
    obs[at["facing"].start] = 1  # facing right: NEAR[0]
    view = at["local_view"]
    obs[view.start : view.stop] = VIEW_IDS["grass"]
    for cell, thing in zip(NEAR, see):
        obs[view.start + cell] = VIEW_IDS[thing]
    for item in have:
        obs[at[item].start] = 2
    for item, n in counts.items():
        obs[at[item].start] = n
    for g in done:
        obs[at[f"achievement_{g}"].start] = 1
    return obs


def _batch(task, before, after, done=None, reward=None):
    n = len(before)
    return StepBatch(
        obs=torch.stack(before),
        action=torch.zeros(n),
        next_obs=torch.stack(after),
        env_reward=torch.zeros(n) if reward is None else reward,
        reward=torch.zeros(n) if reward is None else reward,
        done=torch.zeros(n, dtype=torch.bool) if done is None else torch.tensor(done),
        task=task,
    )


def _end(plugin, train) -> dict[str, float]:
    result = TrainResult("c", True)
    plugin.on_train_end(train, result)
    return result.metrics


# -- parsing -------------------------------------------------------------------------------


def test_free_form_suggestions_are_parsed_from_lists_markup_and_explanations():
    reply = (
        "Here are the goals for the player:\n1. **Chop down the tree**: you need wood.\n2) Craft a wooden pickaxe - "
        "needs a table\n- To drink water (you are thirsty)\n* eat cow, place table\n"
        "I think the player should first look around the whole area carefully before doing anything\n1. Eat cow"
    )
    assert ellm.parse_suggestions(reply, 10) == [
        "chop down the tree",
        "craft a wooden pickaxe",
        "drink water",
        "eat cow",
        "place table",
    ]
    assert ellm.parse_suggestions(reply, 2) == ["chop down the tree", "craft a wooden pickaxe"]
    assert ellm.parse_suggestions("Goals:\ncollect wood; place table", 5) == ["collect wood", "place table"]
    # a long line keeps its goal before the means or purpose; "go to sleep" is short enough to stay whole
    assert ellm.parse_suggestions(
        "1. Chop the tree with the wood pickaxe.\nCut the sapling to make a branch.\n3. go to sleep", 5
    ) == ["chop the tree", "cut the sapling", "go to sleep"]


def test_the_aim_is_the_goals_first_clause_in_plain_words(task):
    assert (
        ellm.plain_aim(task.goal)
        == "Survive in the Crafter world and unlock as many of its 22 achievements as possible."
    )
    assert ellm.plain_aim("Balance the pole") == "Balance the pole."
    assert ellm.parse_suggestions("", 3) == [] and ellm.parse_suggestions(fakes.ellm_goals("x"), 5) == [
        "sleep",
        "collect sapling",
        "place plant",
        "collect wood",
    ]


def test_names_variant_reads_only_the_tasks_goal_names(task):
    names = [g for g in ellm.goal_names(task)]
    found = ellm.parse_goal_names("1. Collect Wood\n- place_table\n- build a castle\nthen eat_cow", names, 5)
    assert found == ["collect_wood", "place_table", "eat_cow"]


# -- suggestions -----------------------------------------------------------------------------


def test_the_prompt_asks_for_free_form_goals_and_the_answer_is_cached_per_caption(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree\n2. Build a table"), FakeEmbedder(KNOWN))
    plugin, train = make(task, llm)
    goals = train.state[ellm.NAME]
    caption = task.caption(_obs(task, see=["tree"]).numpy())
    assert goals.ask_blocking(ellm.Counter(), ellm.Counter({caption: 3}), calls=4, seconds=0, what="t")["answered"] == 1
    (call,) = llm.calls
    system = call.messages[0]["content"]
    assert caption in call.last and call.tag == "ellm/suggest"
    assert "collect_wood" not in system and "Choose only" not in system  # no fixed list of goals
    assert plugin.suggested == {caption: ["chop a tree", "build a table"]}
    assert (
        goals.ask_blocking(ellm.Counter(), ellm.Counter({caption: 3}), calls=4, seconds=0, what="t")["calls"] == 0
    )  # cached
    assert len(llm.calls) == 1
    assert ["chop a tree", "build a table"] in llm.embed.calls  # goals embedded when they arrive


def test_presuggest_asks_the_most_frequent_rollout_captions_within_the_budget(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. collect wood"), FakeEmbedder(KNOWN))
    plugin, train = make(task, llm, presuggest_episodes=2, presuggest_steps=100, presuggest_calls=3)
    assert len(llm.calls) == 3 and len(plugin.suggested) == 3
    trajectories = task.reference_trajectories(2, train.seed, 100)
    pairs = [(o, n) for t in trajectories for o, n in zip(t.obs, t.next_obs)]
    starts = ellm.Counter(task.caption(o) for o, n in pairs if task.caption_transition(o, n))
    seen = ellm.Counter(task.caption(o) for o, _ in pairs)
    order = list(dict.fromkeys([c for c, _ in starts.most_common()] + [c for c, _ in seen.most_common()]))
    assert starts and set(plugin.suggested) == set(order[:3])  # where a step did something first, then the most visited
    m = _end(plugin, train)
    assert m["ellm/presuggest_calls"] == 3 and 0 < m["ellm/presuggest_covered"] <= 1 and m["llm/calls"] == 3


# -- matching and rewards --------------------------------------------------------------------


def test_a_step_pays_the_cosine_of_its_caption_and_the_best_suggested_goal(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree\n2. Craft a pickaxe"), FakeEmbedder(KNOWN))
    plugin, train = make(task, llm, bonus=2.0, pretrain=False)
    start, wood = _obs(task, see=["tree"]), _obs(task, see=["tree"], have=["wood"])
    batch = _batch(task, [start, start], [wood, start])
    assert plugin.compute_reward(train, batch) is None  # unanswered: no reward, no waiting
    goals = train.state[ellm.NAME]
    goals.ask([task.caption(start.numpy())])
    term = plugin.compute_reward(train, batch)
    assert term.tolist() == pytest.approx([2.0 * 0.9, 0.0], abs=1e-5)  # "chop a tree" ~ "collect wood"
    m = _end(plugin, train)
    assert m["ellm/hits"] == 1 and m["ellm/goals_achieved_from_suggestions"] == 1 and m["ellm/unanswered_share"] == 0.5
    assert m["llm/changed_share"] == pytest.approx(1 / 4) and m["ellm/goal_reward"] == pytest.approx(1.8, abs=1e-5)
    assert "chop a tree <- collect wood: 1" in train.texts["ellm/goals.md"]


def test_a_goal_below_the_threshold_does_not_pay(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Craft a pickaxe"), FakeEmbedder(KNOWN))
    start, wood = _obs(task, see=["tree"]), _obs(task, see=["tree"], have=["wood"])
    for threshold, paid in ((0.64, 0.0), (0.45, 0.5)):
        plugin, train = make(task, llm, threshold=threshold, pretrain=False)
        train.state[ellm.NAME].ask([task.caption(start.numpy())])
        term = plugin.compute_reward(train, _batch(task, [start], [wood]))
        assert (0.0 if term is None else float(term[0])) == pytest.approx(paid, abs=1e-5)


def test_each_goal_pays_once_per_episode_and_again_after_a_reset(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree"), FakeEmbedder(KNOWN))
    plugin, train = make(task, llm, pretrain=False)
    s0, s1, s2 = _obs(task, see=["tree"]), _obs(task, see=["tree"], wood=1), _obs(task, see=["tree"], wood=2)
    train.state[ellm.NAME].ask([task.caption(s0.numpy()), task.caption(s1.numpy())])
    first = plugin.compute_reward(train, _batch(task, [s0], [s1]))
    again = plugin.compute_reward(train, _batch(task, [s1], [s2], done=[True]))  # same episode: the goal is spent
    after_reset = plugin.compute_reward(train, _batch(task, [s0], [s1]))
    assert float(first[0]) == pytest.approx(0.9, abs=1e-5) and again is None
    assert float(after_reset[0]) == pytest.approx(0.9, abs=1e-5)
    assert _end(plugin, train)["ellm/goals_achieved_from_suggestions"] == 2


def test_pretrain_replaces_the_env_reward_with_the_intrinsic_one(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree"), FakeEmbedder(KNOWN))
    start, wood = _obs(task, see=["tree"]), _obs(task, see=["tree"], have=["wood"])
    env_reward = torch.tensor([1.0, 0.1])
    plugin, train = make(task, llm)  # pretrain: true is the default
    train.state[ellm.NAME].ask([task.caption(start.numpy())])
    term = plugin.compute_reward(train, _batch(task, [start, start], [wood, start], reward=env_reward))
    assert (env_reward + term).tolist() == pytest.approx([0.9, 0.0], abs=1e-5)  # what the agent is paid
    plugin, train = make(task, llm, pretrain=False)
    train.state[ellm.NAME].ask([task.caption(start.numpy())])
    term = plugin.compute_reward(train, _batch(task, [start, start], [wood, start], reward=env_reward))
    assert (env_reward + term).tolist() == pytest.approx([1.9, 0.1], abs=1e-5)


def test_centring_subtracts_the_mean_of_the_tasks_goal_phrases(task):
    embedder = FakeEmbedder(KNOWN)
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree"), embedder)
    plugin, train = make(task, llm, center=True)
    emb = train.state[ellm.NAME].embeddings
    got = emb.get(["chop a tree", "collect wood"])
    anchors = np.stack([embedder.vector(ellm.goal_phrase(n)) for n in ellm.goal_names(task)]).astype(np.float64)
    want = ellm.unit_rows(np.stack([embedder.vector("chop a tree"), embedder.vector("collect wood")]), anchors.mean(0))
    assert embedder.calls[0] == [ellm.goal_phrase(n) for n in ellm.goal_names(task)]
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert float(got[0] @ got[1]) != pytest.approx(0.9, abs=1e-3)  # the centre moved the cosine


def test_names_variant_pays_when_a_suggested_achievement_unlocks(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "collect_wood"), FakeEmbedder(fail=True))
    plugin, train = make(task, llm, match="names", bonus=0.5, pretrain=False)
    start = _obs(task, see=["tree"])
    train.state[ellm.NAME].ask([task.caption(start.numpy())])
    assert "collect_wood" in llm.calls[0].messages[0]["content"]  # the variant lists the names
    wood = _obs(task, see=["tree"], have=["wood"], done=["collect_wood"])
    sapling = _obs(task, see=["tree"], have=["sapling"], done=["collect_sapling"])
    assert plugin.compute_reward(train, _batch(task, [start, start], [wood, sapling])).tolist() == [0.5, 0.0]
    assert llm.embed.calls == []  # no embedding in this variant


def test_the_fixed_goals_control_calls_no_llm_and_changes_no_share(task):
    embedder = FakeEmbedder(KNOWN)
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree"), embedder)
    plugin, train = make(
        task, llm, goals="fixed", pretrain=False, presuggest_episodes=1, presuggest_steps=20, resuggest_at=[0.5]
    )
    start, wood = _obs(task, see=["tree"]), _obs(task, see=["tree"], have=["wood"])
    term = plugin.compute_reward(train, _batch(task, [start], [wood]))
    train.frames = train.total_frames
    plugin.on_rollout(train, None)  # a resuggest point passes: still no call
    assert float(term[0]) == pytest.approx(1.0, abs=1e-5)  # the task's own "collect wood" matched its caption
    m = _end(plugin, train)
    assert llm.calls == [] and m["llm/calls"] == 0 and m["llm/changed_share"] == 0 and m["ellm/control"] == 1
    assert m["ellm/bonus_share"] == 1 and m["ellm/goals_achieved_from_suggestions"] == 0


def test_resuggest_points_ask_where_steps_did_something_before_the_most_visited(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree"), FakeEmbedder(KNOWN))
    plugin, train = make(task, llm, resuggest_at=[0.5], resuggest_calls=1)
    cow, tree, wood = _obs(task, see=["cow"]), _obs(task, see=["tree"]), _obs(task, see=["tree"], have=["wood"])
    for _ in range(3):
        plugin.compute_reward(train, _batch(task, [cow], [cow]))
    plugin.compute_reward(train, _batch(task, [tree], [wood]))  # once, but it collected wood
    train.frames = train.total_frames // 2
    plugin.on_rollout(train, None)
    (call,) = llm.calls
    assert "You see: tree." in call.last
    assert train.metrics["ellm/resuggest_covered"][-1][1] == 1.0  # every step with an event now has goals


def test_resuggest_points_ask_the_agents_most_frequent_unanswered_captions(task):
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree"), FakeEmbedder(KNOWN))
    plugin, train = make(task, llm, resuggest_at=[0.5], resuggest_calls=1)
    cow, lava = _obs(task, see=["cow"]), _obs(task, see=["lava"])
    for _ in range(3):
        plugin.compute_reward(train, _batch(task, [cow], [cow]))
    plugin.compute_reward(train, _batch(task, [lava], [lava]))
    plugin.on_rollout(train, None)
    assert llm.calls == []  # before the point
    train.frames = train.total_frames // 2
    plugin.on_rollout(train, None)
    (call,) = llm.calls
    assert "cow" in call.last and train.metrics["ellm/resuggest_covered"][-1][1] == pytest.approx(0.75)


# -- failures ----------------------------------------------------------------------------------


def test_an_llm_failure_costs_its_captions_and_training_goes_on(task):
    def broken(messages, tag):
        raise RuntimeError("backend down")

    llm = with_embedder(ScriptedLLM(answer=broken), FakeEmbedder(KNOWN))
    plugin, train = make(task, llm, resuggest_at=[0.5])
    caption = task.caption(_obs(task, see=["tree"]).numpy())
    assert train.state[ellm.NAME].ask([caption]) == 0
    assert not train.state[ellm.NAME].wanted(caption)  # not asked again in this training
    m = _end(plugin, train)
    assert m["ellm/failures"] == 1 and plugin.suggested == {} and "backend down" in train.texts["ellm/goals.md"]


def test_an_embedding_failure_pays_nothing_and_is_not_retried_every_step(task):
    embedder = FakeEmbedder(fail=True)
    llm = with_embedder(ScriptedLLM(answer=lambda m, tag: "1. Chop a tree"), embedder)
    plugin, train = make(task, llm, center=True, pretrain=False)
    start, wood = _obs(task, see=["tree"]), _obs(task, see=["tree"], have=["wood"])
    train.state[ellm.NAME].ask([task.caption(start.numpy())])
    for _ in range(5):
        assert plugin.compute_reward(train, _batch(task, [start], [wood])) is None
    m = _end(plugin, train)
    assert (
        len(embedder.calls) == 1
        and m["ellm/embed_errors"] == 1
        and "embedding backend down" in train.texts["ellm/goals.md"]
    )


# -- the plugin in a run -------------------------------------------------------------------------


def test_run_start_refuses_tasks_that_cannot_caption_their_steps():
    run = make_run(make_task({"name": "cartpole"}), plugin=ellm.NAME, module=ellm)
    with pytest.raises(UserError, match="caption_transition"):
        plugin_object(ellm).on_run_start(run)


def test_config_defaults_are_the_yaml_file():
    yaml = OmegaConf.load(Path(__file__).parents[2] / "conf/plugins/ellm.yaml")
    assert typed(ellm.Config, yaml, "plugins.ellm") == ellm.Config() == plugin_object(ellm).cfg


@pytest.mark.parametrize(
    "key,value",
    [
        ("goals", "some"),
        ("match", "exact"),
        ("threshold", 1.5),
        ("goals_per_state", 0),
        ("batch", 0),
        ("presuggest_calls", -1),
        ("resuggest_at", [1.5]),
        ("temperature", -1.0),
    ],
)
def test_config_refuses_values_that_cannot_work(key, value):
    with pytest.raises(UserError, match=key):
        plugin_object(ellm, **{key: value})


def fake_embedding(**kwargs):
    """``litellm.embedding`` for the fake backend: a bag-of-words vector per text (shared words, high cosine)."""
    from litellm.types.utils import EmbeddingResponse

    data = []
    for i, text in enumerate(kwargs["input"]):
        v = np.zeros(64)
        for word in str(text).lower().split():
            v[zlib.crc32(word.encode()) % 64] += 1.0
        data.append({"object": "embedding", "index": i, "embedding": v.tolist()})
    return EmbeddingResponse(model=kwargs["model"], data=data)


def test_the_real_client_over_the_fake_backend_changes_the_reward_of_random_play(task, monkeypatch):
    """Through ``LLMClient`` (chat and embed on litellm): the fake's suggestions pay on random Crafter steps."""
    from core.llm.client import import_litellm

    backend = fakes.install_fake_litellm(monkeypatch)
    monkeypatch.setattr(import_litellm(), "embedding", fake_embedding)
    from core.llm import make_client

    client = make_client({"model": "openai/fake-llm", "api_key_env": None, "cache": False, "retries": 0})
    train = make_train(
        task,
        None,
        plugin=ellm.NAME,
        module=ellm,
        overrides={"presuggest_episodes": 4, "presuggest_steps": 60, "presuggest_calls": 8},
    )
    train.llm_factory = lambda: client
    plugin = ellm.Plugin(train.plugin_config(ellm.NAME))
    plugin.on_train_start(train)
    assert backend.count("Collect sapling") >= 1
    env = task.make_env(4, seed=0)
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(300):
        nxt, reward, term, trunc, info = env.step(rng.integers(0, 17, size=4))
        done = term | trunc
        last = (
            np.where(done[:, None], np.stack([info["final_obs"][i] if done[i] else nxt[i] for i in range(4)]), nxt)
            if done.any()
            else nxt
        )
        plugin.compute_reward(
            train,
            _batch(
                task,
                list(torch.as_tensor(obs)),
                list(torch.as_tensor(last, dtype=torch.float32)),
                done=done.tolist(),
                reward=torch.as_tensor(reward, dtype=torch.float32),
            ),
        )
        obs = nxt
    m = _end(plugin, train)
    assert m["llm/calls"] >= 1 and m["llm/changed_share"] > 0 and m["ellm/goals_achieved_from_suggestions"] >= 1
    assert m["ellm/embed_calls"] >= 1 and m["ellm/embed_errors"] == 0
    for key in ("ellm/goal_reward", "ellm/captions", "ellm/suggestions", "llm/seconds"):
        assert key in m


@pytest.mark.slow
def test_smoke_run_with_the_fake_llm_trains_on_the_suggestions(make_config, monkeypatch):
    """``python -m core +plugins=[ellm] env=minecraft`` in-process on the fake LLM (chat and embeddings)."""
    from core.llm.client import import_litellm
    from core.loop import run_experiment

    fakes.install_fake_litellm(monkeypatch)
    monkeypatch.setattr(import_litellm(), "embedding", fake_embedding)
    cfg = make_config(
        [
            "+plugins=[ellm]",
            "env=minecraft",
            "env.max_episode_steps=100",
            "plugins.ellm.presuggest_episodes=4",
            "plugins.ellm.presuggest_steps=100",
            "executor=inprocess",
            "trainer.frames=1024",
            "trainer.num_envs=4",
            "trainer.rollout_steps=64",
            "trainer.epochs=1",
            "trainer.eval_every=0",
            "trainer.eval_episodes=2",
            "save_policy=false",
            "progress=false",
            "tracking.log_plots=false",
            *fakes.FAKE_LLM_OVERRIDES,
        ]
    )
    seen: list[TrainResult] = []

    class Spy:
        @hookimpl
        def on_train_end(self, train, result):
            seen.append(result)

    summary = run_experiment(cfg, extra_plugins=(Spy(),))
    assert summary.failed == 0
    (result,) = seen
    assert result.metrics["llm/changed_share"] > 0 and result.metrics["ellm/goal_reward"] > 0, result.metrics


#: goal/caption calibration set: each of Crafter's step captions with free-form goals that mean it (the
#: kind the LLM writes), and goals that match no step; every other (goal, caption) pair is a negative
CALIBRATION = {
    "collect wood": ["chop down a tree", "get wood", "gather wood from trees", "cut the tree"],
    "collect stone": ["mine stone", "get some stone", "dig stone with the pickaxe"],
    "collect coal": ["mine coal", "gather coal"],
    "collect iron": ["mine iron ore", "get iron"],
    "collect diamond": ["mine a diamond", "find diamonds"],
    "collect sapling": ["pick up a sapling", "gather saplings from the grass"],
    "drink water": ["drink from the lake", "drink some water", "quench your thirst"],
    "place table": ["build a crafting table", "place a workbench", "craft a table"],
    "place furnace": ["build a furnace", "set up a furnace"],
    "place stone": ["put down a stone block", "build a stone wall"],
    "place plant": ["plant a sapling", "plant a tree"],
    "make wood pickaxe": ["craft a wooden pickaxe", "make a pickaxe from wood"],
    "make stone pickaxe": ["craft a stone pickaxe"],
    "make iron pickaxe": ["craft an iron pickaxe"],
    "make wood sword": ["craft a wooden sword"],
    "make stone sword": ["craft a stone sword"],
    "make iron sword": ["forge an iron sword"],
    "eat cow": ["kill a cow and eat it", "hunt a cow for food", "eat beef"],
    "eat plant": ["eat the ripe plant", "harvest and eat a plant"],
    "sleep": ["go to sleep", "rest to regain energy"],
    "wake up": ["wake up after sleeping"],
    "defeat zombie": ["kill the zombie", "fight the zombie"],
    "defeat skeleton": ["kill a skeleton", "fight skeletons in the cave"],
}
UNMATCHED = [
    "explore the area",
    "find water",
    "look for cows",
    "avoid zombies",
    "build a house",
    "find a cave",
    "survive the night",
    "stay healthy",
]


def calibration_figures(embeddings: ellm.Embeddings, threshold: float) -> dict[str, float]:
    """Over :data:`CALIBRATION`: the AUC of positive over negative pairs, how often the right caption is a
    goal's nearest, recall and precision at ``threshold``, and the F1-best threshold."""
    captions = list(CALIBRATION)
    goals = [(g, c) for c, gs in CALIBRATION.items() for g in gs] + [(g, None) for g in UNMATCHED]
    sims = embeddings.get([g for g, _ in goals]) @ embeddings.get(captions).T
    right = np.array([[c == caption for caption in captions] for _, c in goals])
    pos, neg = sims[right], sims[~right]
    top1 = np.mean([captions[int(np.argmax(row))] == c for row, (_, c) in zip(sims, goals) if c is not None])

    def f1(t: float) -> float:
        tp, fp = (pos >= t).sum(), (neg >= t).sum()
        return 2 * tp / max(1, 2 * tp + fp + (len(pos) - tp))

    best = max(np.round(np.linspace(0, 1, 101), 2), key=f1)
    return {
        "auc": float((pos[:, None] > neg[None, :]).mean()),
        "top1": float(top1),
        "recall": float((pos >= threshold).mean()),
        "precision": float((pos >= threshold).sum() / max(1, (sims >= threshold).sum())),
        "f1": f1(threshold),
        "best_threshold": float(best),
        "best_f1": f1(best),
        "positives": float(len(pos)),
        "negatives": float(len(neg)),
        "false_positives": float((neg >= threshold).sum()),
    }


@pytest.mark.slow
def test_the_threshold_separates_paraphrases_on_the_embedded_model(tmp_path, task):
    """The figure on the page: the embedded model's centred cosines at the configured threshold."""
    from core.llm import make_client

    client = make_client(
        {
            "model": "embedded/qwen2.5-coder-1.5b-instruct",
            "cache_path": str(tmp_path / "c.sqlite"),
            "n_threads": 1,
            "show_progress": False,
        }
    )
    cfg = ellm.Config()
    embeddings = ellm.Embeddings(
        client, cfg.embed_model, [ellm.goal_phrase(n) for n in ellm.goal_names(task)], cfg.center
    )
    figures = calibration_figures(embeddings, cfg.threshold)
    print(figures)
    assert figures["auc"] > 0.95 and figures["top1"] > 0.85
    assert figures["precision"] > 0.75 and figures["recall"] > 0.6
