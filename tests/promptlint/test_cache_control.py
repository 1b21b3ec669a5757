"""promptlint.cache_control: the one parser of cache_control breakpoints (gateway and linter)."""

from __future__ import annotations

import pytest

from promptlint.cache_control import (
    Breakpoint,
    CacheControlError,
    count_marks,
    parse_breakpoints,
    retention_seconds,
)

EPH = {"type": "ephemeral"}
LONG = {"type": "ephemeral", "ttl": "1h"}


def body(system=None, messages=None, tools=None):
    out = {"messages": messages or [{"role": "user", "content": "hi"}]}
    if system is not None:
        out["system"] = system
    if tools is not None:
        out["tools"] = tools
    return out


def test_breakpoints_in_prefix_order_tools_system_messages():
    b = body(tools=[{"name": "t", "cache_control": LONG}],
             system=[{"type": "text", "text": "s"}, {"type": "text", "text": "s2", "cache_control": EPH}],
             messages=[{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": EPH}]},
                       {"role": "assistant", "content": "a", "cache_control": EPH}])
    got = parse_breakpoints(b)
    assert got == [Breakpoint("tools", None, 0, "1h"), Breakpoint("system", None, 1, "5m"),
                   Breakpoint("messages", 0, 0, "5m"), Breakpoint("messages", 1, None, "5m")]
    assert [bp.ttl_s for bp in got] == [3600.0, 300.0, 300.0, 300.0]
    assert got[2].param == "messages.0.content.0.cache_control"


def test_no_marks_no_breakpoints():
    assert parse_breakpoints(body(system="plain")) == []


def test_more_than_four_is_refused_naming_the_fifth():
    system = [{"type": "text", "text": str(i), "cache_control": EPH} for i in range(5)]
    with pytest.raises(CacheControlError, match="maximum of 4") as exc:
        parse_breakpoints(body(system=system))
    assert exc.value.param == "system.4.cache_control"
    assert count_marks(body(system=system)) == 5


def test_1h_after_5m_is_refused_and_1h_before_5m_is_fine():
    ok = [{"type": "text", "text": "a", "cache_control": LONG}, {"type": "text", "text": "b", "cache_control": EPH}]
    assert [bp.ttl for bp in parse_breakpoints(body(system=ok))] == ["1h", "5m"]
    with pytest.raises(CacheControlError, match="must not come after") as exc:
        parse_breakpoints(body(system=ok[::-1]))
    assert exc.value.param == "system.1.cache_control"


@pytest.mark.parametrize("mark, param", [
    ({"type": "persistent"}, "system.0.cache_control.type"),
    ({"type": "ephemeral", "ttl": "2h"}, "system.0.cache_control.ttl"),
    ("ephemeral", "system.0.cache_control"),
])
def test_bad_marks(mark, param):
    with pytest.raises(CacheControlError) as exc:
        parse_breakpoints(body(system=[{"type": "text", "text": "a", "cache_control": mark}]))
    assert exc.value.param == param


def test_openai_retention():
    assert retention_seconds(None) is None and retention_seconds("in_memory") is None
    assert retention_seconds("24h") == 86400.0
    with pytest.raises(CacheControlError):
        retention_seconds("7d")


def test_the_linter_loader_sees_the_gateways_breakpoints(tmp_path):
    """PC010/PC011 read breakpoints from the loader's elements; the loader takes them from this parser."""
    import json

    from promptlint.loader import load

    request = body(
        tools=[{"name": "t", "input_schema": {}, "cache_control": LONG}],
        system=[{"type": "text", "text": "Static rules.", "cache_control": LONG}],
        messages=[{"role": "user", "content": "Earlier question", "cache_control": EPH},
                  {"role": "assistant", "content": [{"type": "text", "text": "Earlier answer", "cache_control": EPH}]},
                  {"role": "user", "content": [{"type": "text", "text": "Q?"}]}])
    p = tmp_path / "r.json"
    p.write_text(json.dumps(request))
    doc = load(p, named=True)
    assert sum(e.breakpoint for e in doc.elements) == len(parse_breakpoints(request)) == 4
