"""Prefix-cache friendliness linter for prompt templates, and the canonicalization the gateway applies.

``promptlint.canon`` is the gateway's per-request canonicalization (stdlib only); the rest is the
``promptlint`` command. Nothing here imports the other PrefixGate packages.
"""

__version__ = "0.1.0"
