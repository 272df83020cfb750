"""The trainer's random stream, kept apart from the plugins' code.

A training seeds torch once (``torch.manual_seed(seed)``) and then draws its network
initialisation and every sampled action from that one stream. Plugin code that runs
inside the training (a reward model fitted in ``on_train_start``, an evaluator distilled
in ``on_rollout``, a prior sampled in ``action_prior``) may draw from the same global
stream, and each draw it takes would shift every later draw of the trainer: the same seed
would then give another policy depending on which plugins ran. So every hook call of a
training runs on a fork of the stream (:func:`torch.random.fork_rng`): the plugin draws
what it would have drawn, and the trainer's stream is restored after it. One seed gives
one initialisation and one sampling noise whatever plugins run beside it, and a control
whose term is zero (the method without its LLM) trains exactly as the baseline does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def plugin_stream() -> Iterator[None]:
    """Run plugin code on a fork of torch's CPU random stream, restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        yield


class _Call:
    """One hook caller (``pm.hook.compute_reward``) whose calls run in :func:`plugin_stream`."""

    def __init__(self, caller: Any) -> None:
        self._caller = caller

    def __call__(self, **kwargs: Any) -> Any:
        with plugin_stream():
            return self._caller(**kwargs)

    def __getattr__(self, name: str) -> Any:  # get_hookimpls, spec, name ...
        return getattr(self._caller, name)


class SeparateStream:
    """``pm.hook`` for a training: every hook call runs in :func:`plugin_stream`."""

    def __init__(self, relay: Any) -> None:
        self._relay = relay

    def __getattr__(self, name: str) -> _Call:
        call = _Call(getattr(self._relay, name))
        setattr(self, name, call)  # compute_reward is called every step: later lookups skip __getattr__
        return call


__all__ = ["SeparateStream", "plugin_stream"]
