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
from promptlint.line_ends import is_block_line_end
from promptlint.model import DynClass, Element, Finding, PromptDoc
from promptlint.parse import LineIndex, split_text
from promptlint.positions import JsonPath, JsonPositions, StringPositions, YamlPositions

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


def _load_template(
    path: Path, shown: str, raw: str, meta: dict[str, Any] | None, body_line: int, index: LineIndex | None = None,
) -> PromptDoc:
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
    elements = split_text(body, role, index or LineIndex(body, body_line), syntax, classes)
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
        positions: StringPositions = JsonPositions(raw, body)
    else:
        body, root = _parse_yaml(raw)
        positions = YamlPositions(raw, root)
    if not isinstance(body, dict):
        raise NotAPrompt("not a prompt file: expected a mapping with messages, system, tools or template")
    for key in ("template", "prompt"):
        if isinstance(body.get(key), str) and "messages" not in body:
            meta = {k: v for k, v in body.items() if k != key}
            index = positions.index_for((key,)) or LineIndex(body[key], _locate(raw, body[key], 0, ext)[0])
            return _load_template(path, shown, body[key], meta, index.at(0)[0], index)
    if not any(k in body for k in ("messages", "system", "tools")):
        raise NotAPrompt("not a prompt file: no 'messages', 'system', 'tools' or 'template' key")
    return _request_doc(path, shown, raw, body, ext, positions)


# A YAML alias repeats a whole subtree without repeating its text: nine nested levels of nine aliases
# are a few hundred bytes that expand to 9**9 strings ("billion laughs"). Anything that walks or
# serialises the document (the tools' JSON, the token count) would hang, then run out of memory.
# A prompt file's expanded size is close to its own size; this budget leaves room for honest reuse
# (a shared schema under an anchor) and refuses the rest before anything expands it.
_EXPANSION_FACTOR = 8
_EXPANSION_FLOOR = 1_000_000


def _parse_yaml(raw: str) -> tuple[Any, yaml.Node | None]:
    """(parsed document, its node tree). Raises ``_Invalid`` for bad YAML or runaway alias expansion."""
    loader = yaml.SafeLoader(raw)
    try:
        root = loader.get_single_node()
        body = loader.construct_document(root) if root is not None else None
        _check_expansion(body, max(_EXPANSION_FLOOR, _EXPANSION_FACTOR * len(raw)))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        raise _Invalid(f"invalid YAML: {getattr(exc, 'problem', None) or exc}", line, col) from None
    except RecursionError:
        raise _Invalid("invalid YAML: nested too deeply to be a prompt file", 1, 1) from None
    finally:
        loader.dispose()
    return body, root


def _check_expansion(body: Any, budget: int) -> None:
    """Refuse a document whose aliases expand beyond ``budget`` (characters plus nodes) or loop.

    Each distinct container is sized once (aliases share the Python object), so this costs the
    size of the file, not of the expansion."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(value: Any) -> int:
        if isinstance(value, str):
            return len(value) + 1
        if not isinstance(value, dict | list):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise _Invalid("invalid YAML: an alias refers to a node that contains it (a recursive document)")
        open_.add(key)
        children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1
        for child in children:
            total += size(child)
            if total > budget:
                raise _Invalid(f"invalid YAML: its aliases expand to more than {budget:,} characters; "
                               "not a prompt file (an alias bomb?)")
        open_.discard(key)
        sizes[key] = total
        return total

    size(body)


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
                text = part.get("text")
                out.append((text if isinstance(text, str) else "", i))
            else:
                raise _Invalid(f"{where}[{i}] must be a string or an object")
        return out
    raise _Invalid(f"{where} must be a string or a list of content blocks")


def _request_doc(
    path: Path, shown: str, raw: str, body: dict[str, Any], ext: str, positions: StringPositions,
) -> PromptDoc:
    section = body.get("promptlint")
    meta: dict[str, Any] = section if isinstance(section, dict) else {}
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
        for i, tool in enumerate(tools):
            elements.extend(_tool_elements(tool, i, line, positions, classes, ("tools", None, i) in marks))
    blocks: list[tuple[str, str, JsonPath, bool]] = []  # (role, text, where, cache_control)
    for text, j in _text_blocks(body.get("system"), "system"):
        blocks.append(("system", text, _block_path(body.get("system"), ("system",), j),
                       j is not None and ("system", None, j) in marks))
    for i, m in enumerate(messages):
        for text, j in _text_blocks(m.get("content"), f"messages[{i}].content"):
            blocks.append((m["role"], text, _block_path(m.get("content"), ("messages", i, "content"), j),
                           ("messages", i, j) in marks))
    indexes: list[LineIndex] = []
    for _, text, where, _ in blocks:
        index = positions.index_for(where)
        if index is None:  # a string the position map does not know: the first match from the cursor
            line, cursor = _locate(raw, text, cursor, ext)
            index = _line_index_for(text, line, ext)
        indexes.append(index)
    syntax = _syntax(meta, "auto", "promptlint.syntax")
    split = [split_text(text, role, index, syntax, classes) for (role, text, _, _), index in zip(blocks, indexes)]
    # The last user message is the request's input unless it holds a template variable itself (then
    # its variables are the input). Decided by that message alone: a stray ``${HOME}`` in another
    # message of a sample request must not turn the real question into cacheable static text.
    last_user = max((k for k, b in enumerate(blocks) if b[0] == "user"), default=None)
    input_is_literal = last_user is not None and not any(e.dyn is not None and not e.literal for e in split[last_user])
    for k, ((role, text, _where, cc), index, parts) in enumerate(zip(blocks, indexes, split)):
        line, column = index.at(0)
        if input_is_literal and k == last_user:
            # A sample request: its last user message is the per-request input.
            elements.append(Element(text, role, line, column, dyn="input", name="last user message", breakpoint=cc))
            continue
        if not parts:
            parts = [Element("", role, line, column)]
        parts[-1].breakpoint = cc
        elements.extend(parts)
    line_ends = frozenset(where for _, text, where, _ in blocks
                          if where[0] == "messages" and is_block_line_end(text) and positions.is_block_scalar(where))
    return PromptDoc(path, shown, "request", raw, meta, elements, body=body, block_line_ends=line_ends)


def _block_path(content: Any, where: JsonPath, j: int | None) -> JsonPath:
    """The path of a content block's text: the content itself, a string part, or a part's ``text``."""
    if j is None:
        return where
    return (*where, j) if isinstance(content[j], str) else (*where, j, "text")


def _tool_elements(
    tool: Any, i: int, line: int, positions: StringPositions, classes: dict[str, DynClass], marked: bool,
) -> list[Element]:
    """One tool definition as prompt elements: its JSON as static text, cut where a string in it
    (a description, a schema's enum or default) holds a dynamic value. Tools open the prefix, so a
    timestamp in a description defeats the cache like one at the top of the system prompt."""
    text = json.dumps(tool, ensure_ascii=False)
    out: list[Element] = []
    pos = 0
    for where, value in _strings_of(tool, ("tools", i)):
        index = positions.index_for(where) or LineIndex(value, line)
        parts = split_text(value, "tools", index, "auto", classes)
        if not any(p.dyn is not None for p in parts):
            continue
        at = text.find(json.dumps(value, ensure_ascii=False), pos)
        if at < 0:
            continue
        start_line, start_col = index.at(0)
        out.append(Element(text[pos : at + 1], "tools", start_line, start_col, is_tools=True, name="tools"))
        for p in parts:
            p.is_tools = True
            p.name = p.name or "tools"
        out.extend(parts)
        pos = at + len(json.dumps(value, ensure_ascii=False)) - 1
    end_line, end_col = out[-1].line if out else line, out[-1].column if out else 1
    out.append(Element(text[pos:], "tools", end_line, end_col, is_tools=True, name="tools", breakpoint=marked))
    return out


def _strings_of(value: Any, path: JsonPath) -> Iterator[tuple[JsonPath, str]]:
    """Every string value (not key) under ``value``, in serialisation order, with its path."""
    stack: list[tuple[JsonPath, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            stack.extend(((*where, k), v) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend(((*where, n), v) for n, v in reversed(list(enumerate(item))))


def _line_index_for(text: str, line: int, ext: str) -> LineIndex:
    # In JSON a string's newlines are escapes on one physical line; in YAML block scalars they are real.
    return LineIndex(text.replace("\n", " ") if ext == ".json" else text, line)
