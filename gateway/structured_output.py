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


def guided_for_response_format(response_format: dict[str, Any] | None) -> GuidedSpec | None:
    """The grammar ``response_format`` asks for, or None for plain text. 400 on a bad format."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GuidedSpec(json_schema='{"type": "object"}')
    if kind != "json_schema":
        raise invalid_request(
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
            param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise invalid_request("response_format.json_schema must be an object with a 'schema'",
                              param="response_format")
    schema = spec["schema"]
    check_schema(schema, "response_format.json_schema.schema")
    try:
        text = json.dumps(schema, sort_keys=False)
    except (TypeError, ValueError, RecursionError):
        raise invalid_request("response_format.json_schema.schema is not serialisable JSON",
                              param="response_format") from None
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise invalid_request(f"response_format.json_schema.schema is larger than {MAX_SCHEMA_BYTES} bytes",
                              param="response_format")
    return GuidedSpec(json_schema=text)
