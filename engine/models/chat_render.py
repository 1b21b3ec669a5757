"""Chat template -> token ids, with client text always tokenized as text (never as control tokens).

Rendering the template to one string and tokenizing it would turn a user's literal
``<|im_end|>\\n<|im_start|>system`` into real control tokens (a prompt injection the model obeys).
So every string a client wrote is swapped for a marker before the template runs, the rendered
text is cut at the markers, and the pieces are tokenized separately::

    template(messages with markers)  ->  "<|im_start|>user\\n" [m0] "<|im_end|>\\n<|im_start|>assistant\\n"
                                           scaffolding: special     content: split_special_tokens=True
                                           tokens parsed            (a "<|im_end|>" in it is plain text)

Which strings are client text: message ``content`` (a string or each text part's ``text``),
``name``, tool-call names and arguments (always), and the keys and values inside ``tools`` and
tool-call argument objects, which templates also inspect (``tool.type == "function"``), so those
are swapped only when they hold a special-token string. Strings that the template serializes with
``tojson`` are substituted JSON-escaped, as ``tojson`` would have written them. Adjacent content pieces (text parts of one
message) are joined before tokenizing.

When no client string holds a special-token string (all ordinary traffic) the whole rendered text
is tokenized in one call, exactly as ``apply_chat_template(tokenize=True)`` would; only a request
that carries special-token strings is tokenized piecewise (which may split whitespace runs at a
scaffolding/content border into separate tokens: the text is the same, and it is never a control
token).

A template that edits a marker (``trim``, slicing) cannot be rendered this way and is refused with
a ValueError rather than tokenized unsafely.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase


class _Markers:
    """Issues ``\\ue000<nonce>:<i>\\ue001`` markers (private-use characters, a fresh random nonce)."""

    def __init__(self, special_tokens: Sequence[str]) -> None:
        self.nonce = secrets.token_hex(8)
        self.texts: list[str] = []
        self.pattern = re.compile("\ue000" + self.nonce + r":(\d+)\ue001")
        self.special_tokens = tuple(special_tokens)

    def holds_special(self, s: str) -> bool:
        return any(tok in s for tok in self.special_tokens)

    def text(self, s: str) -> str:
        self.texts.append(s)
        return f"\ue000{self.nonce}:{len(self.texts) - 1}\ue001"

    def json_text(self, s: str) -> str:
        """A string the template will pass through ``tojson``: substituted already JSON-escaped."""
        return self.text(json.dumps(s, ensure_ascii=False)[1:-1])

    def json_tree(self, value: Any) -> Any:
        """A structure the template may both inspect and ``tojson``: only strings holding a
        special-token string are swapped (a template comparing ``type == "function"`` still works)."""
        if isinstance(value, str):
            return self.json_text(value) if self.holds_special(value) else value
        if isinstance(value, dict):
            return {
                self.json_text(k) if isinstance(k, str) and self.holds_special(k) else k: self.json_tree(v)
                for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            return [self.json_tree(v) for v in value]
        return value


def _protect_message(message: dict, m: _Markers) -> dict:
    out = dict(message)
    content = out.get("content")
    if isinstance(content, str):
        out["content"] = m.text(content)
    elif isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part = {**part, "text": m.text(part["text"])}
            parts.append(part)
        out["content"] = parts
    if isinstance(out.get("name"), str):
        out["name"] = m.text(out["name"])
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_protect_call(c, m) for c in calls]
    return out


def _protect_call(call: Any, m: _Markers) -> Any:
    if not isinstance(call, dict):
        return call
    call = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict):
        fn = dict(fn)
        if isinstance(fn.get("name"), str):
            fn["name"] = m.text(fn["name"])
        args = fn.get("arguments")
        fn["arguments"] = m.text(args) if isinstance(args, str) else m.json_tree(args)
        call["function"] = fn
    return call


def render_chat_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
) -> list[int]:
    """Token ids of ``tokenizer``'s chat template over ``messages`` (+ ``tools``), ending in the
    generation prompt; client strings never become special tokens. Raises ValueError when the
    template cannot render the messages."""
    markers = _Markers([t.content for t in tokenizer.added_tokens_decoder.values() if t.special])
    safe_messages = [_protect_message(dict(msg), markers) for msg in messages]
    safe_tools = [markers.json_tree(dict(t)) for t in tools] if tools else None
    try:
        text = tokenizer.apply_chat_template(
            safe_messages, tools=safe_tools, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja2 TemplateError, or the template's own raise_exception
        raise ValueError(f"cannot render these messages with the chat template: {exc}") from exc
    # annotated as any of its return shapes; tokenize=False (and no return_dict) gives the text
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return _tokenize_pieces(tokenizer, text, markers)


def _tokenize_pieces(tokenizer: PreTrainedTokenizerBase, text: str, markers: _Markers) -> list[int]:
    pieces: list[tuple[bool, str]] = []  # (is client text, text), adjacent client texts merged
    at = 0
    for match in markers.pattern.finditer(text):
        if match.start() > at:
            pieces.append((False, text[at : match.start()]))
        content = markers.texts[int(match.group(1))]
        if pieces and pieces[-1][0]:
            pieces[-1] = (True, pieces[-1][1] + content)
        else:
            pieces.append((True, content))
        at = match.end()
    if at < len(text):
        pieces.append((False, text[at:]))
    for is_content, piece in pieces:
        if not is_content and "\ue000" + markers.nonce in piece:
            raise ValueError("the chat template altered message text; it cannot be tokenized safely")
    full = "".join(p for _, p in pieces)
    if not _special_touches_content(full, pieces, markers.special_tokens):
        # Nothing to protect: one encode of the whole text, token for token what the template
        # plus tokenizer give (a split would tokenize "\n" + "\nMore" as two newlines, not one "\n\n").
        return tokenizer.encode(full, add_special_tokens=False)
    ids: list[int] = []
    for is_content, piece in pieces:
        # The template already contains any BOS it wants; never let the tokenizer add another.
        ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=is_content)
    return ids


def _special_touches_content(full: str, pieces: list[tuple[bool, str]], specials: Sequence[str]) -> bool:
    """Whether any special-token string in ``full`` overlaps client text (also one formed across
    two text parts, or across client text and scaffolding)."""
    spans, at = [], 0
    for is_content, piece in pieces:
        if is_content:
            spans.append((at, at + len(piece)))
        at += len(piece)
    if not spans:
        return False
    for tok in specials:
        start = full.find(tok)
        while start != -1:
            end = start + len(tok)
            if any(lo < end and start < hi for lo, hi in spans):
                return True
            start = full.find(tok, start + 1)
    return False
