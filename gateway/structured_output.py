"""``response_format`` on the local engine: JSON output enforced while decoding (engine.guided).

    {"type": "text"}                                   no constraint
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
                                                       a JSON value valid for the schema

The schema is checked here (a valid JSON Schema, bounded size) so a bad one is a 400 before
admission, streamed or not; the engine then compiles it off the event loop under its own work
bounds. ``strict: false`` is enforced too: the output always validates.
"""

from __future__ import annotations

import json
from typing import Any

from engine.protocol import GuidedSpec
from gateway.errors import invalid_request
from gateway.tool_calls import check_schema

MAX_SCHEMA_BYTES = 64 * 1024  # the engine's bound too (engine.guided.MAX_SCHEMA_BYTES)


def guided_for_response_format(response_format: dict[str, Any] | None,
                               name: str = "response_format") -> GuidedSpec | None:
    """The grammar ``response_format`` asks for, or None for plain text. 400 on a bad format; its
    errors call the field ``name`` (``text.format`` on /v1/responses).

    The schema's size is checked first, on its serialized text (one C-speed ``json.dumps``): the
    meta-validation walks the whole schema, so a 1.4 MB one held the event loop for 0.3 s before
    the size bound refused it."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GuidedSpec(json_schema='{"type": "object"}')
    if kind != "json_schema":
        raise invalid_request(
            f"{name} type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'", param=name)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise invalid_request(f"{name}.json_schema must be an object with a 'schema'", param=name)
    schema = spec["schema"]
    where = f"{name}.json_schema.schema" if name == "response_format" else f"{name}.schema"
    try:
        text = json.dumps(schema, sort_keys=False)
    except (TypeError, ValueError, RecursionError):
        raise invalid_request(f"{where} is not serialisable JSON", param=name) from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise invalid_request(f"{where} is larger than {MAX_SCHEMA_BYTES} bytes", param=name,
                              code="schema_too_large")
    check_schema(schema, where)
    return GuidedSpec(json_schema=text)
