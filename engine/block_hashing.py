"""The engine's block-hash chain as a pure function, for code outside the engine.

A fleet's router (``gateway.routing``) names a request's prefix with exactly the hashes the
engines' prefix indexes and KV events use, so an index entry learned from a node's
``BlockStored`` event matches the request it should attract. Torch-free, no engine state.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_types import BlockHash
from engine.prefix_index import block_hashes, max_cacheable_blocks

__all__ = ["DEFAULT_BLOCK_SIZE", "BlockHash", "chain_from", "prefix_block_hashes"]

DEFAULT_BLOCK_SIZE = 16  # EngineConfig.block_size's default


def prefix_block_hashes(namespace: bytes, token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                        max_blocks: int | None = None) -> list[BlockHash]:
    """The chained hashes of the full blocks of ``token_ids`` an engine could serve from cache.

    Stops where the engine's own match stops (the last token is always computed), and after
    ``max_blocks`` blocks when given (a router needs only the prefix it can tell apart).
    """
    n = max_cacheable_blocks(len(token_ids), block_size)
    if max_blocks is not None:
        n = min(n, max_blocks)
    return block_hashes(namespace, token_ids[: n * block_size], block_size)


def chain_from(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hashes of the full blocks of ``token_ids`` chained on ``parent`` (the previous block's hash,
    or the namespace for a prompt's first block): what the engine's index calls those blocks."""
    return block_hashes(parent, token_ids, block_size)
