"""Finding prompt files and loading them into :class:`PromptDoc` (or a PC000 finding).

Inputs:
- templates (``.txt .md .prompt .j2 .jinja .jinja2``), optionally with YAML front matter;
- chat requests (``.json .yaml .yml``) in OpenAI or Anthropic shape (``messages``, ``system``,
  ``tools``); a YAML/JSON mapping with a ``template`` (or ``prompt``) string is a template whose
  other keys are its front matter.

Directories are walked recursively, honouring ``.gitignore`` files (pathspec) from the repository
root down; a data file in a walked directory that is not a prompt is skipped, a named one is PC000.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pathspec
import yaml

from promptlint.cache_control import marked_positions
from promptlint.model import DynClass, Element, Finding, PromptDoc
from promptlint.parse import LineIndex, split_text

TEMPLATE_EXTS = {".txt", ".md", ".prompt", ".j2", ".jinja", ".jinja2"}
REQUEST_EXTS = {".json", ".yaml", ".yml"}
SOURCE_EXTS = {".py"}  # application code calling the openai / anthropic / litellm SDKs (source_scan)
JINJA_EXTS = {".j2", ".jinja", ".jinja2"}
_SKIP_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "node_modules", "__pycache__", ".tox", ".mypy_cache"}
_DYN_CLASSES = {"volatile", "per-user", "input", "placeholder", "control", "static"}
INVALID = "PC000"


class NotAPrompt(Exception):
    """A data file without prompt keys: skipped when found by walking, PC000 when named."""


def display_path(path: Path) -> str:
    """The path relative to the working directory when it lies below it, else as given."""
    absolute = os.path.abspath(path)
    cwd = os.getcwd()
    if absolute.startswith(cwd + os.sep):
        return Path(absolute[len(cwd) + 1 :]).as_posix()
    return path.as_posix()


def _gitignore_specs(start: Path) -> list[tuple[Path, pathspec.PathSpec]]:
    """.gitignore specs of ``start``'s ancestors up to the repository root (the dir holding .git)."""
    specs = []
    for d in [start, *start.parents]:
        gi = d / ".gitignore"
        if gi.is_file():
            specs.append((d, _load_spec(gi)))
        if (d / ".git").exists():
            break
    return specs


def _load_spec(gi: Path) -> pathspec.PathSpec:
    try:
        return pathspec.GitIgnoreSpec.from_lines(gi.read_text(encoding="utf-8", errors="replace").splitlines())
    except OSError:
        return pathspec.GitIgnoreSpec.from_lines([])


def _ignored(path: Path, is_dir: bool, specs: list[tuple[Path, pathspec.PathSpec]]) -> bool:
    for base, spec in specs:
        try:
            rel = path.relative_to(base).as_posix()
        except ValueError:
            continue
        if spec.match_file(rel + "/" if is_dir else rel):
            return True
    return False


def discover(paths: list[Path]) -> Iterator[tuple[Path, bool]]:
    """Yield (file, named_explicitly) for every prompt file under ``paths``, sorted, no duplicates.

    Raises:
        FileNotFoundError: a named path does not exist.
    """
    seen: set[Path] = set()
    for root in paths:
        if not root.exists():
            raise FileNotFoundError(str(root))
        if root.is_file() or not root.is_dir():  # a named FIFO or device: load() reports it, never reads it
            if root.absolute() not in seen:
                seen.add(root.absolute())
                yield root, True
            continue
        specs = _gitignore_specs(root.absolute())
        found: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(root):
            d = Path(dirpath)
            local = d / ".gitignore"
            if local.is_file() and d.absolute() != root.absolute():
                specs = [*specs, (d.absolute(), _load_spec(local))]
            dirnames[:] = sorted(
                n for n in dirnames
                if n not in _SKIP_DIRS and not _ignored((d / n).absolute(), True, specs)
            )
            for name in filenames:
                p = d / name
                ext = p.suffix.lower()
                # is_file(): a FIFO would block the read forever, a device never end; skip both
                # (and links to them). A link to a regular file is linted; --fix never writes through it.
                if (ext in TEMPLATE_EXTS or ext in REQUEST_EXTS or ext in SOURCE_EXTS) and p.is_file() and not _ignored(
                    p.absolute(), False, specs
                ):
                    found.append(p)
        for p in sorted(found):
            if p.absolute() not in seen:
                seen.add(p.absolute())
                yield p, False


def load(path: Path, named: bool) -> PromptDoc | list[PromptDoc] | Finding | None:
    """Load one file. Returns a doc, a PC000 finding, or ``None`` (a walked non-prompt data file).

    A Python file gives a list: one ``source`` doc per SDK call that sends a prompt (``source_scan``).
    """
    shown = display_path(path)
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file (a FIFO, socket or device)"
        return Finding(INVALID, shown, 1, 1, f"cannot read file: {kind}, not read", "error")
    try:
        data = path.read_bytes()
    except OSError as exc:
        return Finding(INVALID, shown, 1, 1, f"cannot read file: {exc.strerror or exc}", "error")
    try:
        raw = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return Finding(INVALID, shown, line, 1, f"not UTF-8 text (byte 0x{data[exc.start]:02x})", "error")
    ext = path.suffix.lower()
    if ext in SOURCE_EXTS:
        return _load_source(path, shown, raw, named)
    try:
        if ext in REQUEST_EXTS:
            return _load_data_file(path, shown, raw, ext)
        return _load_template(path, shown, raw, meta=None, body_line=1)
    except NotAPrompt as exc:
        if named:
            return Finding(INVALID, shown, 1, 1, str(exc), "error")
        return None
    except _Invalid as exc:
        return Finding(INVALID, shown, exc.line, exc.column, exc.message, "error")


def _load_source(path: Path, shown: str, raw: str, named: bool) -> list[PromptDoc] | Finding | None:
    from promptlint import source_scan  # deferred: only runs that meet a .py file pay for ast walking

    try:
        return source_scan.scan(path, shown, raw)
    except SyntaxError as exc:
        return Finding(INVALID, shown, exc.lineno or 1, exc.offset or 1, f"invalid Python: {exc.msg}", "error")
    except source_scan.NotSource as exc:
        return Finding(INVALID, shown, 1, 1, f"not a prompt source file: {exc}", "error") if named else None


class _Invalid(Exception):
    def __init__(self, message: str, line: int = 1, column: int = 1) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


# --- templates ---------------------------------------------------------------------------------------


def _split_front_matter(raw: str) -> tuple[dict[str, Any], str, int]:
    """(front matter, body, first line of body). Front matter is YAML between ``---`` lines."""
    if not raw.startswith("---"):
        return {}, raw, 1
    lines = raw.split("\n")
    if lines[0].rstrip() != "---":
        return {}, raw, 1
    for i in range(1, len(lines)):
        if lines[i].rstrip() in ("---", "..."):
            try:
                meta = yaml.safe_load("\n".join(lines[1:i])) or {}
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                line = mark.line + 2 if mark is not None else 1
                raise _Invalid(f"invalid YAML front matter: {getattr(exc, 'problem', None) or exc}", line) from None
            if not isinstance(meta, dict):
                raise _Invalid("front matter must be a YAML mapping", 2)
            return meta, "\n".join(lines[i + 1 :]), i + 2
    raise _Invalid("front matter starts with '---' but has no closing '---' line")


def _var_classes(meta: dict[str, Any]) -> tuple[dict[str, DynClass], dict[str, int]]:
    """Front matter ``vars: {name: kind | {kind: ..., tokens: N}}`` -> (classes, expected tokens)."""
    classes: dict[str, DynClass] = {}
    sizes: dict[str, int] = {}
    spec = meta.get("vars") or {}
    if not isinstance(spec, dict):
        raise _Invalid("front matter 'vars' must be a mapping of variable name to kind or {kind, tokens}")
    for name, v in spec.items():
        kind, tokens = (v.get("kind"), v.get("tokens")) if isinstance(v, dict) else (v, None)
        if kind is not None:
            if kind not in _DYN_CLASSES:
                raise _Invalid(f"vars.{name}: unknown kind {kind!r}; use one of {', '.join(sorted(_DYN_CLASSES))}")
            classes[str(name)] = kind
        if tokens is not None:
            if not isinstance(tokens, int) or tokens < 0:
                raise _Invalid(f"vars.{name}.tokens must be a non-negative integer")
            sizes[str(name)] = tokens
    return classes, sizes


def _load_template(path: Path, shown: str, raw: str, meta: dict[str, Any] | None, body_line: int) -> PromptDoc:
    if meta is None:
        meta, body, body_line = _split_front_matter(raw)
    else:
        body = raw
    ext = path.suffix.lower()
    # A Jinja file is read as Jinja: ``$HOME`` or ``{answer: string}`` in it is literal text.
    syntax = _syntax(meta, "jinja" if ext in JINJA_EXTS else "auto", "front matter 'syntax'")
    if "{%" in body or "{#" in body:
        _check_jinja(body, body_line)
    elif ext in JINJA_EXTS or syntax == "jinja":
        _check_expressions(body, body_line)
    classes, _ = _var_classes(meta)
    role = str(meta.get("role", "system"))
    elements = split_text(body, role, LineIndex(body, body_line), syntax, classes)
    for e in elements:
        if e.dyn == "static":  # a variable the author declared constant
            e.dyn = None
        elif e.literal and e.name == "date":
            # A date written into a template ("policy effective 2024-01-01") is a constant; timestamps,
            # times and ids written into a file are what a rendered prompt was captured with.
            e.dyn, e.literal = None, False
    return PromptDoc(path, shown, "template", raw, meta, elements, body_line=body_line)


def _syntax(meta: dict[str, Any], default: str, where: str) -> str:
    syntax = str(meta.get("syntax", default))
    if syntax not in ("auto", "jinja", "format", "dollar", "none"):
        raise _Invalid(f"{where} must be auto, jinja, format, dollar or none, not {syntax!r}")
    return syntax


_JINJA_ENV = None


def _check_expressions(body: str, body_line: int) -> None:
    """Cheap check for templates with only ``{{ }}`` expressions: every one is closed.

    A full Jinja parse costs ~2 ms a file (most of the linter's time on expression-only templates),
    so it is kept for templates with statements or comments, where nesting errors happen.
    """
    pos = 0
    while (start := body.find("{{", pos)) >= 0:
        end = body.find("}}", start + 2)
        nxt = body.find("{{", start + 2)
        if end < 0 or (0 <= nxt < end):
            line = body_line + body.count("\n", 0, start)
            raise _Invalid("invalid Jinja2 template: '{{' is not closed by '}}'", line)
        pos = end + 2


def _check_jinja(body: str, body_line: int) -> None:
    global _JINJA_ENV
    import jinja2  # deferred: only Jinja templates pay for it

    if _JINJA_ENV is None:
        _JINJA_ENV = jinja2.Environment()
    try:
        _JINJA_ENV.parse(body)
    except jinja2.TemplateSyntaxError as exc:
        raise _Invalid(f"invalid Jinja2 template: {exc.message}", body_line + (exc.lineno or 1) - 1) from None


# --- chat requests -----------------------------------------------------------------------------------


def _load_data_file(path: Path, shown: str, raw: str, ext: str) -> PromptDoc:
    if ext == ".json":
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _Invalid(f"invalid JSON: {exc.msg}", exc.lineno, exc.colno) from None
        except RecursionError:  # json's C scanner recurses per nesting level (~1000 max)
            raise _Invalid("invalid JSON: nested too deeply to be a prompt file", 1, 1) from None
    else:
        try:
            body = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
            raise _Invalid(f"invalid YAML: {getattr(exc, 'problem', None) or exc}", line, col) from None
        except RecursionError:
            raise _Invalid("invalid YAML: nested too deeply to be a prompt file", 1, 1) from None
    if not isinstance(body, dict):
        raise NotAPrompt("not a prompt file: expected a mapping with messages, system, tools or template")
    for key in ("template", "prompt"):
        if isinstance(body.get(key), str) and "messages" not in body:
            meta = {k: v for k, v in body.items() if k != key}
            return _load_template(path, shown, body[key], meta, _locate(raw, body[key], 0, ext)[0])
    if not any(k in body for k in ("messages", "system", "tools")):
        raise NotAPrompt("not a prompt file: no 'messages', 'system', 'tools' or 'template' key")
    return _request_doc(path, shown, raw, body, ext)


def _locate(raw: str, text: str, cursor: int, ext: str) -> tuple[int, int]:
    """(line, new cursor) of the first occurrence of ``text``'s opening in ``raw`` from ``cursor``."""
    first = text.strip().split("\n", 1)[0][:40]
    snippet = json.dumps(first)[1:-1] if ext == ".json" else first
    pos = raw.find(snippet, cursor) if snippet else -1
    if pos < 0:
        return raw.count("\n", 0, cursor) + 1, cursor
    return raw.count("\n", 0, pos) + 1, pos


def _text_blocks(content: Any, where: str) -> list[tuple[str, int | None]]:
    """(text, block index) of a message content / system value; the index is None for plain-string
    content (the key ``promptlint.cache_control`` gives a mark on it)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, None)]
    if isinstance(content, list):
        out: list[tuple[str, int | None]] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append((part, i))
            elif isinstance(part, dict):
                out.append((part.get("text") if isinstance(part.get("text"), str) else "", i))
            else:
                raise _Invalid(f"{where}[{i}] must be a string or an object")
        return out
    raise _Invalid(f"{where} must be a string or a list of content blocks")


def _request_doc(path: Path, shown: str, raw: str, body: dict[str, Any], ext: str) -> PromptDoc:
    meta = body.get("promptlint") if isinstance(body.get("promptlint"), dict) else {}
    messages = body.get("messages", [])
    if not isinstance(messages, list):
        raise _Invalid("'messages' must be a list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _Invalid(f"messages[{i}] must be an object with a string 'role'")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _Invalid("'tools' must be a list")
    classes, _ = _var_classes(meta)
    marks = marked_positions(body)  # the gateway's own parser: the same breakpoints, found the same way
    elements: list[Element] = []
    cursor = 0
    # The provider renders tools (and a response schema) ahead of the system prompt.
    if tools:
        key = '"tools"' if ext == ".json" else "tools:"
        pos = raw.find(key)
        line = raw.count("\n", 0, pos) + 1 if pos >= 0 else 1
        elements.append(Element(json.dumps(tools, ensure_ascii=False), "tools", line, 1, is_tools=True,
                                name="tools", breakpoint=any(("tools", None, k) in marks for k in range(len(tools)))))
    blocks: list[tuple[str, str, str, bool]] = []  # (role, text, where, cache_control)
    for text, j in _text_blocks(body.get("system"), "system"):
        blocks.append(("system", text, "system", j is not None and ("system", None, j) in marks))
    for i, m in enumerate(messages):
        for text, j in _text_blocks(m.get("content"), f"messages[{i}].content"):
            blocks.append((m["role"], text, f"messages[{i}]", ("messages", i, j) in marks))
    lines = []
    for _, text, _, _ in blocks:
        line, cursor = _locate(raw, text, cursor, ext)
        lines.append(line)
    syntax = _syntax(meta, "auto", "promptlint.syntax")
    split = [
        split_text(text, role, _line_index_for(text, line, ext), syntax, classes)
        for (role, text, _, _), line in zip(blocks, lines)
    ]
    # The last user message is the request's input unless it holds a template variable itself (then
    # its variables are the input). Decided by that message alone: a stray ``${HOME}`` in another
    # message of a sample request must not turn the real question into cacheable static text.
    last_user = max((k for k, b in enumerate(blocks) if b[0] == "user"), default=None)
    input_is_literal = last_user is not None and not any(e.dyn is not None and not e.literal for e in split[last_user])
    for k, ((role, text, _where, cc), line, parts) in enumerate(zip(blocks, lines, split)):
        if input_is_literal and k == last_user:
            # A sample request: its last user message is the per-request input.
            elements.append(Element(text, role, line, 1, dyn="input", name="last user message", breakpoint=cc))
            continue
        if not parts:
            parts = [Element("", role, line)]
        parts[-1].breakpoint = cc
        elements.extend(parts)
    return PromptDoc(path, shown, "request", raw, meta, elements, body=body)


def _line_index_for(text: str, line: int, ext: str) -> LineIndex:
    # In JSON a string's newlines are escapes on one physical line; in YAML block scalars they are real.
    return LineIndex(text.replace("\n", " ") if ext == ".json" else text, line)
