"""Writing a request back as YAML in the form of the file it came from (``--fix``).

PyYAML's default dump writes a multi-line string as a quoted flow scalar: every line break of a
``content: |`` block becomes a blank line inside ``'...'``, re-indented, which no one reviewing the
diff can read and which is not how prompt files are written. Here:

- a string that spans lines is a literal block (``|``; PyYAML adds ``-`` or ``+`` when the text's
  end needs it), unless YAML cannot hold it as one (trailing spaces on a line, control characters):
  then PyYAML quotes it, as it must;
- a list under a key is indented or not as the file indents its first one, with the file's indent:

      messages:          messages:
        - role: system   - role: system

- an explicit ``---`` at the start stays.

Comments cannot be kept by a dump; ``--fix`` never rewrites a YAML file that has any
(``fixability.rewrite_refusal``).
"""

from __future__ import annotations

import re

import yaml

# A key that opens a block, then its first nested line: the nested line's indent is the file's.
_NESTED = re.compile(r"^(?P<key> *)[^\s#-][^\n]*:[ \t]*\n(?P<child> *)\S", re.MULTILINE)


class _BlockDumper(yaml.SafeDumper):
    indent_sequences = True

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, indentless and not self.indent_sequences)


class _IndentlessDumper(_BlockDumper):
    indent_sequences = False


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_BlockDumper.add_representer(str, _represent_str)


def dump_like(body: dict[str, object], raw: str) -> str:
    """``body`` as YAML in the form of ``raw`` (the file's text): block scalars, list indentation."""
    nested = [(len(m["key"]), len(m["child"])) for m in _NESTED.finditer(raw)]
    indent = next((child - key for key, child in nested if child > key), 2)
    # A list whose "- " sits at its key's own column ("indentless", PyYAML's default) is written so.
    indentless = re.search(r"^(?P<key> *)[^\s#-][^\n]*:[ \t]*\n(?P=key)- ", raw, re.MULTILINE) is not None
    dumper = _IndentlessDumper if indentless else _BlockDumper
    return yaml.dump(body, Dumper=dumper, sort_keys=False, allow_unicode=True, width=10_000,
                     indent=min(max(indent, 2), 9), explicit_start=raw.startswith("---"))
