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
                  (at most ``MAX_PARALLEL_CALLS``; one when ``parallel_tool_calls`` is false)
    named         a grammar forces one call of that function
``required``/named are enforced by constrained decoding (engine.guided), so they hold for any
model, even random weights. Between two calls the grammar puts exactly one newline and after
each complete call it allows the end of the turn, so the model decides how many calls it makes.
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
# The most calls a ``required`` turn may make with parallel calls allowed. A bound, because a weak
# model at temperature 0 can repeat one call until max_tokens (SmolLM2-135M made 7 identical
# 28-token calls and ran into max_tokens 200 under the old unbounded grammar). 8, because a turn
# that needs more loses nothing: the agent runs these, sends the results, and the model calls
# again in its next turn; a model stuck in a loop stops after 8 copies (~230 tokens for a small
# call) instead of at max_tokens.
MAX_PARALLEL_CALLS = 8
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
CALL_SEPARATOR = "\n"  # between two calls of a forced turn (the Hermes templates' layout)
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


def _check_tools_size(tools: list[dict[str, Any]] | None) -> None:
    """A 400 when the tools, serialized, exceed ``MAX_CALL_SCHEMA_BYTES``: whatever ``tool_choice``.

    Measured on the raw JSON (one C-speed ``json.dumps``) before any schema is meta-validated or a
    call grammar built: 1,000 tools of 60 properties cost 0.7 s of event loop in those steps before
    the grammar's size bound refused them. The bound holds for ``auto`` too: these tools only run
    on the local engine, whose context (8,192 tokens by default) 64 KiB of schemas (~16,000
    tokens) would overflow anyway; a forced call's grammar is bounded by the same number."""
    if not tools:
        return
    try:
        size = len(json.dumps(tools).encode())
    except (TypeError, ValueError, RecursionError):
        raise invalid_request("tools are not serialisable JSON", param="tools") from None
    if size > MAX_CALL_SCHEMA_BYTES:
        raise invalid_request(f"the tools are larger than {MAX_CALL_SCHEMA_BYTES} bytes in all ({size})",
                              param="tools", code="schema_too_large")


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """Validate ``tools``/``tool_choice`` (400s name the parameter) and decide what to do.

    The tools' size is bounded first (``_check_tools_size``), before each schema is meta-validated."""
    _check_tools_size(tools)
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
        chosen, max_calls = functions, (1 if parallel is False else MAX_PARALLEL_CALLS)
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise invalid_request(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        chosen, max_calls = [functions[names.index(name)]], 1
    else:
        raise invalid_request(
            "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            param="tool_choice")
    guided = _call_grammar(chosen, max_calls)
    if len(guided.json_schema.encode()) > MAX_CALL_SCHEMA_BYTES:
        raise invalid_request(f"the tools' parameter schemas are larger than {MAX_CALL_SCHEMA_BYTES} bytes in all",
                              param="tools", code="schema_too_large")
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


def _call_grammar(functions: list[dict[str, Any]], max_calls: int) -> GuidedSpec:
    """One to ``max_calls`` ``<tool_call>`` blocks, each one call object of ``functions``."""
    calls, defs = [], {}
    for i, fn in enumerate(functions):
        call, d = _call_schema(fn, f"tool{i}")
        calls.append(call)
        defs.update(d)
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema = {**schema, "$defs": defs}
    return GuidedSpec(json_schema=json.dumps(schema), prefix=TOOL_START + "\n", suffix="\n" + TOOL_END,
                      max_items=max_calls, separator=CALL_SEPARATOR if max_calls > 1 else "")


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


class _CallEnd:
    """Finds a call's closing tag: the first ``</tool_call>`` outside a JSON string, fed the call's
    body as it grows (it resumes where it stopped).

    Outside a string, valid JSON holds only structure, numbers, literals and whitespace, never a
    ``<``: so for a valid call object a tag outside a string can only come after the object has
    ended, and a tag inside a string (an argument that mentions ``</tool_call>``) is text. This is
    exact for valid JSON and still finds the tag after invalid JSON (unbalanced braces: the call
    is then given back as content). A raw control character ends a string: a JSON string cannot
    hold one, so the body is invalid there, and an unclosed quote must not swallow the tag."""

    def __init__(self) -> None:
        self.pos = 0  # where the next scan starts
        self.in_string = False
        self.escape = False
        self.partial_tag = False  # the scan stopped at a possible start of the tag (at ``pos``)

    def find(self, body: str) -> int:
        """Index of the closing tag in ``body``, or -1 (not yet)."""
        self.partial_tag = False
        i, n = self.pos, len(body)
        while i < n:
            ch = body[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"' or ch < " ":
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch == "<":
                if body.startswith(TOOL_END, i):
                    self.pos = i
                    return i
                if TOOL_END.startswith(body[i:]):  # the tag may be arriving: look again with more text
                    self.partial_tag = True
                    break
            i += 1
        self.pos = i
        return -1


def _could_start_a_call(body: str) -> bool:
    """Whether an unclosed call's text is (a cut-off start of) a call object, not other text."""
    text = body.lstrip()
    return not text or text.startswith("{")


class ToolCallParser:
    """Incremental Hermes-style tool-call parser for one choice. ``feed`` then ``finish``.

    Content is the text outside the tags, with two exceptions: whitespace alone between the
    output's start or a call's end and the next call (or the output's end, once a call was
    made) is layout, not content, and the first characters of a tag left unfinished at the end
    (an output cut inside ``<tool_call>``, or inside a call object before its name) are dropped:
    the model was starting a call, and that text is not an answer."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.num_calls = 0
        self._in_gap = True  # only whitespace since the output's start or the last call's end
        self._blank = ""  # that whitespace, held back
        self._reset_call()

    def _reset_call(self) -> None:
        self._name_sent = False
        self._args_start: int | None = None  # index in _buf where the arguments value begins
        self._args_sent = 0  # characters of the arguments value already sent
        self._scanner: _ValueScanner | None = None
        self._end = _CallEnd()

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _content(self, text: str, out: ParsedDelta) -> None:
        """Text outside the tags: whitespace in a gap is held back until something else comes."""
        if not text:
            return
        if self._in_gap and text.isspace():
            self._blank += text
            return
        out.content += self._blank + text
        self._blank, self._in_gap = "", False

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while True:
            if not self._in_call:
                at = self._buf.find(TOOL_START)
                if at < 0:
                    keep = _held_back(self._buf, TOOL_START)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(self._buf[:at], out)
                self._blank = ""  # whitespace before a call is layout
                self._buf = self._buf[at + len(TOOL_START) :]
                self._in_call = True
                self._reset_call()
                continue
            end = self._end.find(self._buf)
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
            self._end.find(body)
            if self._end.partial_tag:  # cut inside the closing tag
                body = body[: self._end.pos]
            self._stream_call(body, out)
            self._close_call(body, out, closed=False)
            self._in_call = False
        else:
            self._buf = ""  # at most the start of an opening tag (held back): never content
        if self._in_gap and not self.called:  # an output of whitespace alone stays what it was
            out.content += self._blank
        self._blank = ""
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
            if not ok and not closed and _could_start_a_call(body):
                return  # the output ended inside a call's first characters: nothing to report
            if not ok:  # not a call after all: give the text back as content
                self._content(TOOL_START + body + (TOOL_END if closed else ""), out)
                return
            out.tool_calls.append(self._header(call["name"]))
            self._name_sent = True
        if self._scanner is None and ok:  # arguments not streamed (string value or other layout)
            args = call.get("arguments", call.get("parameters", {}))
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.tool_calls.append(self._args_delta(text))
        self.num_calls += 1
        self._in_gap, self._blank = True, ""


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

