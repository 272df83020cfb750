"""Fixtures for the LLM layer: a fake litellm backend that counts and can fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.llm.client import import_litellm


class FakeBackend:
    """Stands in for ``litellm.completion``: deterministic replies, counted calls.

    ``fail_with`` is a list of exceptions raised by the next calls, one per call.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_with: list[BaseException] = []
        self.cost = 0.0

    def __call__(self, **kwargs: Any) -> Any:
        from litellm.types.utils import Choices, Message, ModelResponse, Usage

        self.calls.append(kwargs)
        if self.fail_with:
            raise self.fail_with.pop(0)
        n = kwargs.get("n", 1)
        last = kwargs["messages"][-1]["content"]
        # with top_logprobs: the OpenAI shape, a spaced and an unspaced spelling of "2"
        logprobs = (
            {
                "content": [
                    {
                        "token": "1",
                        "logprob": -0.1,
                        "top_logprobs": [
                            {"token": "1", "logprob": -0.1},
                            {"token": " 2", "logprob": -2.5},
                            {"token": "2", "logprob": -3.0},
                        ],
                    }
                ]
            }
            if kwargs.get("logprobs")
            else None
        )
        choices = [
            Choices(
                index=j,
                finish_reason="stop",
                logprobs=logprobs,
                message=Message(role="assistant", content=f"{last}|seed={kwargs['seed']}|j={j}"),
            )
            for j in range(n)
        ]
        response = ModelResponse(
            choices=choices,
            model=kwargs["model"],
            usage=Usage(prompt_tokens=10, completion_tokens=5 * n, total_tokens=10 + 5 * n),
        )
        response._hidden_params["response_cost"] = self.cost
        return response


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    backend = FakeBackend()
    monkeypatch.setattr(import_litellm(), "completion", backend)
    return backend


@pytest.fixture
def llm_cfg(tmp_path: Path) -> dict[str, Any]:
    """A config for a remote-style model (no embedded load), cache in ``tmp_path``."""
    return {
        "model": "openai/fake-model",
        "api_key_env": None,
        "temperature": 0.5,
        "max_tokens": 32,
        "retries": 2,
        "backoff_s": 1.0,
        "max_n": 1,
        "cache": True,
        "cache_path": str(tmp_path / "cache.sqlite"),
    }
