"""PC000 invalid-file: a prompt file that cannot be read or parsed.

What:
    The file is unreadable, not UTF-8, invalid JSON/YAML/front matter, an invalid Jinja2 template,
    or (when named on the command line) a data file that is not a chat request or template.

Why:
    promptlint cannot judge what it cannot parse, and neither can your renderer: the prompt it
    produces is unknown, so nothing about its cacheability can be promised.

Example:
    {"messages": [{"role": "system", "content": "You are helpful."}   <- missing ']' and '}'

Fix:
    Repair the syntax at the reported line. To lint a data file that is not a prompt, give it a
    'messages', 'system', 'tools' or 'template' key; otherwise leave it out of the paths.
"""

from promptlint.model import Severity

CODE = "PC000"
NAME = "invalid-file"
SEVERITY: Severity = "error"
SUMMARY = "the file cannot be read or parsed as a prompt"
FIXABLE = False
# Emitted by promptlint.loader, not by a check function.
