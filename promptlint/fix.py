"""``--fix``: safe, meaning-preserving rewrites only, and a list of what changed.

- Request files with a fixable finding (PC004, PC009): the ``safe`` canonical form from
  :mod:`promptlint.canon` (tools sorted by name, schema keys sorted, message edges trimmed), written
  back as JSON with the file's indentation. YAML files are rewritten only if they hold no comments
  (a YAML dump would drop them).
- Templates: lines holding a value that the template marks as movable (``promptlint: movable`` on
  the line, or front matter ``movable: [var, ...]``) and that a PC001/PC002/PC003 finding flagged
  move, in order, to the end of the template.

Every fix is idempotent: a second run finds nothing to change.

A fix writes only to a regular file inside the trees that were named on the command line, never
through a symlink: ``prompts/x.txt -> /etc/...`` in a checked-out repository must not let
``promptlint check --fix prompts/`` write outside ``prompts/`` (the open uses ``O_NOFOLLOW``, so the
check cannot be raced by swapping in a link afterwards).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from promptlint.canon import canonicalize
from promptlint.linter import FileResult
from promptlint.loader import REQUEST_EXTS

_MOVE_CODES = {"PC001", "PC002", "PC003"}
_YAML_COMMENT = re.compile(r"^\s*#|\s#", re.MULTILINE)


class _Refused(Exception):
    """The file is not one --fix may write (a symlink, or outside the named trees)."""


def fix_file(result: FileResult, roots: Sequence[Path] = (Path("."),)) -> list[str]:
    """Apply the safe fixes for one file's findings; return human-readable changes (empty: none).

    ``roots`` are the paths named on the command line: only files inside them are written.
    """
    doc = result.doc
    fixable = [f for f in result.findings if f.fixable]
    if doc is None or not fixable or doc.kind == "source":
        return []  # source files are never rewritten: the fix is a code change
    try:
        if doc.kind == "request":
            return _fix_request(result, roots)
        return _fix_template(result, {f.line for f in fixable if f.code in _MOVE_CODES}, roots)
    except _Refused as exc:
        return [f"not fixed: {exc}"]


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    real = Path(os.path.realpath(path))
    for root in roots:
        top = Path(os.path.realpath(root))
        if real == top or (root.is_dir() and real.is_relative_to(top)):
            return True
    return False


def _write(path: Path, text: str, roots: Sequence[Path]) -> None:
    """Write ``text`` over ``path`` if it is a regular file inside ``roots`` reached without symlinks."""
    if path.is_symlink():
        raise _Refused(f"{path} is a symlink; --fix never writes through one (fix its target directly)")
    if not _inside(path, roots):
        raise _Refused(f"{path} resolves outside the paths given on the command line")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise _Refused(f"cannot write {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def _indent(raw: str) -> int:
    m = re.search(r"^\{\s*\n([ \t]+)\S", raw)
    return len(m.group(1)) if m else 2


def _fix_request(result: FileResult, roots: Sequence[Path]) -> list[str]:
    doc = result.doc
    assert doc is not None and doc.body is not None
    res = canonicalize(doc.body, "safe")
    if not res.applied:
        return []
    ext = doc.path.suffix.lower()
    if ext == ".json":
        text = json.dumps(res.body, indent=_indent(doc.raw), ensure_ascii=False) + "\n"
    else:
        if _YAML_COMMENT.search(doc.raw):
            return [f"not fixed ({', '.join(res.applied)}): YAML with comments would lose them; fix by hand"]
        text = yaml.safe_dump(res.body, sort_keys=False, allow_unicode=True, width=10_000)
    _write(doc.path, text, roots)
    return list(res.applied)


def _fix_template(result: FileResult, lines_to_move: set[int], roots: Sequence[Path]) -> list[str]:
    doc = result.doc
    assert doc is not None
    if not lines_to_move:
        return []
    if doc.path.suffix.lower() in REQUEST_EXTS:
        # The template is a string inside YAML/JSON: moving raw lines could break the document.
        return ["not fixed: move the marked lines by hand in a YAML/JSON template"]
    all_lines = doc.raw.split("\n")
    head, body = all_lines[: doc.body_line - 1], all_lines[doc.body_line - 1 :]
    idx = sorted(n - doc.body_line for n in lines_to_move if 0 <= n - doc.body_line < len(body))
    if not idx:
        return []
    moved = [body[i] for i in idx]
    rest = [x for i, x in enumerate(body) if i not in set(idx)]
    while rest and not rest[-1].strip():
        rest.pop()
    # Already at the end (after trailing blank lines): nothing to do. This keeps --fix idempotent.
    tail = body[: len(body)]
    while tail and not tail[-1].strip():
        tail.pop()
    if tail[-len(moved) :] == moved:
        return []
    new_body = rest + moved + [""]
    _write(doc.path, "\n".join(head + new_body), roots)
    return [f"moved line {doc.body_line + i} to the end" for i in idx]
