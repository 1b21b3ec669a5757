"""Prefix-cache friendliness linter for prompt templates, and the canonicalization the gateway applies."""
