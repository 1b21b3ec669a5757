"""OpenAI wire format: request models (validated, unknown fields tolerated) and response builders.

Unknown top-level fields are kept (``extra="allow"``) because OpenAI tolerates new fields and
upstream providers may understand them. Every sampling and output field OpenAI defines is either
honoured by the local engine (tools and ``tool_choice``, ``response_format``, ``logprobs`` /
``top_logprobs``, ``logit_bias``; see docs/gateway.md) or rejected in
``gateway.pipeline._reject_unsupported_local`` with a 400 that names the parameter
(``presence_penalty``, ``frequency_penalty``, ``echo``, ``suffix``, ``best_of``, and extra fields
such as ``functions``, ``audio``, ``reasoning_effort``): never silently dropped. Extra fields that
change nothing in the output (``metadata``, ``store``...) are accepted.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logprobs: Any = None  # chat: bool; completions: int 0..5 (the subclasses narrow it)
    logit_bias: dict[str, float] | None = None  # token id (as a string key) -> bias in [-100, 100]
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as text or token ids (OpenAI accepts all four shapes)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def usage_dict(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """``usage`` with ``prompt_tokens_details.cached_tokens`` always present (0 when none)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def now() -> int:
    return int(time.time())
