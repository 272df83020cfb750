"""The one fake LLM of the test suite, and contexts built the way the framework builds them.

The built-ins' tests and a third party's use the same: ``from core.testing import ScriptedLLM,
make_run`` (or ``from core.testing.fakes import ...`` for the reply texts and helpers below).

- :class:`ScriptedLLM` has :meth:`core.llm.LLMClient.chat`'s signature and returns real
  :class:`core.llm.client.Reply` records, from a script: a list of texts (used in order,
  cycled) or a function ``answer(messages, tag) -> text``. Every call is recorded in
  ``calls`` with its settings. ``ScriptedLLM.plausible()`` answers with :func:`answer`.
- :func:`answer` gives a plausible reply to each kind of prompt the built-in plugins
  send (reward code, LESR features, EnvGen configs, RL-GPT plans and skills, progress
  scores, preference digits, LaRes behaviour analyses), valid on any task.
- :class:`FakeLiteLLM` stands in for ``litellm.completion`` (install it with
  :func:`install_fake_litellm`) so that a whole run, training hooks included, talks to
  :func:`answer` through the real :class:`core.llm.LLMClient`; :data:`FAKE_LLM_OVERRIDES`
  are the Hydra overrides that point the run at it.
- :func:`make_run` / :func:`make_train` build a real :class:`core.context.RunContext` /
  :class:`core.context.TrainContext` with validated settings for one plugin, so a unit
  test sees what a hook sees in a run: typed config, sandbox settings, logging.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from omegaconf import OmegaConf

from core.config import Settings, config_class, typed
from core.context import RunContext, TrainContext
from core.llm.client import LLMClient, LLMStats, Reply
from core.records import Candidate

Answer = Callable[[list[dict[str, str]], str], str]


def _cut_at(text: str, stop: list[str] | None) -> str:
    """The text up to the first stop sequence (left out), as a real model's server ends a reply."""
    ends = [text.find(s) for s in stop or () if s in text]
    return text[: min(ends)] if ends else text


@dataclass
class Call:
    """One recorded ``chat`` call."""

    messages: list[dict[str, str]]
    n: int
    temperature: float | None
    max_tokens: int | None
    seed: int
    tag: str
    top_logprobs: int
    stop: list[str] | None = None

    @property
    def last(self) -> str:
        """The last message's text (usually the question)."""
        return self.messages[-1]["content"]


#: end a scripted reply with this to have it come back cut off at the token cap (``finish_reason="length"``)
CUT_OFF = "<<cut off>>"


@dataclass
class ScriptedLLM:
    """A stand-in for the LLM client; see the module docstring.

    :param replies: texts returned in order (cycled), one per sample.
    :param answer: or a function of the messages and the call's tag.
    :param delay_s: seconds each call sleeps (to test code that must not wait on the LLM).
    :param logprobs: a function ``(messages) -> {token: logprob}`` for calls with ``top_logprobs``.
    :param group: samples per group from :meth:`chat_groups` (0: all in one group).
    :param group_delay_s: seconds :meth:`chat_groups` sleeps before each group (a request landing);
        ``delivered`` holds when each group was handed over (``time.time()``).
    """

    replies: list[str] = field(default_factory=list)
    answer: Answer | None = None
    delay_s: float = 0.0
    logprobs: Callable[[list[dict[str, str]]], dict[str, float]] | None = None
    group: int = 0
    group_delay_s: float = 0.0
    delivered: list[float] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    stats: LLMStats = field(default_factory=LLMStats)
    records: list[Any] = field(default_factory=list)
    _next: int = 0

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        temperature: float | None = None,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
        seed: int = 0,
        tag: str = "",
        top_logprobs: int = 0,
    ) -> list[Reply]:
        messages = [dict(m) for m in messages]
        self.calls.append(Call(messages, n, temperature, max_tokens, seed, tag, top_logprobs, stop))
        self.stats.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        out = []
        for _ in range(n):
            text = _cut_at(self._text(messages, tag), stop)
            lp = self.logprobs(messages) if (top_logprobs and self.logprobs is not None) else None
            cut = text.endswith(CUT_OFF)  # a scripted reply that the token cap cut off
            text = text.removesuffix(CUT_OFF)
            out.append(
                Reply(
                    text=text,
                    prompt_tokens=0,
                    completion_tokens=len(text.split()),
                    latency_s=self.delay_s,
                    cost=0.0,
                    cached=False,
                    model="scripted",
                    logprobs=lp,
                    finish_reason="length" if cut else "stop",
                )
            )
        return out

    continue_reply = LLMClient.continue_reply  # the client's own continuation, over the scripted chat

    def chat_groups(self, messages: list[dict[str, str]], *, n: int = 1, **kwargs: Any) -> Iterator[list[Reply]]:
        """:meth:`chat`'s replies (one recorded call) in groups of ``group``, ``group_delay_s`` apart."""
        replies = self.chat(messages, n=n, **kwargs)
        size = self.group or n
        for start in range(0, n, size):
            if self.group_delay_s:
                time.sleep(self.group_delay_s)
            self.delivered.append(time.time())
            yield replies[start : start + size]

    @classmethod
    def plausible(cls, **kwargs: Any) -> ScriptedLLM:
        """A ScriptedLLM that answers every prompt kind with :func:`answer` (digits with log-probabilities)."""
        return cls(
            answer=lambda messages, tag: answer(messages), logprobs=lambda messages: dict(DIGIT_LOGPROBS), **kwargs
        )

    def _text(self, messages: list[dict[str, str]], tag: str) -> str:
        if self.answer is not None:
            return self.answer(messages, tag)
        if not self.replies:
            raise AssertionError("ScriptedLLM has no reply left to give")
        text = self.replies[self._next % len(self.replies)]
        self._next += 1
        return text


# -------------------------------------------------------------------------------------
# One plausible reply per prompt kind
# -------------------------------------------------------------------------------------

#: a comment in every program :func:`answer` writes, so a test can tell its code trained
MARK = "# written by the fake LLM"

#: the reward: a small bounded term over the mean of every state field (any task's state dict)
REWARD = f"""```python
import torch


def {{entry}}(state, action, next_state):
    {MARK}
    fields = [v.float().reshape(v.shape[0], -1).mean(dim=-1) for v in next_state.values()]
    level = torch.tanh(torch.stack(fields, dim=-1).mean(dim=-1))
    alive = torch.ones_like(level)
    reward = alive + 0.1 * level
    return reward, {{{{"alive": alive, "level": 0.1 * level}}}}
```"""

#: LESR's pair: two features of the state and an intrinsic reward on the first
LESR = f"""```python
import torch


def revise_state(state):
    {MARK}
    fields = torch.stack([v.float().reshape(v.shape[0], -1).mean(dim=-1) for v in state.values()], dim=-1)
    level = torch.tanh(fields.mean(dim=-1))
    spread = torch.tanh(fields.abs().sum(dim=-1))
    return torch.stack([level, spread], dim=-1)


def intrinsic_reward(state, features):
    return 0.1 * torch.tanh(features[:, 0])
```"""

#: an RL-GPT skill: the first primitive action, once (valid for any discrete task)
SKILL = f"""```python
def act(state):
    {MARK}
    return 0


def done(state):
    return True
```"""

PLAN = """```json
[{"name": "first_step", "how": "code", "what": "take the first primitive action once"},
 {"name": "the_rest", "how": "rl", "what": "learn the remaining behaviour from primitive actions"}]
```"""

PROGRESS = "Score: 7 | Reason: the agent keeps the task going and moves towards the goal."
PREFERENCE = "Answer: 1 | Reason: segment 1 makes more progress towards the goal."
ANALYSIS = (
    "- jitter: the actions switch back and forth; add a small penalty on action changes.\n"
    "- slow progress: reward the distance closed towards the goal each step."
)
#: the first answer token's alternatives for a one-digit preference (the judge prefers "1")
DIGIT_LOGPROBS = {"1": math.log(0.7), "2": math.log(0.3)}


def answer(messages: list[dict[str, str]]) -> str:
    """A plausible reply to the conversation ``messages``, by the kind of prompt it holds.

    Reward code (``compute_reward`` or Text2Reward's ``compute_dense_reward``), LESR's
    ``revise_state`` + ``intrinsic_reward``, EnvGen's JSON env configs (copies of the
    prompt's own example item), RL-GPT's JSON plan and ``act``/``done`` skill, a
    progress score (``Score: 7``), a preference (``1`` or ``Answer: 1``; between two observations,
    :func:`preferred_observation`), a LaRes
    behaviour analysis, Plan4MC's skill graph (:func:`skill_graph`); anything else gets a short sentence.
    """
    text = "\n".join(m["content"] for m in messages)
    last = messages[-1]["content"]
    if "name the defects" in last:
        return ANALYSIS
    if "Answer with one letter" in last:  # SayCan's skill choice
        return "B"
    if '"requires": ["<skill done before>"' in text:  # Plan4MC's skill graph (and its re-plans)
        return skill_graph(text)
    if "You suggest goals to the player of a game" in text or "one goal name per line" in text:  # ELLM
        return ellm_goals(text)
    if "Reply with a single digit from 0 (no progress)" in last:  # progress_reward's expected score
        return progress_digit(last)
    if "Score: <integer 1-10>" in text:
        return PROGRESS
    if "Observation 1: " in last and "Observation 2: " in last:  # rlaif_preference's caption pairs
        return preferred_observation(last) if "single digit" in last else f"Answer: {preferred_observation(last)}"
    if "Segment 1" in text and "Segment 2" in text:
        return "1" if "single digit" in last else PREFERENCE
    if "revise_state" in text and "intrinsic_reward" in text:
        return LESR
    if '"how": "code" or "rl"' in text and "Write the skill" not in last:
        return PLAN
    if "def act(state)" in text:
        return SKILL
    if "environment configs" in text or "configs as a ```json list" in text:
        return env_configs(text)
    if "compute_dense_reward" in text:
        return REWARD.format(entry="compute_dense_reward")
    if "compute_reward" in text:
        return REWARD.format(entry="compute_reward")
    return "The agent should keep going as it does."


#: Plan4MC's graph as the fake writes it: a chain, each skill requiring the one before, up to the target.
#: It keeps Crafter's rules but is not their tech tree (a sapling first), so a plan from it is told apart
SKILL_CHAIN = [
    "collect_sapling",
    "collect_wood",
    "place_table",
    "make_wood_pickaxe",
    "collect_stone",
    "make_stone_pickaxe",
]


#: ELLM's suggestions as the fake writes them: events a random Crafter policy makes within a few hundred steps
ELLM_GOALS = ["Sleep", "Collect sapling", "Place plant", "Collect wood"]


def ellm_goals(prompt: str) -> str:
    """ELLM's reply: :data:`ELLM_GOALS` as a numbered free-form list (achievement names for the
    ``match: names`` prompt that lists them)."""
    if "one goal name per line" in prompt:
        return "\n".join(g.lower().replace(" ", "_") for g in ELLM_GOALS)
    return "Here are the goals:\n" + "\n".join(f"{i}. {g}." for i, g in enumerate(ELLM_GOALS, 1))


def skill_graph(prompt: str) -> str:
    """Plan4MC's reply: :data:`SKILL_CHAIN` up to the prompt's ``Target:`` (else a sapling, then the target)."""
    found = re.search(r"Target: (\w+)", prompt)
    target = found.group(1) if found else SKILL_CHAIN[-1]
    names = SKILL_CHAIN[: SKILL_CHAIN.index(target) + 1] if target in SKILL_CHAIN else ["collect_sapling", target]
    items = [{"name": n, "requires": names[i - 1 : i], "yields": n.split("_", 1)[-1]} for i, n in enumerate(names)]
    return "```json\n" + json.dumps(items) + "\n```"


def preferred_observation(prompt: str) -> str:
    """rlaif_preference's judge: "1" or "2", the observation that names more things (Crafter:
    more seen and held), then the one with the smaller numbers (CartPole: nearer upright and
    centred); "1" when they tie (so both orders of a tie cancel)."""
    found = re.search(r"Observation 1: (.*?)\n\nObservation 2: (.*?)\n\n", prompt, re.S)
    if not found:
        return "1"

    def merit(text: str) -> tuple[int, float]:
        return len(re.findall(r"[,.]\s", text + " ")), -sum(abs(float(x)) for x in re.findall(r"-?\d+\.?\d*", text))

    a, b = merit(found.group(1)), merit(found.group(2))
    return "2" if b > a else "1"


def progress_digit(prompt: str) -> str:
    """progress_reward's one-digit score (0-9), a function of the state in the prompt, so that
    different states get different scores (a constant score would z-score to a zero LLM term)."""
    import zlib

    return str(zlib.crc32(prompt.split("Current state:", 1)[-1].encode()) % 10)


def env_configs(prompt: str, n: int = 4) -> str:
    """EnvGen's reply: ``n`` named copies of the example item the first prompt shows."""
    found = re.search(r"Example item: (\{.*\})", prompt)
    example = json.loads(found.group(1)) if found else {"params": {}}
    items = [
        {"name": f"fake_env_{i}", "purpose": "practise one skill", "params": example.get("params", {})}
        for i in range(n)
    ]
    return "```json\n" + json.dumps(items, indent=1) + "\n```"


# -------------------------------------------------------------------------------------
# litellm stand-in: a whole run talks to `answer` through the real client
# -------------------------------------------------------------------------------------

#: Hydra overrides that point a run at :class:`FakeLiteLLM` (a remote-style model, no key, no cache)
FAKE_LLM_OVERRIDES = [
    "llm=openai",
    "llm.model=openai/fake-llm",
    "llm.api_key_env=null",
    "llm.cache=false",
    "llm.retries=0",
    "llm.max_n=16",
]


class FakeLiteLLM:
    """Stands in for ``litellm.completion``: :func:`answer` for every request.

    ``calls`` holds each request's keyword arguments, ``kinds`` counts the replies by
    their first line (``kinds_of``). Requests asking for ``logprobs`` get the first
    token's alternatives :data:`DIGIT_LOGPROBS` in the OpenAI shape. Thread-safe enough
    for judges that ask from a worker thread (appends and counter updates only).
    """

    def __init__(self, reply: Callable[[list[dict[str, str]]], str] = answer) -> None:
        self.reply = reply
        self.calls: list[dict[str, Any]] = []
        self.replies: list[str] = []

    def __call__(self, **kwargs: Any) -> Any:
        from litellm.types.utils import Choices, Message, ModelResponse, Usage

        self.calls.append(kwargs)
        text = self.reply(kwargs["messages"])
        self.replies.append(text)
        logprobs = None
        if kwargs.get("logprobs"):
            top = [{"token": t, "logprob": lp} for t, lp in DIGIT_LOGPROBS.items()]
            logprobs = {
                "content": [{"token": text[:1], "logprob": DIGIT_LOGPROBS.get(text[:1], -5.0), "top_logprobs": top}]
            }
        n = int(kwargs.get("n") or 1)
        choices = [
            Choices(index=j, finish_reason="stop", logprobs=logprobs, message=Message(role="assistant", content=text))
            for j in range(n)
        ]
        tokens = len(text.split())
        return ModelResponse(
            choices=choices,
            model=kwargs["model"],
            usage=Usage(prompt_tokens=100, completion_tokens=tokens * n, total_tokens=100 + tokens * n),
        )

    def count(self, needle: str) -> int:
        """How many replies contain ``needle`` (e.g. ``"def compute_reward"``, ``"Score:"``)."""
        return sum(needle in r for r in self.replies)


def install_fake_litellm(monkeypatch: Any, reply: Callable[[list[dict[str, str]]], str] = answer) -> FakeLiteLLM:
    """Replace ``litellm.completion`` with a :class:`FakeLiteLLM` for one test (``monkeypatch`` undoes it)."""
    from core.llm.client import import_litellm

    backend = FakeLiteLLM(reply)
    monkeypatch.setattr(import_litellm(), "completion", backend)
    return backend


def settings_for(
    plugin: str | None = None,
    module: Any = None,
    overrides: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> Settings:
    """Validated settings with one plugin enabled (its ``Config`` defaults + ``overrides``)."""
    plugins = {}
    if plugin is not None:
        schema = config_class(module) if module is not None else None
        assert schema is not None, "pass the plugin's module"
        plugins[plugin] = typed(schema, OmegaConf.create(overrides or {}), f"plugins.{plugin}")
    node = dict(config or {})
    node.setdefault(
        "plugins", {name: OmegaConf.to_container(OmegaConf.structured(cfg)) for name, cfg in plugins.items()}
    )
    return Settings.of(node, plugins)


@dataclass
class Logged:
    """What a fake run recorded through ``log_text`` / ``log_metrics``."""

    texts: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def log_text(self, text: str, path: str) -> None:  # the tracker's signature
        self.texts[path] = text

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)


def make_run(
    task: Any,
    llm: ScriptedLLM | None = None,
    *,
    plugin: str | None = None,
    module: Any = None,
    overrides: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    hook: Any = None,
) -> RunContext:
    """A run context as the loop makes it; ``run.tracker`` is a :class:`Logged` (``.texts``, ``.metrics``)."""
    settings = settings_for(plugin, module, overrides, config)
    return RunContext(
        settings=settings,
        task=task,
        seed=seed,
        llm_factory=(lambda: llm) if llm is not None else None,
        hook=hook,
        tracker=Logged(),
        iterations=settings.iterations,
    )


def make_train(
    task: Any,
    llm: ScriptedLLM | None = None,
    *,
    plugin: str | None = None,
    module: Any = None,
    overrides: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    candidate: Candidate | None = None,
    total_frames: int = 10_000,
    hook: Any = None,
) -> TrainContext:
    """A training context as the executor makes it."""
    settings = settings_for(plugin, module, overrides, config)
    return TrainContext(
        settings=settings,
        task=task,
        seed=seed,
        llm_factory=(lambda: llm) if llm is not None else None,
        hook=hook,
        candidate=candidate or Candidate("c", 0),
        total_frames=total_frames,
    )


def plugin_object(module: Any, **overrides: Any) -> Any:
    """``module.Plugin(Config(**defaults + overrides))``: the object a run registers."""
    cfg = typed(config_class(module), OmegaConf.create(overrides), "plugins.test")
    return module.Plugin(cfg)


def texts_of(run: RunContext) -> dict[str, str]:
    return run.tracker.texts


def first(items: Iterable[Any]) -> Any:
    return next(iter(items))


def final_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A candidate run's final values: ``summary/<name>`` (logged when it differs from the
    series' last point, core.tracking) over the series' last point ``<name>``."""
    return {**metrics, **{k[len("summary/") :]: v for k, v in metrics.items() if k.startswith("summary/")}}
