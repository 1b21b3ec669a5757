"""vLLM's KV events in the router's block hashes: a vLLM node's BlockStored (its own hashes, the
blocks' token ids, the cache_salt in the first block's extra keys) becomes index entries under
the chain the gateway computes for the same tenant's request; removals and clears undo them."""

from __future__ import annotations

import hashlib
import random

import pytest

pytest.importorskip("msgpack", reason="pip install 'prefixgate[fleet]' (msgpack)")

from engine.block_hashing import prefix_block_hashes  # noqa: E402
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch  # noqa: E402
from gateway.fleet_index import FleetIndex  # noqa: E402
from gateway.kv_event_subscriber import EventSource, KVEventSubscriber  # noqa: E402
from gateway.kv_event_translation import EventTranslator  # noqa: E402

BS = 16
NODE = "node:http://vllm"


def vllm_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Any hash of vLLM's own (the translation must not depend on how vLLM computes it)."""
    return hashlib.blake2b(repr((parent, tokens)).encode(), digest_size=32).digest()


def vllm_stored(tokens: list[int], parent: bytes | None, salt: str | None) -> tuple[BlockStored, list[bytes]]:
    hashes, prev = [], parent
    for i in range(0, len(tokens), BS):
        prev = vllm_hash(prev, tokens[i:i + BS])
        hashes.append(prev)
    extra = tuple([(salt,)] + [None] * (len(hashes) - 1)) if salt is not None else None
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium="GPU", extra_keys=extra), hashes


def feed(sub: KVEventSubscriber, seq: int, *events) -> None:
    sub.apply(NODE, seq, encode_batch(KVEventBatch(1.0, tuple(events))))


def test_a_vllm_nodes_blocks_enter_the_index_under_the_routers_chain_and_leave_it():
    rng = random.Random(3)
    namespace = bytes(rng.randrange(256) for _ in range(16))
    prompt = [rng.randrange(50_000) for _ in range(6 * BS + 5)]
    index = FleetIndex(10_000, 3600.0)
    sub = KVEventSubscriber(index, [EventSource(NODE, "tcp://127.0.0.1:1")])
    chain = prefix_block_hashes(namespace, prompt, BS)  # what the router computes for the request
    assert len(chain) == 6
    # vLLM stores the prompt in two runs: the first 4 blocks (salt on block 1), then 2 more after them
    first, h1 = vllm_stored(prompt[:4 * BS], None, namespace.hex())
    second, h2 = vllm_stored(prompt[4 * BS:6 * BS], h1[-1], None)
    feed(sub, 0, first, second)
    assert index.prefix_lengths(chain, [NODE])[NODE] == 6
    other = prefix_block_hashes(b"another tenant", prompt, BS)  # same tokens, other salt: nothing shared
    assert index.prefix_lengths(other, [NODE])[NODE] == 0
    feed(sub, 1, BlockRemoved((h2[0],)))  # block 5 evicted: the prefix held ends at 4
    assert index.prefix_lengths(chain, [NODE])[NODE] == 4
    feed(sub, 2, AllBlocksCleared())
    assert index.prefix_lengths(chain, [NODE])[NODE] == 0
    assert sub.stats[NODE].bad_payloads == 0


def test_runs_it_cannot_place_are_skipped_never_guessed():
    t = EventTranslator()
    rng = random.Random(4)
    tokens = [rng.randrange(1000) for _ in range(2 * BS)]
    orphan, _ = vllm_stored(tokens, b"\x01" * 32, None)  # a parent it never saw
    unsalted, _ = vllm_stored(tokens, None, None)  # a first block without the gateway's salt
    ragged = BlockStored((b"\x02" * 32,), None, tuple(tokens[:BS - 1]), BS, extra_keys=(("ab",),))
    assert t.stored(orphan) == [] and t.stored(unsalted) == [] and t.stored(ragged) == []
    assert t.untranslatable == 3
    # a PrefixGate node publishes the router's hashes and no tokens: they pass through as they are
    own = prefix_block_hashes(b"ns", tokens + [0], BS)
    assert t.stored(BlockStored(tuple(own), None, (), BS)) == own


def test_the_map_is_bounded():
    t = EventTranslator(max_mapped=8)
    rng = random.Random(5)
    for k in range(4):
        ev, _ = vllm_stored([rng.randrange(1000) for _ in range(4 * BS)], None, bytes([k]).hex())
        assert len(t.stored(ev)) == 4
    assert len(t) == 8
