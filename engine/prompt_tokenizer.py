"""A model's tokenizer and chat template outside an engine: the token ids a node would compute.

A gateway in front of a pool of engine nodes (PrefixGate or vLLM) sends them token-id prompts so
that every node sees exactly the tokens the router hashed (``engine.block_hashing``): the router
can then place a request on the node that holds its longest prefix, and a chat request reaches
the node as the same ids whichever node it lands on. That needs the pool's tokenizer and chat
template in the gateway's process, loaded from the same checkpoint directory the nodes serve.

Rendering is the engine's own (``engine.models.chat_render``: client text is always tokenized as
text, never as control tokens), so a chat request rendered here and one rendered by a node's own
``/v1/chat/completions`` give the same ids.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.models.chat_render import render_chat_ids
from engine.protocol import GenerateRequest
from engine.tokenizer_pool import TokenizerPool


class TokenizerLoadError(ValueError):
    """The directory holds no tokenizer that transformers can load (one line, for start-up errors)."""


class PromptTokenizer:
    """``tokenize(request)`` exactly as ``LLMEngine.tokenize`` does it: the given ids, the chat
    template for messages (+ tools), or the tokenizer for text. Thread-safe, with no lock held
    while one runs: each thread borrows its own copy (``engine.tokenizer_pool``; one HF fast
    tokenizer must not be used from two threads at once), so two tenants tokenize in parallel."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, source: str) -> None:
        self._tokenizer = tokenizer
        self._copies = TokenizerPool(tokenizer)
        self.source = source

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        """The tokenizer of a Hugging Face checkpoint (or tokenizer) directory, offline."""
        p = Path(path).expanduser()
        if not p.is_dir():
            raise TokenizerLoadError(f"tokenizer directory {p} does not exist")
        try:
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; one line for the operator
            raise TokenizerLoadError(f"cannot load a tokenizer from {p}: {str(exc).splitlines()[0]}") from None
        return cls(tok, source=str(p))

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return [int(t) for t in request.prompt_token_ids]
        if request.messages is not None and not self._tokenizer.chat_template:
            raise ValueError(f"the tokenizer at {self.source} has no chat template")
        with self._copies.borrow() as tok:
            if request.messages is not None:
                return list(render_chat_ids(tok, request.messages, request.tools))
            return list(tok.encode(request.prompt or ""))
