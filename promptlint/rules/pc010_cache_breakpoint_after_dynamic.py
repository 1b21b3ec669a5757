"""PC010 cache-breakpoint-after-dynamic: an Anthropic ``cache_control`` breakpoint caches dynamic content.

What:
    A ``cache_control`` breakpoint sits on or after a block that holds a volatile value, a per-user
    value or a template variable, so the cached prefix it writes includes that value. (A breakpoint
    on the last user message, the usual multi-turn pattern, is fine.)

Why:
    The breakpoint pays the cache-write premium (1.25x input price) on every request, and the entry
    it writes is only read by a request with the same value: with a timestamp, never.

Example:
    "system": [{"type": "text", "text": "Now: 2026-11-29T10:00Z. You are ...",
                "cache_control": {"type": "ephemeral"}}]

Fix:
    Put the breakpoint on the last block of static content, before the first dynamic value, and
    move dynamic values after it.
"""

from promptlint.analysis import finding, shown

CODE = "PC010"
NAME = "cache-breakpoint-after-dynamic"
SEVERITY = "warning"
SUMMARY = "a cache_control breakpoint comes after dynamic content"
FIXABLE = False


def check(doc, ctx):
    first_dyn = None
    late = []
    for e in doc.elements:
        if first_dyn is None and e.dyn in ("volatile", "per-user", "placeholder", "control"):
            first_dyn = e
        if e.breakpoint and first_dyn is not None:
            late.append(e)
    if late:
        more = f" ({len(late) - 1} later breakpoint(s) likewise)" if len(late) > 1 else ""
        yield finding(
            doc, late[0], CODE, SEVERITY,
            f"cache_control breakpoint caches a prefix that includes dynamic value {shown(first_dyn)} "
            f"(line {first_dyn.line}), so it is written on every request and rarely read{more}; put the "
            "breakpoint before the first dynamic value",
        )
