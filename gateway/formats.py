"""OpenAI response objects for chat and text completions (whole responses and stream chunks).

Stream chunk sequence for one chat request (what the openai SDK parses)::

    {"object": "chat.completion.chunk", "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]}
    {... "choices": [{"index": i, "delta": {"content": "Hel"}, "finish_reason": null}]}     (many)
    {... "choices": [{"index": i, "delta": {}, "finish_reason": "stop"}]}                   (one per choice)
    {... "choices": [], "usage": {...}}              (only with stream_options.include_usage)
    [DONE]

With ``include_usage`` every other chunk carries ``"usage": null``, as OpenAI sends it.

Local-engine tool calls: when the request's tools are parsed (``Prepared.tool_parsing``), each
choice's text goes through a ``gateway.tool_calls.ToolCallParser``: content deltas carry the
text outside ``<tool_call>`` tags, ``delta.tool_calls`` the calls (name first, then arguments
increments), and a choice that called a tool and stopped ends with ``finish_reason
"tool_calls"``. Logprobs ride in the chunk of the tokens they score: chat
``choices[].logprobs.content[]`` ({token, logprob, bytes, top_logprobs}), completions the legacy
``{tokens, token_logprobs, top_logprobs, text_offset}``.

Completions' ``echo`` (``Prepared.echo``): a choice's text starts with its prompt, and with logprobs
its logprobs object starts with the prompt's tokens (the engine's ``RequestOutput.prompt_logprobs``),
the first of them with ``null`` for its logprob and top logprobs, as OpenAI's legacy API and vLLM
answer. Streaming, the prompt rides in the choice's first chunk, before its first completion text.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from engine.protocol import PromptLogprobs, RequestOutput, TokenLogprob
from gateway.errors import OpenAIError
from gateway.pipeline import Prepared
from gateway.schemas import Usage
from gateway.tool_calls import ParsedDelta, ToolCallParser, merge_tool_deltas
from gateway.upstream import ProviderOutput
from gateway.wire_json import ascii_json


def finish_reason(out: RequestOutput) -> str | None:
    reason = out.finish_reason
    if reason in (None, "abort", "error"):
        return "stop" if out.finished else None
    return reason


def _provider_tool_deltas(out: RequestOutput) -> list[dict[str, Any]]:
    """Tool-call deltas an upstream provider streamed (an engine's own output carries none)."""
    return list(out.tool_call_deltas) if isinstance(out, ProviderOutput) else []


def chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """One ``choices[].logprobs.content[]`` entry."""
    return {
        "token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in lp.top],
    }


def legacy_logprobs(entries: Sequence[TokenLogprob], offset: int, prompt: PromptLogprobs | None = None
                    ) -> dict[str, Any]:
    """The completions ``logprobs`` object; ``offset``: characters of text before these tokens.
    ``prompt`` (echo): the prompt's tokens first, its first token scored ``null``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    if prompt is not None:
        tokens.append(prompt.first_token)
        token_logprobs.append(None)
        top_logprobs.append(None)
        entries = [*prompt.scored, *entries]
    for lp in entries:
        tokens.append(lp.token)
        token_logprobs.append(lp.logprob)
        top_logprobs.append({t: v for t, _, v in lp.top})
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


class _ChoiceState:
    """Per choice: the tool-call parser (when tools are parsed) and what it has produced."""

    def __init__(self, parse_tools: bool) -> None:
        self.parser = ToolCallParser() if parse_tools else None

    def split(self, out: RequestOutput) -> ParsedDelta:
        """The output's text as content and tool-call deltas (flushing the parser at the end)."""
        if self.parser is None:
            return ParsedDelta(content=out.new_text, tool_calls=_provider_tool_deltas(out))
        delta = self.parser.feed(out.new_text)
        if out.finished:
            tail = self.parser.finish()
            delta.content += tail.content
            delta.tool_calls += tail.tool_calls
        return delta

    def finish_reason(self, out: RequestOutput) -> str | None:
        reason = finish_reason(out)
        if reason == "stop" and self.parser is not None and self.parser.called:
            return "tool_calls"
        return reason


class Kept(enum.Enum):
    """What a ``ChoiceText`` keeps of the increments it parses. Every form parses each increment (tool-call
    tags may span increments) and records the finish; what grows with the answer's length is kept only as
    far as its reader needs it."""

    EVERYTHING = "everything"  # text, tool calls, logprobs: a whole response is built from them
    TOOL_CALLS = "tool_calls"  # a stream whose tool calls go out at its end (Anthropic's messages)
    NOTHING = "nothing"  # a stream that sends everything as it comes


class ChoiceText:
    """Accumulates each choice's text, tool calls, logprobs and finish reason for a whole response, or
    as much of them as ``keep`` says (``Kept``): a stream that builds no whole response holds nothing it
    does not send at its end."""

    def __init__(self, prep: Prepared | None = None, *, keep: Kept = Kept.EVERYTHING) -> None:
        self._parse = bool(prep and prep.tool_parsing)
        self._keep = keep
        self._states: dict[int, _ChoiceState] = {}
        self.text: dict[int, list[str]] = defaultdict(list)
        self.tool_deltas: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.logprobs: dict[int, list[TokenLogprob]] = defaultdict(list)
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # the scored prompt (completions' echo)
        self.finish: dict[int, str | None] = {}
        self.stop_sequence: dict[int, str | None] = {}  # the stop string that ended the choice, if one did

    def add(self, i: int, out: RequestOutput) -> ParsedDelta:
        """Take one increment; returns what it added (content outside tool-call tags, call deltas),
        which a door's own stream format sends on."""
        state = self._states.get(i) or self._states.setdefault(i, _ChoiceState(self._parse))
        delta = state.split(out)
        if self._keep is not Kept.NOTHING:
            self.tool_deltas[i] += delta.tool_calls
        if self._keep is Kept.EVERYTHING:
            if delta.content:
                self.text[i].append(delta.content)
            self.logprobs[i] += out.logprobs
            if out.prompt_logprobs is not None:
                self.prompt_logprobs[i] = out.prompt_logprobs
        if out.finished:
            self.finish[i] = state.finish_reason(out)
            self.stop_sequence[i] = out.stop_sequence
        return delta

    def tool_calls(self, i: int) -> list[dict[str, Any]]:
        return merge_tool_deltas(self.tool_deltas[i]) if self.tool_deltas.get(i) else []


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data:`` JSON, with an ``event:`` line where the API names its events."""
    data = b"data: " + ascii_json(obj) + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


class WireFormat(Protocol):
    """How one API shapes a response: the whole body, and the stream as SSE frames.

    ``chunks`` turns one engine increment into zero or more events; ``frame`` encodes one;
    ``tail`` gives the frames after the last increment (usage, terminator) and ``error_frames``
    the in-band error once the status line has gone out. ``finalize`` is awaited after ``whole`` or
    ``tail`` and before what they made is sent: the door's own work on the finished response (the
    Responses door stores it, off the event loop, so a follow-up sent the moment the client has
    the response finds it); an error it raises is the request's."""

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]: ...

    def frame(self, chunk: dict[str, Any]) -> bytes: ...

    def tail(self, usage: Usage) -> list[bytes]: ...

    def error_frames(self, error: OpenAIError) -> list[bytes]: ...

    def whole(self, acc: ChoiceText, usage: Usage) -> dict[str, Any]: ...

    async def finalize(self) -> None: ...


class _Format:
    """The stream-chunk envelope both response shapes share; ``chunk_object`` names its type."""

    chunk_object: str

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep

    def frame(self, chunk: dict[str, Any]) -> bytes:
        return sse(chunk)

    def tail(self, usage: Usage) -> list[bytes]:
        frames = [sse(self.usage_chunk(usage))] if self.prep.include_usage else []
        return [*frames, b"data: [DONE]\n\n"]

    def error_frames(self, error: OpenAIError) -> list[bytes]:
        return [sse(error.body()), b"data: [DONE]\n\n"]

    async def finalize(self) -> None:
        """Nothing: a chat or completions response is not kept."""

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.prep.request_id, "object": self.chunk_object, "created": self.prep.created,
            "model": self.prep.model, "system_fingerprint": None, "choices": choices,
        }
        if self.prep.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk


class ChatFormat(_Format):
    """Chat's whole response and stream. A stream's increments are parsed once (``acc``: tool-call
    tags may span increments); with ``keep_stream`` its choices are also gathered as they go out, so
    the completion it sent can be built whole at its end, as ``StoredChatFormat`` keeps it."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, prep: Prepared, *, keep_stream: bool = False) -> None:
        super().__init__(prep)
        self._started: set[int] = set()
        self.acc = ChoiceText(prep, keep=Kept.EVERYTHING if keep_stream else Kept.NOTHING)

    def _logprobs(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any] | None:
        if self.prep.logprobs is None:
            return None
        return {"content": [chat_logprob(lp) for lp in entries], "refusal": None}

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        if i not in self._started:
            self._started.add(i)
            result.append(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        parsed = self.acc.add(i, out)
        if parsed.content or parsed.tool_calls or out.logprobs:
            delta: dict[str, Any] = {}
            if parsed.content:
                delta["content"] = parsed.content
            if parsed.tool_calls:
                delta["tool_calls"] = parsed.tool_calls
            result.append(self._chunk([{"index": i, "delta": delta, "logprobs": self._logprobs(out.logprobs),
                                        "finish_reason": None}]))
        if out.finished:
            result.append(self._chunk([{"index": i, "delta": {}, "logprobs": None,
                                        "finish_reason": self.acc.finish[i]}]))
        return result

    def whole(self, acc: ChoiceText, usage: Usage) -> dict[str, Any]:
        choices = []
        for i in range(len(self.prep.requests)):
            calls = acc.tool_calls(i)
            text = "".join(acc.text[i])
            # OpenAI sends content null on a message that only calls tools
            message: dict[str, Any] = {"role": "assistant", "content": None if calls and not text.strip() else text,
                                       "refusal": None}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(acc.logprobs[i]),
                            "finish_reason": acc.finish.get(i)})
        return {
            "id": self.prep.request_id, "object": "chat.completion", "created": self.prep.created,
            "model": self.prep.model, "system_fingerprint": None, "choices": choices, "usage": usage,
        }


Keep = Callable[[dict[str, Any]], Awaitable[None]]


class StoredChatFormat(ChatFormat):
    """Chat with ``store: true``: ``keep(completion)`` is awaited once with the ``chat.completion``
    object the client gets (a stream's, built from what it sent), after ``whole`` or ``tail`` and
    before it is sent, so a retrieve sent the moment the client has it finds it. A stream that
    fails or is left before its end keeps nothing."""

    def __init__(self, prep: Prepared, keep: Keep) -> None:
        super().__init__(prep, keep_stream=True)
        self._keep = keep
        self._completed: dict[str, Any] | None = None

    def whole(self, acc: ChoiceText, usage: Usage) -> dict[str, Any]:
        self._completed = super().whole(acc, usage)
        return self._completed

    def tail(self, usage: Usage) -> list[bytes]:
        self._completed = super().whole(self.acc, usage)
        return super().tail(usage)

    async def finalize(self) -> None:
        if self._completed is not None:
            await self._keep(self._completed)


class CompletionFormat(_Format):
    chunk_object = "text_completion"

    def __init__(self, prep: Prepared) -> None:
        super().__init__(prep)
        self._offsets: dict[int, int] = defaultdict(int)  # characters of logprob tokens sent per choice
        self._echoed: set[int] = set()  # choices whose prompt went out (echo)

    def _logprobs(self, i: int, entries: Sequence[TokenLogprob],
                  prompt: PromptLogprobs | None = None) -> dict[str, Any] | None:
        if self.prep.logprobs is None:
            return None
        obj = legacy_logprobs(entries, self._offsets[i], prompt)
        self._offsets[i] += sum(len(token) for token in obj["tokens"])
        return obj

    def _echo(self, i: int) -> str:
        """Choice ``i``'s prompt text the first time it is asked for with echo on, else ""."""
        echo = self.prep.echo
        if echo is None or i in self._echoed:
            return ""
        self._echoed.add(i)
        return echo[i // self.prep.n]

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        prompt = self._echo(i)
        if not prompt and not out.new_text and not out.finished and not out.logprobs:
            return []
        reason = finish_reason(out) if out.finished else None
        logprobs = self._logprobs(i, out.logprobs, out.prompt_logprobs)
        return [self._chunk([{"index": i, "text": prompt + out.new_text, "logprobs": logprobs,
                              "finish_reason": reason}])]

    def whole(self, acc: ChoiceText, usage: Usage) -> dict[str, Any]:
        choices = [
            {"index": i, "text": self._echo(i) + "".join(acc.text[i]),
             "logprobs": self._logprobs(i, acc.logprobs[i], acc.prompt_logprobs.get(i)),
             "finish_reason": acc.finish.get(i)}
            for i in range(len(self.prep.requests))
        ]
        return {"id": self.prep.request_id, "object": "text_completion", "created": self.prep.created,
                "model": self.prep.model, "system_fingerprint": None, "choices": choices, "usage": usage}
