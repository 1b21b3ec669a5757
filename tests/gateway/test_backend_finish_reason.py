"""What an engine node or a provider reports as ``finish_reason`` becomes an output's reason: the ones OpenAI
defines (and abort) pass through, anything else ends as "stop", which every OpenAI client reads."""

from __future__ import annotations

import pytest

from engine.protocol import backend_finish_reason


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls", "content_filter", "abort"])
def test_the_reasons_openai_defines_pass_through(reason):
    assert backend_finish_reason(reason) == reason


@pytest.mark.parametrize("reported", [None, "", "end_turn", "function_call", "STOP", ["stop"], {"r": 1}, 3])
def test_anything_else_ends_as_stop(reported):
    assert backend_finish_reason(reported) == "stop"
