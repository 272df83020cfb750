"""The one fake LLM of the test suite, and contexts built the way the framework builds them.

- :class:`ScriptedLLM` has :meth:`core.llm.LLMClient.chat`'s signature and returns real
  :class:`core.llm.client.Reply` records, from a script: a list of texts (used in order,
  cycled) or a function ``answer(messages, tag) -> text``. Every call is recorded in
  ``calls`` with its settings.
- :func:`make_run` / :func:`make_train` build a real :class:`core.context.RunContext` /
  :class:`core.context.TrainContext` with validated settings for one plugin, so a unit
  test sees what a hook sees in a run: typed config, sandbox settings, logging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from omegaconf import OmegaConf

from core.config import Settings, config_class, typed
from core.context import RunContext, TrainContext
from core.llm.client import LLMStats, Reply
from core.records import Candidate

Answer = Callable[[list[dict[str, str]], str], str]


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

    @property
    def last(self) -> str:
        """The last message's text (usually the question)."""
        return self.messages[-1]["content"]


@dataclass
class ScriptedLLM:
    """A stand-in for the LLM client; see the module docstring.

    :param replies: texts returned in order (cycled), one per sample.
    :param answer: or a function of the messages and the call's tag.
    :param delay_s: seconds each call sleeps (to test code that must not wait on the LLM).
    :param logprobs: a function ``(messages) -> {token: logprob}`` for calls with ``top_logprobs``.
    """

    replies: list[str] = field(default_factory=list)
    answer: Answer | None = None
    delay_s: float = 0.0
    logprobs: Callable[[list[dict[str, str]]], dict[str, float]] | None = None
    calls: list[Call] = field(default_factory=list)
    stats: LLMStats = field(default_factory=LLMStats)
    records: list[Any] = field(default_factory=list)
    _next: int = 0

    def chat(self, messages: list[dict[str, str]], *, n: int = 1, temperature: float | None = None,
             max_tokens: int | None = None, stop: list[str] | None = None, seed: int = 0, tag: str = "",
             top_logprobs: int = 0) -> list[Reply]:
        messages = [dict(m) for m in messages]
        self.calls.append(Call(messages, n, temperature, max_tokens, seed, tag, top_logprobs))
        self.stats.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        out = []
        for _ in range(n):
            text = self._text(messages, tag)
            lp = self.logprobs(messages) if (top_logprobs and self.logprobs is not None) else None
            out.append(Reply(text=text, prompt_tokens=0, completion_tokens=len(text.split()), latency_s=self.delay_s,
                             cost=0.0, cached=False, model="scripted", logprobs=lp))
        return out

    def _text(self, messages: list[dict[str, str]], tag: str) -> str:
        if self.answer is not None:
            return self.answer(messages, tag)
        if not self.replies:
            raise AssertionError("ScriptedLLM has no reply left to give")
        text = self.replies[self._next % len(self.replies)]
        self._next += 1
        return text


def settings_for(plugin: str | None = None, module: Any = None, overrides: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None) -> Settings:
    """Validated settings with one plugin enabled (its ``Config`` defaults + ``overrides``)."""
    plugins = {}
    if plugin is not None:
        schema = config_class(module) if module is not None else None
        assert schema is not None, "pass the plugin's module"
        plugins[plugin] = typed(schema, OmegaConf.create(overrides or {}), f"plugins.{plugin}")
    node = dict(config or {})
    node.setdefault("plugins", {name: OmegaConf.to_container(OmegaConf.structured(cfg)) for name, cfg in plugins.items()})
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


def make_run(task: Any, llm: ScriptedLLM | None = None, *, plugin: str | None = None, module: Any = None,
             overrides: dict[str, Any] | None = None, config: dict[str, Any] | None = None, seed: int = 0,
             hook: Any = None) -> RunContext:
    """A run context as the loop makes it; ``run.tracker`` is a :class:`Logged` (``.texts``, ``.metrics``)."""
    settings = settings_for(plugin, module, overrides, config)
    return RunContext(settings=settings, task=task, seed=seed, llm_factory=(lambda: llm) if llm is not None else None,
                      hook=hook, tracker=Logged(), iterations=settings.iterations)


def make_train(task: Any, llm: ScriptedLLM | None = None, *, plugin: str | None = None, module: Any = None,
               overrides: dict[str, Any] | None = None, config: dict[str, Any] | None = None, seed: int = 0,
               candidate: Candidate | None = None, total_frames: int = 10_000, hook: Any = None) -> TrainContext:
    """A training context as the executor makes it."""
    settings = settings_for(plugin, module, overrides, config)
    return TrainContext(settings=settings, task=task, seed=seed, llm_factory=(lambda: llm) if llm is not None else None,
                        hook=hook, candidate=candidate or Candidate("c", 0), total_frames=total_frames)


def plugin_object(module: Any, **overrides: Any) -> Any:
    """``module.Plugin(Config(**defaults + overrides))``: the object a run registers."""
    cfg = typed(config_class(module), OmegaConf.create(overrides), "plugins.test")
    return module.Plugin(cfg)


def texts_of(run: RunContext) -> dict[str, str]:
    return run.tracker.texts


def first(items: Iterable[Any]) -> Any:
    return next(iter(items))
