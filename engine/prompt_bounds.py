"""Refuse a prompt that cannot fit the context before rendering or tokenizing it.

The context check after tokenization is exact but comes after the work: a 4,095-message chat
(a ~1 s Jinja render) or a 1 M-character message (~0.4 s to encode) was rendered in full only to
be refused as 4-40x over ``max_model_len``. Two bounds that need no tokenizer come first:

- characters: no token of the vocabulary stands for more than ``max_token_chars`` characters
  (its longest entry, e.g. a run of 80 ``#``; byte-level and SentencePiece vocabularies spell a
  token with at least as many characters as it decodes to), so client text of more than
  ``max_model_len * max_token_chars`` characters needs more than ``max_model_len`` tokens. Ordinary
  text runs at ~4 characters a token, so the bound only refuses text that could never fit.
- messages: every chat template spends at least ``MIN_TOKENS_PER_MESSAGE`` tokens on a message
  (its role header and end marker), so more than ``max_model_len // 2`` messages cannot fit.

Counted as client text: what the chat renderer treats as such (``engine.models.chat_render``):
message ``content`` (a string, or each text part's ``text``), ``name``, and tool-call names and
arguments; a completion's ``prompt``. Both refusals are ``PromptTooLongError`` (400,
``context_length_exceeded``), the error the exact check gives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.protocol import GenerateRequest, PromptTooLongError

MIN_TOKENS_PER_MESSAGE = 2


def longest_token_chars(vocab: Mapping[str, int]) -> int:
    """Characters in the vocabulary's longest entry (at least 1)."""
    return max((len(token) for token in vocab), default=1) or 1


@dataclass(frozen=True)
class PromptBounds:
    max_model_len: int
    max_token_chars: int

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_token_chars

    @property
    def max_messages(self) -> int:
        return max(1, self.max_model_len // MIN_TOKENS_PER_MESSAGE)

    def check(self, request: GenerateRequest) -> None:
        """Raise ``PromptTooLongError`` when the request's text or message count alone rules it out."""
        if request.messages is not None:
            self._check_messages(request.messages)
        elif request.prompt is not None:
            self._check_chars(len(request.prompt))

    def _check_messages(self, messages: Sequence[dict]) -> None:
        if len(messages) > self.max_messages:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                f"messages number {len(messages)}, and a chat template spends at least "
                f"{MIN_TOKENS_PER_MESSAGE} tokens on each ({self.max_messages} messages at most). "
                "Please reduce the number of messages."
            )
        self._check_chars(sum(_message_chars(m) for m in messages))

    def _check_chars(self, chars: int) -> None:
        if chars > self.max_chars:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                f"prompt holds {chars} characters, more than {self.max_model_len} tokens can hold "
                f"(at most {self.max_token_chars} characters a token for this tokenizer). "
                "Please reduce the prompt."
            )


def _message_chars(message: dict) -> int:
    content = message.get("content")
    n = 0
    if isinstance(content, str):
        n += len(content)
    elif isinstance(content, list):
        n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    name = message.get("name")
    if isinstance(name, str):
        n += len(name)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        n += sum(_call_chars(c) for c in calls)
    return n


def _call_chars(call: object) -> int:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return 0
    name, args = fn.get("name"), fn.get("arguments")
    n = len(name) if isinstance(name, str) else 0
    if isinstance(args, str):
        return n + len(args)
    return n + len(json.dumps(args, ensure_ascii=False)) if args is not None else n
