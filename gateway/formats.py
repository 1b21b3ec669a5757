"""OpenAI response objects for chat and text completions (whole responses and stream chunks).

Stream chunk sequence for one chat request (what the openai SDK parses)::

    {"object": "chat.completion.chunk", "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]}
    {... "choices": [{"index": i, "delta": {"content": "Hel"}, "finish_reason": null}]}     (many)
    {... "choices": [{"index": i, "delta": {}, "finish_reason": "stop"}]}                   (one per choice)
    {... "choices": [], "usage": {...}}              (only with stream_options.include_usage)
    [DONE]

With ``include_usage`` every other chunk carries ``"usage": null``, as OpenAI sends it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Protocol

from engine.protocol import RequestOutput
from gateway.errors import OpenAIError
from gateway.pipeline import Prepared


def finish_reason(out: RequestOutput) -> str | None:
    reason = out.finish_reason
    if reason in (None, "abort", "error"):
        return "stop" if out.finished else None
    return reason


class ChoiceText:
    """Accumulates each choice's text, tool calls and finish reason for a non-streamed response."""

    def __init__(self) -> None:
        self.text: dict[int, list[str]] = defaultdict(list)
        self.tools: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        self.finish: dict[int, str | None] = {}

    def add(self, i: int, out: RequestOutput) -> None:
        if out.new_text:
            self.text[i].append(out.new_text)
        for delta in getattr(out, "tool_call_deltas", ()) or ():
            call = self.tools[i].setdefault(
                delta.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = delta.get("id") or call["id"]
            fn = delta.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
        if out.finished:
            self.finish[i] = finish_reason(out)


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data:`` JSON, with an ``event:`` line where the API names its events."""
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


class WireFormat(Protocol):
    """How one API shapes a response: the whole body, and the stream as SSE frames.

    ``chunks`` turns one engine increment into zero or more events; ``frame`` encodes one;
    ``tail`` gives the frames after the last increment (usage, terminator) and ``error_frames``
    the in-band error once the status line has gone out."""

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]: ...

    def frame(self, chunk: dict[str, Any]) -> bytes: ...

    def tail(self, usage: dict[str, Any]) -> list[bytes]: ...

    def error_frames(self, error: OpenAIError) -> list[bytes]: ...

    def whole(self, acc: ChoiceText, usage: dict[str, Any]) -> dict[str, Any]: ...


class _Format:
    """The stream-chunk envelope both response shapes share; ``chunk_object`` names its type."""

    chunk_object: str

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep

    def frame(self, chunk: dict[str, Any]) -> bytes:
        return sse(chunk)

    def tail(self, usage: dict[str, Any]) -> list[bytes]:
        frames = [sse(self.usage_chunk(usage))] if self.prep.include_usage else []
        return [*frames, b"data: [DONE]\n\n"]

    def error_frames(self, error: OpenAIError) -> list[bytes]:
        return [sse(error.body()), b"data: [DONE]\n\n"]

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.prep.request_id, "object": self.chunk_object, "created": self.prep.created,
            "model": self.prep.model, "system_fingerprint": None, "choices": choices,
        }
        if self.prep.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk


class ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"

    def __init__(self, prep: Prepared) -> None:
        super().__init__(prep)
        self._started: set[int] = set()

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        if i not in self._started:
            self._started.add(i)
            result.append(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        tool_deltas = list(getattr(out, "tool_call_deltas", ()) or ())
        if out.new_text or tool_deltas:
            delta: dict[str, Any] = {}
            if out.new_text:
                delta["content"] = out.new_text
            if tool_deltas:
                delta["tool_calls"] = tool_deltas
            result.append(self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]))
        if out.finished:
            result.append(self._chunk([{"index": i, "delta": {}, "logprobs": None,
                                        "finish_reason": finish_reason(out)}]))
        return result

    def whole(self, acc: ChoiceText, usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i in range(len(self.prep.requests)):
            message: dict[str, Any] = {"role": "assistant", "content": "".join(acc.text[i]), "refusal": None}
            if acc.tools.get(i):
                message["tool_calls"] = [acc.tools[i][k] for k in sorted(acc.tools[i])]
            choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": acc.finish.get(i)})
        return {
            "id": self.prep.request_id, "object": "chat.completion", "created": self.prep.created,
            "model": self.prep.model, "system_fingerprint": None, "choices": choices, "usage": usage,
        }


class CompletionFormat(_Format):
    chunk_object = "text_completion"

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        if not out.new_text and not out.finished:
            return []
        reason = finish_reason(out) if out.finished else None
        return [self._chunk([{"index": i, "text": out.new_text, "logprobs": None, "finish_reason": reason}])]

    def whole(self, acc: ChoiceText, usage: dict[str, Any]) -> dict[str, Any]:
        choices = [
            {"index": i, "text": "".join(acc.text[i]), "logprobs": None, "finish_reason": acc.finish.get(i)}
            for i in range(len(self.prep.requests))
        ]
        return {"id": self.prep.request_id, "object": "text_completion", "created": self.prep.created,
                "model": self.prep.model, "system_fingerprint": None, "choices": choices, "usage": usage}
