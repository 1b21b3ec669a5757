"""The ChatML chat template both built-in models use, with OpenAI-style tools (Hermes / Qwen style).

Rendered by transformers' ``apply_chat_template`` (jinja2, sandboxed). What it accepts:

- message ``content``: a string, a list of OpenAI content parts (text parts are concatenated
  exactly, nothing stripped or joined with separators) or null (an assistant turn that only calls
  tools);
- ``tools``: the OpenAI ``[{"type": "function", "function": {...}}]`` list, rendered as a
  ``# Tools`` block with one JSON signature per line inside ``<tools></tools>`` in the system turn;
- assistant ``tool_calls``: each rendered as ``<tool_call>{"name", "arguments"}</tool_call>``
  (``arguments`` may be the OpenAI JSON string or an object);
- ``tool`` messages (results): rendered as a ``tool`` turn with their content.

``default_system`` is the system turn a model was trained to see when the request has none
(SmolLM2's own template adds one); None = no system turn unless the request brings one.
"""

from __future__ import annotations

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

_TEXT_MACRO = """\
{%- macro text(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}
{%- if part.text is not string -%}{{ raise_exception('a text content part needs a "text" string') }}{%- endif -%}
{{ part.text }}
{%- endif -%}
{%- endfor -%}
{%- else -%}{{ raise_exception('message content must be a string, a list of parts or null') }}
{%- endif -%}
{%- endmacro -%}
"""

_BODY = """\
{%- set first_is_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
<|im_start|>system
{% if first_is_system %}{{ text(messages[0].content) }}

{% elif default_system %}{{ default_system }}

{% endif %}# Tools

You may call one or more functions. Their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, answer with a JSON object inside <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif first_is_system -%}
<|im_start|>system
{{ text(messages[0].content) }}<|im_end|>
{% elif default_system -%}
<|im_start|>system
{{ default_system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role is not string -%}{{ raise_exception('every message needs a "role" string') }}{%- endif -%}
{%- if not (loop.first and first_is_system) -%}
<|im_start|>{{ message.role }}
{{ text(message.content) }}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call %}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""


def chatml_template(default_system: str | None = None) -> str:
    """The jinja source of the ChatML + tools template; ``default_system`` is baked in as a literal."""
    if default_system is None:
        preamble = "{%- set default_system = none -%}\n"
    else:
        if "'" in default_system or "\\" in default_system or "{" in default_system:
            raise ValueError("default_system must not contain quotes, backslashes or braces")
        preamble = "{%- set default_system = '" + default_system + "' -%}\n"
    return _TEXT_MACRO + preamble + _BODY
