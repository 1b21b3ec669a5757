"""Anthropic's Messages API (``POST /v1/messages``) as a translation to and from chat.

Request -> chat::

    system "text" | [text blocks]            -> a system message (text parts, cache_control kept)
    user blocks: text, image, tool_result     -> user text/image parts; a tool message per tool_result
    assistant blocks: text, tool_use          -> an assistant message with content and tool_calls
    tools [{name, description, input_schema}] -> chat function tools
    tool_choice auto | any | tool | none      -> "auto" | "required" | a named function | "none"

``cache_control`` breakpoints are parsed and validated by ``promptlint.cache_control`` (the same
parser the linter uses). On the local engine each breakpoint becomes a retention span over the
prompt tokens up to it, and usage is reported as Anthropic does, from what the engine really did::

    prompt tokens  = cache_read_input_tokens + cache_creation_input_tokens + input_tokens
    cache_read     = tokens served from the prefix cache (any tier)
    cache_creation = tokens of full blocks up to the last breakpoint that this request wrote
    input_tokens   = the rest (after the last breakpoint, or a partial block before it)

Stream events: message_start, content_block_start, ping, content_block_delta..., content_block_stop,
(tool_use blocks: start, input_json_delta, stop), message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictBool

from engine.protocol import RequestOutput
from gateway.errors import OpenAIError, invalid_request
from gateway.formats import ChoiceText, Kept, sse
from gateway.ingress import ScannedBody
from gateway.pipeline import Prepared
from gateway.schemas import MAX_NAME_CHARS, Usage, null_means
from promptlint.cache_control import Breakpoint

BLOCK_TYPES = ("text", "image", "tool_use", "tool_result")

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


# A list index in an OpenAI ``param`` (``messages[0].content``); Anthropic writes it dotted (``messages.0.content``).
_INDEX = re.compile(r"\[(\d+)\]")


def error_body(err: OpenAIError) -> dict[str, Any]:
    """An ``OpenAIError`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``. The
    field at fault leads the message, in Anthropic's dotted form, as its own errors name it."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    param = _INDEX.sub(r".\1", err.param) if err.param else None
    message = f"{param}: {err.message}" if param and not err.message.startswith(param) else err.message
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesRequest(ScannedBody):
    """The body of ``POST /v1/messages``. Unknown fields are tolerated."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    stream: Annotated[StrictBool, null_means(False)] = False
    metadata: dict[str, Any] | None = None

class CountTokensRequest(MessagesRequest):
    """The body of ``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: int = Field(1, ge=1)


def _text_part(block: dict[str, Any]) -> dict[str, Any]:
    part = {"type": "text", "text": block["text"]}
    if block.get("cache_control") is not None:
        part["cache_control"] = block["cache_control"]  # a provider route to Anthropic honours it
    return part


def _flat(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only parts without cache marks as one string (what every chat template renders)."""
    if all(p["type"] == "text" and "cache_control" not in p for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid_request("content must be a string or a list of content blocks", param=where)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in BLOCK_TYPES:
            raise invalid_request(
                f"Input tag {kind!r} found using 'type' does not match any of the expected tags: "
                f"{', '.join(map(repr, BLOCK_TYPES))}", param=f"{where}[{j}].type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise invalid_request("Field required", param=f"{where}[{j}].text")
        if kind in ("tool_use", "tool_result"):  # chat needs the ids to pair a result with its call
            key = "id" if kind == "tool_use" else "tool_use_id"
            if not isinstance(block.get(key), str):
                raise invalid_request("Field required", param=f"{where}[{j}].{key}")
    return content


def _tool_result_text(block: dict[str, Any]) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return str(content)


def _user_messages(blocks: list[dict[str, Any]], called: set[str], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks: a tool message per ``tool_result`` (each answering one of the ``called``
    ids of the assistant's earlier ``tool_use`` blocks), then its text and images as one message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        if b["type"] == "tool_result":
            if b["tool_use_id"] not in called:  # Anthropic refuses it too; chat would, naming its own message
                raise invalid_request(
                    f"unexpected `tool_use_id` found in `tool_result` blocks: {b['tool_use_id']}. Each "
                    "`tool_result` block must have a corresponding `tool_use` block in a previous message.",
                    param=f"{where}[{j}].tool_use_id")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b)})
        elif b["type"] == "text":
            parts.append(_text_part(b))
        elif b["type"] == "image":
            src = b.get("source") or {}
            url = src.get("url") or f"data:{src.get('media_type', '')};base64,{src.get('data', '')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise invalid_request(f"a user message cannot hold a {b['type']!r} block", param="messages")
    if parts:
        out.append({"role": "user", "content": _flat(parts)})
    return out


def _assistant_message(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for b in blocks:
        if b["type"] == "text":
            parts.append(_text_part(b))
        elif b["type"] == "tool_use":
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": str(b.get("name", "")), "arguments": json.dumps(b.get("input", {}))}})
        else:
            raise invalid_request(f"an assistant message cannot hold a {b['type']!r} block", param="messages")
    if calls:
        return {"role": "assistant", "content": _flat(parts) if parts else None, "tool_calls": calls}
    # a turn of no blocks (an empty prefill) said nothing: "", since chat wants content or tool calls
    return {"role": "assistant", "content": _flat(parts) if parts else ""}


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` -> chat messages. Raises ``OpenAIError`` (400) naming the field."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _flat([_text_part(b) for b in _blocks(system, "system")])})
    called: set[str] = set()  # the ids of the tool_use blocks so far
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise invalid_request(f"Input should be 'user' or 'assistant', got {role!r}", param=f"messages[{i}].role")
        blocks = _blocks(m.get("content"), f"messages[{i}].content")
        if role == "user":
            out += _user_messages(blocks, called, f"messages[{i}].content")
        else:
            turn = _assistant_message(blocks)
            called.update(call["id"] for call in turn.get("tool_calls", ()))
            out.append(turn)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t.get("name"), str):
            raise invalid_request("Field required", param=f"tools[{i}].name")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


_CHAT_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # Messages tool_choice type -> chat's


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": str(choice.get("name", ""))}}
    # a JSON list or object as the type is unhashable: refused below like any other wrong type
    mapped = _CHAT_TOOL_CHOICE.get(kind) if isinstance(kind, str) else None
    if mapped is None:
        raise invalid_request(f"tool_choice type must be 'auto', 'any', 'tool' or 'none', got {kind!r}",
                              param="tool_choice.type")
    return mapped


def chat_parallel_tool_calls(choice: dict[str, Any] | None) -> bool | None:
    """``tool_choice.disable_parallel_tool_use: true`` (on auto, any or tool) -> ``parallel_tool_calls: false``."""
    if choice is None or choice.get("disable_parallel_tool_use") is None:
        return None
    disable = choice["disable_parallel_tool_use"]
    if not isinstance(disable, bool):
        raise invalid_request("Input should be a valid boolean", param="tool_choice.disable_parallel_tool_use")
    return not disable


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat completions body a Messages request runs as."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.system, req.messages),
                            "max_tokens": req.max_tokens}
    user = (req.metadata or {}).get("user_id")
    for name, value in (("tools", chat_tools(req.tools)), ("tool_choice", chat_tool_choice(req.tool_choice)),
                        ("parallel_tool_calls", chat_parallel_tool_calls(req.tool_choice)),
                        ("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("top_k", req.top_k or None),  # Anthropic's 0 is "off", as omitting it
                        ("user", user if isinstance(user, str) else None)):
        if value is not None:
            body[name] = value
    if req.stream:
        body["stream"] = True
    return body


def prefix_body(req: MessagesRequest, bp: Breakpoint) -> dict[str, Any]:
    """The request cut right after breakpoint ``bp`` (what its cache entry covers), as system + messages."""
    system: Any = None
    messages: list[dict[str, Any]] = []
    if bp.section == "system":
        system = req.system if isinstance(req.system, str) else list(req.system or [])[: (bp.block or 0) + 1]
    elif bp.section == "messages":
        system = req.system
        messages = [*req.messages[: bp.message]]
        m = dict(req.messages[bp.message or 0])
        if isinstance(m.get("content"), list) and bp.block is not None:
            m["content"] = m["content"][: bp.block + 1]
        messages.append(m)
    return {"system": system, "messages": messages}


@dataclass(frozen=True)
class CacheUsage:
    """Anthropic usage of one request, from the engine's counts and where the breakpoints fell."""

    input_tokens: int
    cache_read: int
    cache_creation: int
    creation_1h: int

    @classmethod
    def of(cls, prompt: int, cached: int, written_upto: int, long_upto: int, reported: int = 0) -> CacheUsage:
        """``written_upto``: tokens in full blocks up to the last breakpoint (the blocks that end up cached);
        ``long_upto``: the same for the last 1h breakpoint. ``reported``: the cache writes an upstream
        provider reported (a provider route), taken as they are."""
        if reported:
            creation = min(reported, prompt - cached)
            return cls(prompt - cached - creation, cached, creation, 0)
        creation = max(0, min(written_upto, prompt) - cached)
        creation_1h = max(0, min(long_upto, prompt) - cached)
        return cls(prompt - cached - creation, cached, creation, min(creation_1h, creation))

    def as_dict(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": self.cache_creation, "cache_read_input_tokens": self.cache_read,
            "cache_creation": {"ephemeral_5m_input_tokens": self.cache_creation - self.creation_1h,
                               "ephemeral_1h_input_tokens": self.creation_1h},
        }


_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}  # a stop-string hit: "stop_sequence"


class MessagesFormat:
    """Engine increments of one choice -> an Anthropic message, or its stream of events.

    ``written_upto``/``long_upto``: see ``CacheUsage.of`` (0 when the request has no breakpoint)."""

    def __init__(self, prep: Prepared, *, written_upto: int, long_upto: int,
                 reported_creation: Callable[[], int] = lambda: 0) -> None:
        self.prep = prep
        self.written_upto = written_upto
        self.long_upto = long_upto
        self.reported_creation = reported_creation
        self.msg_id = "msg_" + uuid.uuid4().hex
        # choice 0: tool calls parsed (local engine) or streamed (provider); a stream sends them as tool_use
        # blocks at its end, its text as it comes (``whole`` is given the responder's own ChoiceText)
        self.acc = ChoiceText(prep, keep=Kept.TOOL_CALLS)
        self.started = False
        self.text_open = False
        self.finish: str | None = None
        self.prompt = self.cached = 0

    def _usage(self, prompt: int, cached: int, output: int) -> dict[str, Any]:
        return CacheUsage.of(prompt, cached, self.written_upto, self.long_upto,
                             self.reported_creation()).as_dict(output)

    def _stop_sequence(self) -> str | None:
        """The stop sequence that ended the answer (the engine says which), if one did."""
        return self.acc.stop_sequence.get(0)

    def _stop_reason(self, has_calls: bool) -> str:
        if has_calls:
            return "tool_use"
        if self._stop_sequence() is not None:
            return "stop_sequence"
        return _STOP_REASONS.get(self.finish or "stop", "end_turn")

    def _ended_by(self, has_calls: bool) -> str | None:
        """The message's ``stop_sequence``: set exactly when ``stop_reason`` is ``"stop_sequence"``."""
        return None if has_calls else self._stop_sequence()

    def _tool_blocks(self) -> list[dict[str, Any]]:
        blocks = []
        for c in self.acc.tool_calls(0):
            try:
                args = json.loads(c["function"]["arguments"] or "{}")
            except json.JSONDecodeError:
                args = {"_raw": c["function"]["arguments"]}
            blocks.append({"type": "tool_use", "id": c["id"] or "toolu_" + uuid.uuid4().hex,
                           "name": c["function"]["name"], "input": args})
        return blocks

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None, usage: dict[str, Any],
                 stop_sequence: str | None = None) -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.prep.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def whole(self, acc: ChoiceText, usage: Usage) -> dict[str, Any]:
        self.acc = acc
        self.finish = acc.finish.get(0)
        text = "".join(acc.text.get(0, []))
        tools = self._tool_blocks()
        content = ([{"type": "text", "text": text}] if text or not tools else []) + tools
        return self._message(content, self._stop_reason(bool(tools)), self._usage(
            usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]),
            self._ended_by(bool(tools)))

    # -- the stream -------------------------------------------------------------------------------

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            # The engine reports prompt and cached tokens with its first increment.
            events.append({"type": "message_start", "message": self._message(
                [], None, self._usage(out.prompt_tokens, out.cached_tokens, 0))})
        content = self.acc.add(0, out).content  # text outside <tool_call> tags
        if content:
            if not self.text_open:
                self.text_open = True
                events += [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                           {"type": "ping"}]
            events.append({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": content}})
        if out.finished:
            self.finish = self.acc.finish.get(0)
        return events

    def frame(self, chunk: dict[str, Any]) -> bytes:
        return sse(chunk, chunk["type"])

    def tail(self, usage: Usage) -> list[bytes]:
        events: list[dict[str, Any]] = []
        tools = self._tool_blocks()
        if not self.text_open and not tools:
            self.text_open = True
            events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        index = 0
        if self.text_open:
            events.append({"type": "content_block_stop", "index": 0})
            index = 1
        for block in tools:
            events += [
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                {"type": "content_block_stop", "index": index},
            ]
            index += 1
        full = self._usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                           usage["completion_tokens"])
        events += [{"type": "message_delta", "delta": {"stop_reason": self._stop_reason(bool(tools)),
                                                       "stop_sequence": self._ended_by(bool(tools))}, "usage": full},
                   {"type": "message_stop"}]
        return [self.frame(e) for e in events]

    def error_frames(self, error: OpenAIError) -> list[bytes]:
        return [sse(error_body(error), "error")]

    async def finalize(self) -> None:
        """Nothing: a message is not kept."""

