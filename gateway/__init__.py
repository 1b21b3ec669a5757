"""OpenAI-compatible gateway: auth, canonicalization, routing, streaming, metrics, CLI."""
