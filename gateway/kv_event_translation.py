"""A node's KV events in the router's own block hashes, whichever engine published them.

A PrefixGate node publishes the hashes of its prefix index, which are the router's
(``engine.block_hashing``): they go into the fleet index as they are. vLLM hashes blocks its
own way, so its hashes never match a request's chain; but its ``BlockStored`` events carry what
is needed to compute ours: the blocks' token ids, the parent block, and (vLLM 0.32's
``extra_keys``) the request's ``cache_salt`` on a prompt's first block, which the gateway set to
the tenant namespace in hex. So::

    BlockStored(hashes h1..hn, parent p, tokens, extra_keys)
        parent None  -> ours_0 = namespace = bytes.fromhex(salt of block 1)
        parent p     -> ours_0 = seen[p]            (unknown p: the run is skipped, not guessed)
        ours_i = hash_block(ours_{i-1}, tokens of block i);  seen[h_i] = ours_i

    BlockRemoved(h...) -> seen.pop(h) for the hashes it knows; a hash it never mapped is taken as
    the router's own (a PrefixGate node), which the index ignores when it holds no such block.

``seen`` is bounded (oldest first out), so a long-lived node cannot grow the gateway's memory;
a block whose mapping was forgotten is only a miss in routing, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.block_hashing import BlockHash, chain_from
from engine.kv_events import BlockRemoved, BlockStored, ExternalBlockHash

DEFAULT_MAX_MAPPED = 1 << 20


def _salt_namespace(extra: tuple[object, ...] | None) -> bytes | None:
    """The namespace in a first block's extra keys: the one hex string there (the gateway's salt)."""
    for item in extra or ():
        if isinstance(item, str):
            try:
                return bytes.fromhex(item)
            except ValueError:
                continue
    return None


class EventTranslator:
    """One node's event hashes -> the router's ``BlockHash``es (see the module docstring)."""

    def __init__(self, max_mapped: int = DEFAULT_MAX_MAPPED) -> None:
        self._seen: OrderedDict[ExternalBlockHash, BlockHash] = OrderedDict()
        self._max = max_mapped
        self.untranslatable = 0  # stored runs skipped: unknown parent, no salt, or ragged tokens

    def stored(self, ev: BlockStored) -> list[BlockHash]:
        if not ev.token_ids:  # a PrefixGate node: its hashes are the router's
            return [BlockHash(h) for h in ev.block_hashes if isinstance(h, bytes)]
        n, bs = len(ev.block_hashes), ev.block_size
        if bs <= 0 or len(ev.token_ids) != n * bs:
            self.untranslatable += 1
            return []
        if ev.parent_block_hash is None:
            parent = _salt_namespace(ev.extra_keys[0] if ev.extra_keys else None)
        else:
            parent = self._seen.get(ev.parent_block_hash)
        if parent is None:
            self.untranslatable += 1
            return []
        ours = chain_from(parent, ev.token_ids, bs)
        for ext, h in zip(ev.block_hashes, ours, strict=True):
            self._seen[ext] = h
            self._seen.move_to_end(ext)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return ours

    def removed(self, ev: BlockRemoved) -> list[BlockHash]:
        out = []
        for h in ev.block_hashes:
            mine = self._seen.pop(h, None)
            if mine is not None:
                out.append(mine)
            elif isinstance(h, bytes):
                out.append(BlockHash(h))
        return out

    def clear(self) -> None:
        self._seen.clear()

    def __len__(self) -> int:
        """How many of the node's hashes it maps now (at most ``max_mapped``)."""
        return len(self._seen)
