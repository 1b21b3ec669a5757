"""``--fix``: safe, meaning-preserving rewrites only, and a list of what changed.

- Request files: for each rule with a fix that reported on the file, the ``safe`` canonical form
  from :mod:`promptlint.canon` of the keys that rule checks: PC004 its tools and schemas (sorted by
  name, keys sorted), PC009 its messages (edges trimmed). A rule that is off for the file (not
  selected, ignored, per-file-ignored, ``noqa``) reports nothing there, so its fix never runs.
  Written back as JSON with the file's indentation. YAML files are rewritten only if they hold no
  comments (a YAML dump would drop them).
- Templates: lines holding a value that the template marks as movable (``promptlint: movable`` on
  the line, or front matter ``movable: [var, ...]``) and that a PC001/PC002/PC003 finding flagged
  move, in order, to the end of the template. A marked Jinja block tag moves with its whole block; a
  line inside a block, one that binds a name, or one that also holds an unmarked value stays, with a
  ``not fixed`` note saying why (:mod:`promptlint.moves`). A result that does not parse is not written.

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
from collections.abc import Collection, Sequence
from pathlib import Path

from promptlint.canon import CanonResult, canonicalize
from promptlint.fixability import rewrite_refusal
from promptlint.line_ends import restore_line_ends, without_line_ends
from promptlint.linter import FileResult
from promptlint.model import PromptDoc
from promptlint.moves import plan
from promptlint.rules import pc004_unstable_tool_order, pc009_unstable_whitespace
from promptlint.yaml_form import dump_like

_MOVE_CODES = {"PC001", "PC002", "PC003"}
# Rule -> the request keys its fix canonicalizes: the keys the rule itself checks, and no others.
_REQUEST_FIXES: dict[str, tuple[str, ...]] = {
    pc004_unstable_tool_order.CODE: pc004_unstable_tool_order.CANON_KEYS,
    pc009_unstable_whitespace.CODE: pc009_unstable_whitespace.CANON_KEYS,
}


class _Refused(Exception):
    """The file is not one --fix may write (a symlink, or outside the named trees)."""


def fix_file(result: FileResult, roots: Sequence[Path] = (Path("."),)) -> list[str]:
    """Apply the safe fixes for one file's findings; return human-readable changes (empty: none).

    ``roots`` are the paths named on the command line: only files inside them are written.
    """
    doc = result.doc
    if doc is None or doc.kind == "source":
        return []  # source files are never rewritten (fixability.rewrite_refusal): the fix is a code change
    try:
        if doc.kind == "request":
            return _fix_request(result, roots)
        return _fix_template(result, {f.line for f in result.findings if f.fixable and f.code in _MOVE_CODES}, roots)
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
    res = _canonical_parts(doc, {f.code for f in result.findings})
    if not res.applied:
        return []
    refusal = rewrite_refusal(doc)
    if refusal:
        return [f"not fixed ({', '.join(res.applied)}): {refusal}"]
    if doc.path.suffix.lower() == ".json":
        text = json.dumps(res.body, indent=_indent(doc.raw), ensure_ascii=False) + "\n"
    else:
        text = dump_like(res.body, doc.raw)
    _write(doc.path, text, roots)
    return list(res.applied)


def _canonical_parts(doc: PromptDoc, reported: Collection[str]) -> CanonResult:
    """The request with the keys of each reported rule in ``_REQUEST_FIXES`` canonicalized, the rest
    as it was (a key keeps its place in the file). The newline a YAML block scalar ends with is the
    format's, not a message edge: it is set aside and put back, so ``content: |`` stays a ``|`` block."""
    assert doc.body is not None
    body = without_line_ends(doc.body, doc.block_line_ends)
    new = dict(body)
    applied: list[str] = []
    for code, keys in _REQUEST_FIXES.items():
        if code in reported:
            res = canonicalize({k: body[k] for k in keys if k in body}, "safe")
            new.update(res.body)
            applied.extend(res.applied)
    restore_line_ends(new, doc.block_line_ends)
    return CanonResult(new, tuple(applied))


def _fix_template(result: FileResult, lines_to_move: set[int], roots: Sequence[Path]) -> list[str]:
    doc = result.doc
    assert doc is not None
    if not lines_to_move:
        return []
    move = plan(doc, lines_to_move)
    notes = [f"not fixed: line {line} stays: {why}" for line, why in sorted(move.refused.items())]
    if not move.units:
        return notes
    all_lines = doc.raw.split("\n")
    head, body = all_lines[: doc.body_line - 1], all_lines[doc.body_line - 1 :]
    moving = {n - doc.body_line for u in move.units for n in range(u.first, u.last + 1)}
    moved = [x for i, x in enumerate(body) if i in moving]
    rest = [x for i, x in enumerate(body) if i not in moving]
    while rest and not rest[-1].strip():
        rest.pop()
    new_body = rest + moved + [""]
    # Already at the end (up to trailing blank lines): nothing to do. This keeps --fix idempotent.
    if "\n".join(new_body).rstrip() == "\n".join(body).rstrip():
        return notes
    new_text = "\n".join(head + new_body)
    if _breaks_jinja(doc, "\n".join(new_body)):
        return [*notes, "not fixed: moving the marked lines would leave an invalid Jinja template"]
    _write(doc.path, new_text, roots)
    done = [f"moved line {u.first} to the end" if u.first == u.last else f"moved lines {u.first}-{u.last} to the end"
            for u in move.units]
    return [*done, *notes]


def _breaks_jinja(doc: PromptDoc, new_body: str) -> bool:
    """A last guard: the rewritten body of a Jinja template must still parse."""
    if str(doc.meta.get("syntax", "auto")) not in ("auto", "jinja") or not ("{%" in new_body or "{#" in new_body):
        return False
    import jinja2  # deferred: only a Jinja --fix pays for it

    try:
        jinja2.Environment().parse(new_body)
    except jinja2.TemplateSyntaxError:
        return True
    return False
