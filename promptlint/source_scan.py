"""Scoring application source: the prompts Python code builds for the openai / anthropic / litellm SDKs.

Each SDK call that sends messages (``client.chat.completions.create``, ``client.responses.create``,
``client.messages.create``, ``litellm.completion`` / ``acompletion``, ...) becomes one
:class:`PromptDoc` of kind ``source``, whose elements are what the call's prompt is made of, in
provider order (tools, system, messages)::

    system = f"Today is {datetime.now():%Y-%m-%d}. You help {user.name}.\\n" + POLICY
    client.chat.completions.create(model=..., messages=[{"role": "system", "content": system}, *history])
        -> [static "Today is "] [volatile {datetime.now()}] [static ". You help "] [per-user {user.name}]
           [static ".\\n"] [static POLICY text, resolved from the module constant] [input *history]

so the template rules (PC001 dynamic-before-static, PC002 volatile, PC003 per-user, PC006, PC007,
PC004 for literal tools) apply unchanged. Strings are followed through f-strings, ``str.format``,
``%``, ``+``, ``"sep".join([...])`` and local/module assignments (``x = ...``, ``messages.append``);
anything else is a dynamic value classified by its expression (``datetime.now()``/``uuid4()`` are
volatile; ``user.email`` per-user; ``question`` input; see ``parse.classify_name``). A slice that
drops the oldest messages (``history[-10:]``) is recorded for PC012 history-edited.

Only ``ast`` is used: the code is never imported or run.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from promptlint.model import DynClass, Element, PromptDoc
from promptlint.order_hazards import find_order_hazards
from promptlint.parse import LineIndex, classify_name, split_text

SDK_MODULES = ("openai", "anthropic", "litellm")
# Dotted call names (their last parts) that send a prompt.
_SDK_CALLS = (
    ("chat", "completions", "create"), ("chat", "completions", "parse"), ("chat", "completions", "stream"),
    ("completions", "create"), ("responses", "create"), ("responses", "parse"), ("responses", "stream"),
    ("messages", "create"), ("messages", "stream"), ("messages", "count_tokens"),
)
_LITELLM_CALLS = {"completion", "acompletion", "text_completion", "atext_completion"}
_VOLATILE_EXPR = re.compile(
    r"\b(?:datetime|date|time|pendulum|arrow)\.(?:now|utcnow|today|time|strftime|ctime|localtime|gmtime)\b"
    r"|\buuid\d?\(|\buuid\.uuid\d\b|\brandom\.|\bsecrets\.|\btime\.(?:time|monotonic|perf_counter)\b"
    r"|\.isoformat\(|\.strftime\(|\btoken_(?:hex|urlsafe)\(|\bnow\(\)",
)
_PERCENT = re.compile(r"%(?:\((?P<name>\w+)\))?[-#0 +]*\d*(?:\.\d+)?[sdrfixXeEgGc]")
_MAX_DEPTH = 6


class NotSource(Exception):
    """A Python file that sends no prompt through a known SDK."""


def may_hold_prompts(raw: str) -> bool:
    """Cheap pre-filter: the file mentions one of the SDKs (most Python files are skipped unparsed)."""
    return any(m in raw for m in SDK_MODULES)


def scan(path: Path, shown: str, raw: str) -> list[PromptDoc]:
    """One ``source`` doc per SDK call that sends messages, in source order.

    Raises:
        SyntaxError: the file is not valid Python (the loader reports PC000 at its line).
        NotSource: no SDK import, or no call that sends messages.
    """
    if not may_hold_prompts(raw):
        raise NotSource("no openai, anthropic or litellm import")
    tree = ast.parse(raw, filename=str(path))
    sdk_names = _sdk_names(tree)
    if not sdk_names:
        raise NotSource("no openai, anthropic or litellm import")
    scope = _Scopes(tree)
    docs = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if _is_sdk_call(call, sdk_names):
            doc = _CallScan(scope, call, path, shown, raw).doc()
            if doc is not None:
                docs.append(doc)
    if not docs:
        raise NotSource("no openai / anthropic / litellm call that sends messages")
    docs.sort(key=lambda d: (d.body_line, d.display))
    # File-wide, so on the first call's doc only: one finding per place, however many calls there are.
    docs[0].meta["order_hazards"] = find_order_hazards(tree)
    return docs


# --- finding the calls ---------------------------------------------------------------------------------


def _sdk_names(tree: ast.Module) -> set[str]:
    """Local names bound to an SDK module or one of its members (``import openai as oa`` -> ``oa``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in SDK_MODULES:
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in SDK_MODULES:
            for a in node.names:
                names.add(a.asname or a.name)
    return names


def _dotted(node: ast.AST) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    elif isinstance(node, ast.Call):  # OpenAI().chat.completions.create
        parts.extend(reversed(_dotted(node.func)))
    return parts[::-1]


def _is_sdk_call(call: ast.Call, sdk_names: set[str]) -> bool:
    parts = _dotted(call.func)
    if not parts:
        return False
    if any(tuple(parts[-len(s):]) == s for s in _SDK_CALLS):
        return any(k.arg in ("messages", "input", "system", "instructions", "prompt") for k in call.keywords)
    # litellm.completion(...) or `from litellm import completion`
    return parts[-1] in _LITELLM_CALLS and (parts[0] in sdk_names or len(parts) == 1 and parts[0] in sdk_names)


# --- resolving names -------------------------------------------------------------------------------------


class _Scopes:
    """Assignments and list mutations per scope, to follow a name back to what it was built from."""

    def __init__(self, tree: ast.Module) -> None:
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.tree = tree
        # scope node -> name -> [(line, value node, op)]  op: "=" | "append" | "extend" | "+="
        self.defs: dict[ast.AST, dict[str, list[tuple[int, ast.expr, str]]]] = {}
        for node in ast.walk(tree):
            scope = self.scope_of(node)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self._add(scope, node.targets[0].id, node.lineno, node.value, "=")
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                self._add(scope, node.target.id, node.lineno, node.value, "=")
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and isinstance(node.op, ast.Add):
                self._add(scope, node.target.id, node.lineno, node.value, "+=")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.attr in ("append", "extend")
                  and len(node.args) == 1):
                self._add(scope, node.func.value.id, node.lineno, node.args[0], node.func.attr)

    def _add(self, scope: ast.AST, name: str, line: int, value: ast.expr, op: str) -> None:
        self.defs.setdefault(scope, {}).setdefault(name, []).append((line, value, op))

    def scope_of(self, node: ast.AST) -> ast.AST:
        p = self.parent.get(node)
        while p is not None and not isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            p = self.parent.get(p)
        return p if p is not None else self.tree

    def history(self, name: str, at: ast.AST) -> list[tuple[ast.expr, str]]:
        """What ``name`` holds where ``at`` uses it: its last assignment, then later append/extend/+=.

        The innermost scope that assigns the name wins; module-level names are found wherever they are
        assigned (they run at import, before any function is called). Empty when unresolved.
        """
        line = getattr(at, "lineno", 10**9)
        scope: ast.AST | None = self.scope_of(at)
        while scope is not None:
            entries = self.defs.get(scope, {}).get(name)
            if entries:
                if scope is not self.tree:
                    entries = [e for e in entries if e[0] <= line]
                last = max((i for i, e in enumerate(entries) if e[2] == "="), default=None)
                if last is not None:
                    return [(v, op) for _, v, op in entries[last:]]
            scope = None if scope is self.tree else self.scope_of(scope)
        return []


# --- building the elements of one call -------------------------------------------------------------------


class _CallScan:
    def __init__(self, scopes: _Scopes, call: ast.Call, path: Path, shown: str, raw: str) -> None:
        self.scopes, self.call, self.path, self.shown, self.raw = scopes, call, path, shown, raw
        self.slices: list[tuple[int, int, str]] = []

    def doc(self) -> PromptDoc | None:
        kw = {k.arg: k.value for k in self.call.keywords if k.arg}
        elements: list[Element] = []
        body: dict[str, Any] = {}
        tools_node = kw.get("tools") or kw.get("functions")
        if tools_node is not None:
            tools = self._literal(tools_node)
            if isinstance(tools, list):
                body["tools"] = tools
                elements.append(Element(json.dumps(tools, ensure_ascii=False), "tools", tools_node.lineno,
                                        tools_node.col_offset + 1, name="tools", is_tools=True))
        for key in ("system", "instructions"):
            if key in kw:
                elements += self.text(kw[key], "system", 0)
        for key in ("messages", "input", "prompt"):
            if key in kw:
                node = kw[key]
                if key != "messages" and self._is_texty(node):
                    elements += self.text(node, "user", 0)
                else:
                    elements += self.messages(node, 0)
                break
        if not any(not e.is_tools for e in elements):
            return None
        return PromptDoc(self.path, self.shown, "source", self.raw, {"history_slices": self.slices}, elements,
                         body=body or None, body_line=self.call.lineno)

    def _literal(self, node: ast.AST, depth: int = 0) -> Any:
        if isinstance(node, ast.Name) and depth < _MAX_DEPTH:
            hist = self.scopes.history(node.id, node)
            if len(hist) == 1:
                return self._literal(hist[0][0], depth + 1)
            return None
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None

    def _is_texty(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Constant | ast.JoinedStr | ast.BinOp) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format")

    # messages -> elements

    def messages(self, node: ast.AST, depth: int) -> list[Element]:
        if depth > _MAX_DEPTH:
            return [self.dynamic(node, "input")]
        if isinstance(node, ast.List | ast.Tuple):
            out: list[Element] = []
            for elt in node.elts:
                if isinstance(elt, ast.Starred):
                    out += self.messages(elt.value, depth + 1)
                elif isinstance(elt, ast.Dict):
                    out += self.message(elt, depth)
                elif isinstance(elt, ast.Name) and (hist := self.scopes.history(elt.id, elt)):
                    out += self.messages(ast.List(elts=[v for v, _ in hist[:1]]), depth + 1)
                else:
                    out.append(self.dynamic(elt, "input"))
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.messages(node.left, depth + 1) + self.messages(node.right, depth + 1)
        if isinstance(node, ast.Name):
            hist = self.scopes.history(node.id, node)
            if not hist:
                return [self.dynamic(node, "input")]
            out = []
            for value, op in hist:
                out += self.messages(ast.List(elts=[value]) if op == "append" else value, depth + 1)
            return out
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and node.slice.lower is not None:
            self.slices.append((node.lineno, node.col_offset + 1, ast.unparse(node)))
            return [self.dynamic(node, "input")]
        if isinstance(node, ast.Constant | ast.JoinedStr):  # responses.create(input="...")
            return self.text(node, "user", depth)
        return [self.dynamic(node, "input")]

    def message(self, node: ast.Dict, depth: int) -> list[Element]:
        fields = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
        role_node = fields.get("role")
        role = role_node.value if isinstance(role_node, ast.Constant) and isinstance(role_node.value, str) else "user"
        content = fields.get("content")
        if content is None:
            return []
        if isinstance(content, ast.List):  # content parts: [{"type": "text", "text": ...}, ...]
            out: list[Element] = []
            for part in content.elts:
                if isinstance(part, ast.Dict):
                    pf = {k.value: v for k, v in zip(part.keys, part.values) if isinstance(k, ast.Constant)}
                    if "text" in pf:
                        out += self.text(pf["text"], role, depth + 1)
                        continue
                out.append(self.dynamic(part, "input"))
            return out
        out = self.text(content, role, depth + 1)
        if role == "user":  # an unnamed value in a user message is the request's input, as in request files
            for e in out:
                if e.dyn == "placeholder":
                    e.dyn = "input"
        return out

    # text -> elements

    def text(self, node: ast.AST, role: str, depth: int) -> list[Element]:
        if depth > _MAX_DEPTH:
            return [self.dynamic(node, None)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self.static(node.value, role, node)
        if isinstance(node, ast.JoinedStr):
            return self.fstring(node, role)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.text(node.left, role, depth + 1) + self.text(node.right, role, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            template = self._const_str(node.left, depth)
            if template is not None:
                return self.percent(template, node, role)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "format":
                template = self._const_str(node.func.value, depth)
                if template is not None:
                    return self.format(template, node, role)
            if node.func.attr == "join" and len(node.args) == 1 and isinstance(node.args[0], ast.List | ast.Tuple):
                sep = self._const_str(node.func.value, depth)
                if sep is not None:
                    out: list[Element] = []
                    for i, elt in enumerate(node.args[0].elts):
                        if i and sep:
                            out += self.static(sep, role, node)
                        out += self.text(elt, role, depth + 1)
                    return out
            if node.func.attr in ("strip", "rstrip", "lstrip", "dedent") and not node.args:
                return self.text(node.func.value, role, depth + 1)
        if isinstance(node, ast.Call) and _dotted(node.func)[-1:] == ["dedent"] and len(node.args) == 1:
            return self.text(node.args[0], role, depth + 1)
        if isinstance(node, ast.Name):
            hist = self.scopes.history(node.id, node)
            if hist:
                out = []
                for value, op in hist:
                    if op in ("=", "+="):
                        out += self.text(value, role, depth + 1)
                return out
        return [self.dynamic(node, None, role)]

    def _const_str(self, node: ast.AST, depth: int) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and depth < _MAX_DEPTH:
            hist = self.scopes.history(node.id, node)
            if len(hist) == 1:
                return self._const_str(hist[0][0], depth + 1)
        return None

    def static(self, text: str, role: str, node: ast.expr, first_line: int | None = None) -> list[Element]:
        line = node.lineno if first_line is None else first_line
        # A string on one physical line has only escaped newlines ("\\n"): it all stays on that line.
        indexed = text.replace("\n", " ") if _one_line(node) else text
        out = split_text(text, role, LineIndex(indexed, line), "none")
        for e in out:
            if e.literal and e.name == "date":  # a date written into code is a constant (as in templates)
                e.dyn, e.literal = None, False
            if e.line == line:
                e.column += node.col_offset
        return out

    def fstring(self, node: ast.JoinedStr, role: str) -> list[Element]:
        out: list[Element] = []
        line = node.lineno  # python 3.11 gives parts the f-string's position: count lines ourselves
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out += self.static(value.value, role, node, line)
                line += value.value.count("\n") if not _one_line(node) else 0
            elif isinstance(value, ast.FormattedValue):
                e = self.dynamic(value.value, None, role)
                e.text, e.line = "{" + ast.unparse(value.value) + "}", line
                out.append(e)
        return out

    def format(self, template: str, call: ast.Call, role: str) -> list[Element]:
        classes: dict[str, DynClass] = {k.arg: classify_expr(k.value) for k in call.keywords if k.arg}
        for i, arg in enumerate(call.args):
            classes[str(i)] = classify_expr(arg)
        out = split_text(template, role, LineIndex(template, call.lineno), "format", classes)
        for e in out:
            if e.literal and e.name == "date":
                e.dyn, e.literal = None, False
        return out

    def percent(self, template: str, node: ast.BinOp, role: str) -> list[Element]:
        args = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
        out: list[Element] = []
        pos = 0
        for k, m in enumerate(_PERCENT.finditer(template)):
            out += self.static(template[pos : m.start()], role, node) if m.start() > pos else []
            arg = args[k] if k < len(args) else node.right
            e = self.dynamic(arg, None, role)
            e.text = m.group()
            out.append(e)
            pos = m.end()
        if pos < len(template):
            out += self.static(template[pos:], role, node)
        return out

    def dynamic(self, node: ast.AST, cls: DynClass | None, role: str = "user") -> Element:
        text = ast.unparse(node)
        name = _expr_name(node) or text[:40]
        return Element(text if len(text) <= 60 else text[:57] + "...", role, getattr(node, "lineno", 1),
                       getattr(node, "col_offset", 0) + 1, dyn=cls or classify_expr(node), name=name)


def _one_line(node: ast.AST) -> bool:
    """Whether a string literal sits on one physical line (its newlines, if any, are escapes)."""
    line = getattr(node, "lineno", None)
    return line is not None and getattr(node, "end_lineno", line) == line


def _expr_name(node: ast.AST) -> str:
    parts = _dotted(node.func if isinstance(node, ast.Call) else node)
    if isinstance(node, ast.Subscript):
        parts = _dotted(node.value)
    return "_".join(parts[-2:])


def classify_expr(node: ast.AST) -> DynClass:
    """What a Python expression that lands in a prompt holds (``datetime.now()`` -> volatile).

    Calls of clocks and random/uuid generators are volatile; otherwise the last two names of the
    expression (``user.email`` -> ``user_email``) are classified like a template variable.
    """
    text = ast.unparse(node)
    if _VOLATILE_EXPR.search(text):
        return "volatile"
    if isinstance(node, ast.Constant):
        return "placeholder"
    name = _expr_name(node)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        name = f"{name}_{node.slice.value}"  # user["email"] -> user_email
    return classify_name(name) if name else "placeholder"
