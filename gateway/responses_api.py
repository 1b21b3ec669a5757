"""The OpenAI Responses API (``POST /v1/responses``) as a translation to and from chat.

A Responses request becomes one chat request (``to_chat``) that runs through the same pipeline,
cache and ledger as ``/v1/chat/completions``; ``ResponsesFormat`` shapes the result back::

    instructions                      -> system message (never carried over from a previous response)
    previous response's conversation  -> the messages before this input (stored per tenant)
    input "text" | message items      -> user / system / developer / assistant messages
    function_call items               -> an assistant message with tool_calls
    function_call_output items        -> tool messages
    tools [{"type": "function", ...}] -> chat tools
    tool_choice {"type": "function", "name"} -> chat's {"type": "function", "function": {"name"}}
    text.format text | json_object | json_schema {name, schema, strict} -> chat response_format
    top_logprobs, include ["message.output_text.logprobs"] -> chat logprobs / top_logprobs

Fields that would change the output and that this gateway cannot honour (``reasoning`` effort,
``truncation: "auto"``, ``max_tool_calls``, ``background``, ``conversation``, ``prompt``, a
``text.verbosity`` other than "medium") are refused with a 400 naming them, never dropped.

Stream events, in the order the openai SDK's accumulator expects::

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done, [function_call items: added, arguments.delta, arguments.done, done],
    response.completed | response.incomplete
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from engine.protocol import MAX_TOP_LOGPROBS, RequestOutput, TokenLogprob
from gateway.errors import OpenAIError, invalid_request, unsupported_parameter, unsupported_value
from gateway.formats import ChoiceText, chat_logprob, sse
from gateway.ingress import ScannedBody
from gateway.pipeline import (
    HONOURED_VLLM_EXTRAS,
    UNSUPPORTED_LOCAL_EXTRAS,
    MessagePaths,
    MessageSource,
    Prepared,
    RequestFields,
    refuse_verbosity,
)
from gateway.schemas import MAX_NAME_CHARS, SCHEMA_NAME_PATTERN, Metadata, Usage, now, null_means
from gateway.structured_output import guided_for_response_format

ITEM_TYPES = ("message", "function_call", "function_call_output")
_ROLES = ("user", "system", "developer", "assistant")
# Responses content part -> chat content part (text for the local engine; images for providers)
_TEXT_PARTS = ("input_text", "output_text", "text")


# The context-length error names the Responses fields.
RESPONSES_FIELDS = RequestFields(prompt="input", max_tokens="max_output_tokens", overflow="max_output_tokens",
                                 response_format="text.format")

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# ``include`` values that add data about items this gateway never produces (built-in tool calls,
# reasoning, input images): accepted, and nothing to add.
_INCLUDE_NOTHING = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                    "message.input_image.image_url", "computer_call_output.output.image_url",
                    "code_interpreter_call.outputs", "reasoning.encrypted_content")
# Extra (vLLM-style) fields sent on to the chat request: the chat pipeline honours or refuses them.
_CHAT_EXTRAS = (*HONOURED_VLLM_EXTRAS, *UNSUPPORTED_LOCAL_EXTRAS)


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON valid for ``schema`` (enforced as chat's
    ``response_format``)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=SCHEMA_NAME_PATTERN)  # OpenAI's rule: 1-64 of [a-zA-Z0-9_-]
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # "schema" would shadow BaseModel.schema
    description: str | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_has_a_name(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs 'name' and 'schema'")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """Chat's ``response_format`` for this format (None: plain text, no constraint)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": self.name, "schema": self.json_schema, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponseText(BaseModel):
    """``text``: the output's format, and its verbosity (only "medium", the default, is honoured)."""

    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(ScannedBody):
    """The body of ``POST /v1/responses``. Unknown fields are tolerated, as OpenAI does."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: Annotated[StrictBool, null_means(False)] = False
    store: Annotated[StrictBool, null_means(True)] = True
    previous_response_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt_cache_retention: str | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    metadata: Metadata = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponseText | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    background: StrictBool | None = None

    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())


def _chat_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{where} must be a string or a list of content parts", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        else:
            raise invalid_request(
                f"Invalid value: {kind!r}. Supported content part types are: 'input_text', 'output_text', "
                "'input_image'.", param=f"{where}[{j}].type")
    return parts


@dataclass
class ChatInput:
    """A Responses ``input`` as chat messages, and where in ``input`` each one came from: the chat
    pipeline's refusals then name the client's item (``pipeline.MessagePaths``), not a chat message."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    sources: list[MessageSource] = field(default_factory=list)

    def add(self, message: dict[str, Any], source: MessageSource) -> None:
        self.messages.append(message)
        self.sources.append(source)


def _string_field(item: dict[str, Any], name: str, where: str) -> str:
    """``item[name]``, which OpenAI requires to be a string: else a 400 naming ``{where}.{name}``."""
    value = item.get(name)
    if isinstance(value, str):
        return value
    if value is None:
        raise invalid_request(f"Missing required parameter: '{where}.{name}'.", param=f"{where}.{name}",
                              code="missing_required_parameter")
    raise invalid_request(f"Invalid type for '{where}.{name}': expected a string, but got {type(value).__name__}.",
                          param=f"{where}.{name}", code="invalid_type")


def _call_ids(conversation: Sequence[dict[str, Any]]) -> set[str]:
    """The ids of the tool calls that the assistant turns of a (stored) conversation made."""
    return {call["id"] for m in conversation if m.get("role") == "assistant" for call in m.get("tool_calls") or ()}


def input_messages(req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> ChatInput:
    """The request's ``input`` as chat messages, continuing ``history`` (the stored conversation of
    ``previous_response_id``, whose calls a ``function_call_output`` may answer). Raises
    ``OpenAIError`` (400) naming the bad item, so that the chat request it becomes is valid."""
    turns = ChatInput()
    if req.input is None:
        return turns
    if isinstance(req.input, str):
        turns.add({"role": "user", "content": req.input}, MessageSource("input"))
        return turns
    called = _call_ids(history)
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid_request(
                    f"Invalid value: {role!r}. Supported values are: {', '.join(map(repr, _ROLES))}.",
                    param=f"{where}.role")
            content = _chat_content(item.get("content"), f"{where}.content")
            turns.add({"role": role, "content": content}, MessageSource(where, parts=True))  # part j = part j
        elif kind == "function_call":
            call_id = _string_field(item, "call_id", where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": _string_field(item, "name", where),
                                 "arguments": _string_field(item, "arguments", where)}}
            called.add(call_id)
            last = turns.messages[-1] if turns.messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                turns.add({"role": "assistant", "content": None, "tool_calls": [call]}, MessageSource(where))
        elif kind == "function_call_output":
            call_id = _string_field(item, "call_id", where)
            if call_id not in called:  # OpenAI's words; chat would refuse the tool message it becomes
                raise invalid_request(f"No tool call found for function call output with call_id {call_id}.",
                                      param=f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            turns.add({"role": "tool", "tool_call_id": call_id, "content": text}, MessageSource(where))
        else:
            raise invalid_request(
                f"Invalid value: {kind!r}. Supported values are: {', '.join(map(repr, ITEM_TYPES))}.",
                param=f"{where}.type")
    return turns


# The chat part types a Responses part runs as, by the Responses name (a refusal names the client's).
_PART_TYPES = (("image_url", "input_image"),)


def request_fields(req: ResponsesRequest, history: int, turns: ChatInput) -> RequestFields:
    """``RESPONSES_FIELDS`` with where each message of the chat request came from, in ``chat_body``'s
    order: ``instructions``, the ``history`` messages of ``previous_response_id``, then ``input``."""
    lead = [MessageSource("instructions")] if req.instructions else []
    sources = (*lead, *[MessageSource("previous_response_id")] * history, *turns.sources)
    return replace(RESPONSES_FIELDS, messages=MessagePaths(sources, _PART_TYPES))


def resumed(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored conversation as a follow-up continues it. Rows written before chat refused an
    assistant turn with neither content nor tool calls hold one for an empty output: it said ""."""
    return [{**m, "content": ""} if m.get("role") == "assistant" and m.get("content") is None
            and not m.get("tool_calls") else m for m in conversation]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> chat tools (nested under ``function``)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid_request(f"tool type {tool.get('type')!r} is not supported by this gateway; "
                                  "send function tools", param=f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses ``tool_choice`` -> chat's: the named function is flat here, nested under ``function`` there."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid_request(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice")


def _refuse(param: str, why: str) -> OpenAIError:
    return unsupported_parameter(f"{param}: {why}", param)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields that would change the output and cannot be honoured: a 400 naming each (never dropped),
    ``unsupported_parameter``, or ``unsupported_value`` for a value of a field that is honoured."""
    if req.reasoning and any(v not in (None, "none") for v in req.reasoning.values()):
        raise _refuse("reasoning", "this model does not reason in a separate channel; omit it")
    if req.truncation == "auto":
        raise unsupported_value("truncation: 'auto' is not supported: send 'disabled' (the default); an input "
                                "over the context is a 400", "truncation")
    if req.max_tool_calls is not None:
        raise _refuse("max_tool_calls", "not supported; omit it (parallel_tool_calls: false allows one call)")
    if req.background:
        raise _refuse("background", "background responses are not supported; omit it or send false")
    extras = req.model_extra or {}
    for name, hint in (("conversation", "use previous_response_id"), ("prompt", "send instructions and input")):
        if extras.get(name) is not None:
            raise _refuse(name, f"not supported; {hint}")
    if req.text is not None:
        refuse_verbosity(req.text.verbosity, "text.verbosity")
    for i, item in enumerate(req.include or ()):
        if item != LOGPROBS_INCLUDE and item not in _INCLUDE_NOTHING:
            raise invalid_request(f"Invalid value: {item!r} is not a supported include value.", param=f"include[{i}]")


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    response_format = fmt.response_format()
    # checked here too (its size first), so that a bad schema names the Responses field
    guided_for_response_format(response_format, "text.format")
    return response_format


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]], conversation: list[dict[str, Any]]) -> dict:
    """The chat completions body this request runs as. ``history`` is the stored conversation of
    ``previous_response_id``; ``conversation`` = history + this input (what gets stored)."""
    refuse_unsupported(req)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise invalid_request("input must not be empty", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    logprobs = req.wants_logprobs()
    for name, value in (("tools", chat_tools(req.tools)), ("tool_choice", chat_tool_choice(req.tool_choice)),
                        ("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("user", req.user), ("prompt_cache_key", req.prompt_cache_key),
                        ("prompt_cache_retention", req.prompt_cache_retention),
                        ("parallel_tool_calls", req.parallel_tool_calls),
                        ("response_format", _response_format(req.text_format())),
                        ("logprobs", True if logprobs else None),
                        ("top_logprobs", (req.top_logprobs or 0) if logprobs else None)):
        if value is not None:
            body[name] = value
    extras = req.model_extra or {}
    body.update({name: extras[name] for name in _CHAT_EXTRAS if extras.get(name) is not None})
    if req.stream:
        body["stream"] = True
    return body


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def responses_usage(usage: Usage) -> dict[str, Any]:
    """Chat ``usage`` -> Responses ``usage`` (input/output tokens, cached tokens in the details)."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def conversation_after(conversation: list[dict[str, Any]], output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages a follow-up with ``previous_response_id`` continues from."""
    calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in output if o["type"] == "function_call"]
    text = "".join(p["text"] for o in output if o["type"] == "message" for p in o["content"])
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return [*conversation, turn]


Completed = Callable[[dict[str, Any]], Awaitable[None]]


class ResponsesFormat:
    """Engine increments of one choice -> a Responses object, or its stream of typed events.

    ``on_complete(response)`` is awaited once with the finished response object (to store it), in
    ``finalize``: after ``whole`` or ``tail`` built it, before it is sent."""

    def __init__(self, prep: Prepared, req: ResponsesRequest, on_complete: Completed) -> None:
        self.prep = prep
        self.req = req
        self.on_complete = on_complete
        self.completed: dict[str, Any] | None = None  # the finished response, once built
        self.created_at = now()
        self.seq = 0
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []  # of the text, when asked for (include / top_logprobs)
        self.logprobs_sent = 0  # how many rode on output_text.delta events so far
        self.calls = ChoiceText(prep)  # choice 0: tool calls parsed (local engine) or streamed (provider)
        self.finish: str | None = None
        self.started = False
        self.msg_open = False

    # -- the response object ------------------------------------------------------------------

    def _message_item(self, status: Literal["in_progress", "completed", "incomplete"],
                      text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._text_part(text, self.logprobs)]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _text_part(text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": [chat_logprob(lp) for lp in logprobs]}

    def _status(self) -> Literal["completed", "incomplete"]:
        """Of the response and of its message: cut at max_output_tokens, both are incomplete (as at OpenAI)."""
        return "incomplete" if self.finish == "length" else "completed"

    def _call_items(self) -> list[dict[str, Any]]:
        return [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": c["id"] or "call_" + uuid.uuid4().hex,
                 "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                for c in self.calls.tool_calls(0)]

    def _output(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        text = "".join(self.text)
        items = [self._message_item(self._status(), text)] if text or not calls else []
        return [*items, *calls]

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        r = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.prep.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.prep.model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": r.instructions,
            "previous_response_id": r.previous_response_id, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p, "tools": r.tools or [],
            "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "store": r.store, "metadata": r.metadata or {}, "text": self._text_echo(),
            "top_logprobs": r.top_logprobs, "truncation": r.truncation or "disabled",
            "prompt_cache_key": r.prompt_cache_key, "user": r.user,
        }

    def _text_echo(self) -> dict[str, Any]:
        """The request's ``text`` as OpenAI echoes it: the format asked for (plain text by default)."""
        fmt = self.req.text_format()
        echo: dict[str, Any] = {"format": fmt.echo() if fmt is not None else {"type": "text"}}
        if self.req.text is not None and self.req.text.verbosity is not None:
            echo["verbosity"] = self.req.text.verbosity
        return echo

    def _finished(self, usage: Usage, calls: list[dict[str, Any]]) -> dict[str, Any]:
        response = self._response(self._status(), self._output(calls), responses_usage(usage))
        self.completed = response
        return response

    async def finalize(self) -> None:
        if self.completed is not None:
            await self.on_complete(self.completed)

    def whole(self, acc: ChoiceText, usage: Usage) -> dict[str, Any]:
        self.text = acc.text.get(0, [])
        self.logprobs = acc.logprobs.get(0, []) if self.req.wants_logprobs() else []
        self.calls = acc
        self.finish = acc.finish.get(0)
        return self._finished(usage, self._call_items())

    # -- the stream -------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _ids(self) -> dict[str, Any]:
        return {"item_id": self.msg_id, "output_index": 0, "content_index": 0}

    def _open_message(self) -> list[dict[str, Any]]:
        self.msg_open = True
        return [self._event("response.output_item.added", output_index=0, item=self._message_item("in_progress", None)),
                self._event("response.content_part.added", **self._ids(), part=self._text_part(""))]

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            pending = self._response("in_progress", [], None)
            events += [self._event("response.created", response=pending),
                       self._event("response.in_progress", response=pending)]
        content = self.calls.add(0, out).content  # text outside <tool_call> tags
        if self.req.wants_logprobs():
            self.logprobs += out.logprobs
        if content:
            if not self.msg_open:
                events += self._open_message()
            self.text.append(content)
            events.append(self._event("response.output_text.delta", **self._ids(), delta=content,
                                      logprobs=self._unsent_logprobs()))
        if out.finished:
            self.finish = self.calls.finish.get(0)
        return events

    def _unsent_logprobs(self) -> list[dict[str, Any]]:
        """Logprobs of the tokens since the last delta (a token's text may reach the client later
        than its logprob: text is held back while it could still be a stop string's start)."""
        fresh = self.logprobs[self.logprobs_sent:]
        self.logprobs_sent = len(self.logprobs)
        return [chat_logprob(lp) for lp in fresh]

    def frame(self, chunk: dict[str, Any]) -> bytes:
        return sse(chunk, chunk["type"])

    def tail(self, usage: Usage) -> list[bytes]:
        events: list[dict[str, Any]] = []
        calls = self._call_items()
        if not self.msg_open and not calls:
            events += self._open_message()  # an empty answer is still one (empty) message
        if self.msg_open:
            text = "".join(self.text)
            logprobs = [chat_logprob(lp) for lp in self.logprobs]
            events += [self._event("response.output_text.done", **self._ids(), text=text, logprobs=logprobs),
                       self._event("response.content_part.done", **self._ids(),
                                   part=self._text_part(text, self.logprobs)),
                       self._event("response.output_item.done", output_index=0,
                                   item=self._message_item(self._status(), text))]
        base = 1 if self.msg_open else 0
        for k, call in enumerate(calls):
            index = base + k
            events += [
                self._event("response.output_item.added", output_index=index,
                            item={**call, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                            delta=call["arguments"]),
                self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                            name=call["name"], arguments=call["arguments"]),
                self._event("response.output_item.done", output_index=index, item=call),
            ]
        response = self._finished(usage, calls)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return [self.frame(e) for e in events]

    def error_frames(self, error: OpenAIError) -> list[bytes]:
        failed = self._response("failed", [], None)
        failed["error"] = {"code": error.code or "server_error", "message": error.message}
        events = [self._event("error", code=error.code, message=error.message, param=error.param),
                  self._event("response.failed", response=failed)]
        return [self.frame(e) for e in events]


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")
