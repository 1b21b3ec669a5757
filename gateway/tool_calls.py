"""Tool calls on the local engine: check ``tools``/``tool_choice``, and parse the model's output.

The chat templates we serve (ChatML, Hermes/Qwen style) ask the model to answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallParser`` turns that text into OpenAI ``tool_calls``, incrementally: text before a
``<tool_call>`` streams as content (holding back only what could be the start of the tag);
inside a call the function name goes out as soon as it is complete, then the ``arguments``
object streams as it is generated, character for character, in
``delta.tool_calls[i].function.arguments`` increments. A whole response feeds the same parser
with the whole text, so streamed and non-streamed results are the same.

``tool_choice``:
    ``none``      the tools are not shown to the model and nothing is parsed
    ``auto``      tools shown; the model decides; its output is parsed
    ``required``  a grammar forces one or more calls of the given tools, arguments valid per schema
    named         a grammar forces one call of that function
``required``/named are enforced by constrained decoding (engine.guided), so they hold for any
model, even random weights.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs

from engine.protocol import GuidedSpec
from gateway.errors import invalid_request

MAX_CALL_SCHEMA_BYTES = 64 * 1024  # the engine's grammar bound (engine.guided.MAX_SCHEMA_BYTES)
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NAME_FIELD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_FIELD = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for the engine and the response."""

    tools: list[dict[str, Any]] | None  # shown to the chat template (None: no tools)
    parse: bool  # parse tool calls out of the output
    guided: GuidedSpec | None  # the grammar that forces a call (required / named)


MAX_SCHEMA_DEPTH = 64  # nesting levels of objects/arrays in one schema


# The drafts whose meta-schemas ship inside jsonschema-rs. Any other ``$schema`` would make it try
# to fetch the URL: a request from client input, on the event loop. Refused before that.
KNOWN_DRAFTS = frozenset(
    u + suffix
    for u in ("http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-06/schema",
              "http://json-schema.org/draft-07/schema", "https://json-schema.org/draft/2019-09/schema",
              "https://json-schema.org/draft/2020-12/schema")
    for suffix in ("", "#")
)


def _shape_problem(node: Any, limit: int) -> str | None:
    """Why ``node`` cannot be checked safely: nested deeper than ``limit`` or an unknown
    ``$schema`` anywhere (iterative: no recursion to blow). None when it can."""
    stack = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return f"is nested deeper than {limit} levels"
        if isinstance(item, dict):
            meta = item.get("$schema")
            if meta is not None and meta not in KNOWN_DRAFTS:
                return f"declares $schema {str(meta)[:80]!r}; use one of the published drafts (4, 6, 7, 2019-09, 2020-12)"
            children = item.values()
        else:
            children = item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return None


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` unless ``schema`` is a valid JSON Schema (its declared draft, else 2020-12).

    jsonschema-rs checks against the meta-schema in well under a millisecond where the pure-Python
    ``jsonschema`` took 0.4 s on a 54 KB schema: this runs on the event loop, before admission."""
    if not isinstance(schema, dict):
        raise invalid_request(f"{param} must be a JSON Schema object", param=param)
    problem = _shape_problem(schema, MAX_SCHEMA_DEPTH)
    if problem is not None:
        raise invalid_request(f"{param} {problem}", param=param)
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        raise invalid_request(f"{param} is not a valid JSON Schema: {exc.message}", param=param) from None
    except (jsonschema_rs.ReferencingError, ValueError, TypeError) as exc:  # not JSON data, a bad reference
        raise invalid_request(f"{param} is not a valid JSON Schema: {str(exc)[:200]}", param=param) from None


def _function(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise invalid_request(f"{param}: only tools of type 'function' are supported", param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME_RE.match(fn["name"]):
        raise invalid_request(
            f"{param}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'", param="tools")
    if "parameters" in fn:
        check_schema(fn["parameters"], f"{param}.function.parameters")
    return fn


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Validate ``tools``/``tool_choice`` (400s name the parameter) and decide what to do."""
    functions = [_function(t, i) for i, t in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid_request("tools: function names must be unique", param="tools")
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if not functions:
        if tool_choice != "none":
            raise invalid_request("tool_choice is only allowed when tools are given", param="tool_choice")
        return ToolPlan(tools=None, parse=False, guided=None)
    if tool_choice == "none":
        return ToolPlan(tools=None, parse=False, guided=None)
    if tool_choice == "auto":
        return ToolPlan(tools=list(tools or []), parse=True, guided=None)
    if tool_choice == "required":
        chosen, repeat = functions, parallel is not False
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise invalid_request(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        chosen, repeat = [functions[names.index(name)]], False
    else:
        raise invalid_request(
            "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            param="tool_choice")
    guided = _call_grammar(chosen, repeat)
    if len(guided.json_schema.encode()) > MAX_CALL_SCHEMA_BYTES:
        raise invalid_request(f"the tools' parameter schemas are larger than {MAX_CALL_SCHEMA_BYTES} bytes in all",
                              param="tools")
    return ToolPlan(tools=list(tools or []), parse=True, guided=guided)


def _call_schema(fn: dict[str, Any], tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one call object, and the ``$defs`` its arguments refer to (renamed so that
    several tools' definitions can live under one root)."""
    params = dict(fn.get("parameters") or {"type": "object"})
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, sub in (params.pop(key, None) or {}).items():
            defs[f"{tag}_{name}"] = sub
    if defs:
        params = _rename_refs(params, tag)
        defs = {k: _rename_refs(v, tag) for k, v in defs.items()}
    call = {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}
    return call, defs


def _rename_refs(node: Any, tag: str) -> Any:
    if isinstance(node, dict):
        out = {k: _rename_refs(v, tag) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{tag}_{ref.removeprefix(prefix)}"
        return out
    if isinstance(node, list):
        return [_rename_refs(v, tag) for v in node]
    return node


def _call_grammar(functions: list[dict[str, Any]], repeat: bool) -> GuidedSpec:
    calls, defs = [], {}
    for i, fn in enumerate(functions):
        call, d = _call_schema(fn, f"tool{i}")
        calls.append(call)
        defs.update(d)
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema = {**schema, "$defs": defs}
    return GuidedSpec(json_schema=json.dumps(schema), prefix=TOOL_START + "\n",
                      suffix="\n" + TOOL_END + ("\n" if repeat else ""), repeat=repeat)


# --------------------------------------------------------------------------- output parsing


@dataclass
class ParsedDelta:
    """What one piece of output adds: content text and tool-call deltas (OpenAI chunk shape)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _ValueScanner:
    """Finds where a JSON object or array ends, fed a character at a time (strings and escapes
    respected), so the arguments can stream without waiting for the closing tag."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, ch: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0


class ToolCallParser:
    """Incremental Hermes-style tool-call parser for one choice. ``feed`` then ``finish``."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.num_calls = 0
        self._reset_call()

    def _reset_call(self) -> None:
        self._name_sent = False
        self._args_start: int | None = None  # index in _buf where the arguments value begins
        self._args_sent = 0  # characters of the arguments value already sent
        self._scanner: _ValueScanner | None = None

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while True:
            if not self._in_call:
                at = self._buf.find(TOOL_START)
                if at < 0:
                    keep = _held_back(self._buf, TOOL_START)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._buf[:at]
                self._buf = self._buf[at + len(TOOL_START) :]
                self._in_call = True
                self._reset_call()
                continue
            end = self._buf.find(TOOL_END)
            body = self._buf if end < 0 else self._buf[:end]
            self._stream_call(body, out)
            if end < 0:
                return out
            self._close_call(body, out, closed=True)
            self._buf = self._buf[end + len(TOOL_END) :]
            self._in_call = False

    def finish(self) -> ParsedDelta:
        """Flush at the end of the output (a call without its closing tag still counts if it parses)."""
        out = ParsedDelta()
        if self._in_call:
            body, self._buf = self._buf, ""
            self._stream_call(body, out)
            self._close_call(body, out, closed=False)
            self._in_call = False
        else:
            out.content, self._buf = self._buf, ""
        return out

    # ------------------------------------------------------------------ one call

    def _header(self, name: str) -> dict[str, Any]:
        return {"index": self.num_calls, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _args_delta(self, text: str) -> dict[str, Any]:
        return {"index": self.num_calls, "function": {"arguments": text}}

    def _stream_call(self, body: str, out: ParsedDelta) -> None:
        """Send the name once it is complete, then whatever new part of the arguments object is known."""
        if not self._name_sent:
            m = _NAME_FIELD.match(body)
            if m is None:
                return
            try:
                name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return
            a = _ARGS_FIELD.match(body, m.end())
            if a is None:
                if len(body) > m.end() + 16:  # another layout: wait for the whole call
                    self._args_start = -1
                return
            out.tool_calls.append(self._header(name))
            self._name_sent = True
            self._args_start = a.end()
        if self._args_start is None or self._args_start < 0:
            return
        if self._scanner is None:
            while self._args_start < len(body) and body[self._args_start].isspace():
                self._args_start += 1
            if len(body) <= self._args_start:
                return
            if body[self._args_start] not in "{[":  # a string or scalar: parsed when the call ends
                self._args_start = -1
                return
            self._scanner = _ValueScanner()
        scanner = self._scanner
        start = self._args_start + self._args_sent
        piece = []
        for ch in body[start:]:
            if scanner.done:
                break
            scanner.feed(ch)
            piece.append(ch)
        if piece:
            self._args_sent += len(piece)
            out.tool_calls.append(self._args_delta("".join(piece)))

    def _close_call(self, body: str, out: ParsedDelta, *, closed: bool) -> None:
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError:
            call = None
        ok = isinstance(call, dict) and isinstance(call.get("name"), str)
        if not self._name_sent:
            if not ok:  # not a call after all: give the text back as content
                out.content += TOOL_START + body + (TOOL_END if closed else "")
                return
            out.tool_calls.append(self._header(call["name"]))
            self._name_sent = True
        if self._scanner is None and ok:  # arguments not streamed (string value or other layout)
            args = call.get("arguments", call.get("parameters", {}))
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.tool_calls.append(self._args_delta(text))
        self.num_calls += 1


def merge_tool_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole ``tool_calls`` from a sequence of deltas (what a non-streamed response carries)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.get("index", 0), {"id": None, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
        call["id"] = d.get("id") or call["id"]
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[k] for k in sorted(calls)]

