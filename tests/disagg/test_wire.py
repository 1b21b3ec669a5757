"""The chunk format's checks: every mismatch is a named rejection, never data (no engine needed)."""

from __future__ import annotations

import io

import pytest

from engine.disagg.api import derive_transfer_key
from engine.disagg.request_wire import request_from_wire, request_to_wire
from engine.disagg.wire import (
    MAC_BYTES,
    PREFIX_BYTES,
    ChainChecker,
    Chunk,
    EngineLayout,
    FrameKind,
    WireError,
    encode_chunk,
    read_frame,
)
from engine.prefix_index import block_hashes
from engine.protocol import GenerateRequest, StaticTenantScope

LAYOUT = EngineLayout(model="tiny", dtype="float32", block_size=4, num_layers=2, block_bytes=8)
KEY = derive_transfer_key("node-token")
NONCE = bytes(range(16))  # the receiver's hello on a connection
NS = b"tenant-a"
TOKENS = list(range(100, 116))  # 4 blocks of 4
HASHES = tuple(block_hashes(NS, TOKENS, 4))


class Source:
    def __init__(self, data: bytes) -> None:
        self.f = io.BytesIO(data)

    def read_exactly(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) < n:
            raise EOFError
        return b

    def read_into(self, buf: bytearray) -> None:
        buf[:] = self.read_exactly(len(buf))


def chunk(seq: int, first: int, n: int, **over) -> Chunk:
    fields = dict(transfer_id="t1", seq=seq, last=False, namespace=NS, first_block=first,
                  hashes=HASHES[first:first + n],
                  tokens=tuple(tuple(TOKENS[i * 4:(i + 1) * 4]) for i in range(first, first + n)),
                  layers=(0, 2), payload=bytes(range(first * 8, (first + n) * 8)))
    fields.update(over)
    return Chunk(**fields)


def frame(c: Chunk, layout: EngineLayout = LAYOUT, key: bytes = KEY) -> bytes:
    return b"".join(bytes(p) for p in encode_chunk(key, NONCE, layout, c))


def receive(data: bytes, checker: ChainChecker, key: bytes = KEY, nonce: bytes = NONCE) -> Chunk:
    kind, header, payload = read_frame(Source(data), key, nonce, max_payload=1 << 20)
    assert kind is FrameKind.CHUNK
    return checker.check(header, payload)


def test_round_trip_two_chunks_rebuilds_the_chain():
    checker = ChainChecker(LAYOUT)
    a = receive(frame(chunk(0, 0, 2)), checker)
    b = receive(frame(chunk(1, 2, 2, last=True)), checker)
    assert a.hashes == HASHES[:2] and b.last and bytes(b.payload) == bytes(range(16, 32))
    assert tuple(checker.chain) == HASHES


def test_flipped_payload_byte_fails_the_mac():
    data = bytearray(frame(chunk(0, 0, 2)))
    data[-40] ^= 1  # inside the payload
    with pytest.raises(WireError) as err:
        receive(bytes(data), ChainChecker(LAYOUT))
    assert err.value.reason == "bad_mac"


def test_wrong_key_fails_the_mac():
    with pytest.raises(WireError) as err:
        receive(frame(chunk(0, 0, 1), key=derive_transfer_key("other")), ChainChecker(LAYOUT))
    assert err.value.reason == "bad_mac"


@pytest.mark.parametrize(("over", "sender", "reason"), [
    ({}, EngineLayout("tiny", "bfloat16", 4, 2, 8), "dtype"),
    ({}, EngineLayout("other-model", "float32", 4, 2, 8), "model"),
    ({}, EngineLayout("tiny", "float32", 4, 2, 4), "block_bytes"),
    ({"layers": (0, 1)}, LAYOUT, "layers"),
    ({"hashes": HASHES[1:3]}, LAYOUT, "hash_chain"),  # hashes that are not these tokens' chain
    ({"namespace": b"tenant-b"}, LAYOUT, "hash_chain"),  # another tenant's namespace: other hashes
    ({"payload": b"\0" * 9}, LAYOUT, "size"),
])
def test_header_mismatches_are_named_rejections(over, sender, reason):
    # the sender signs what it claims (a valid MAC); the receiver's own layout or chain disagrees
    data = frame(chunk(0, 0, 2, **over), layout=sender)
    with pytest.raises(WireError) as err:
        receive(data, ChainChecker(LAYOUT))
    assert err.value.reason == reason


def test_out_of_order_chunk_is_rejected():
    checker = ChainChecker(LAYOUT)
    receive(frame(chunk(0, 0, 1)), checker)
    with pytest.raises(WireError) as err:
        receive(frame(chunk(1, 2, 1)), checker)  # skipped block 1
    assert err.value.reason == "out_of_order"


def test_truncated_frame_is_eof():
    with pytest.raises(EOFError):
        receive(frame(chunk(0, 0, 2))[:-5], ChainChecker(LAYOUT))


def test_a_transfer_may_start_after_blocks_the_receiver_holds():
    checker = ChainChecker(LAYOUT)
    c = receive(frame(chunk(0, 2, 2, last=True, prefix=HASHES[:2])), checker)
    assert c.first_block == 2 and c.prefix == HASHES[:2] and tuple(checker.chain) == HASHES


def test_prefix_hashes_must_match_the_first_block():
    with pytest.raises(WireError) as err:
        receive(frame(chunk(0, 2, 2, prefix=HASHES[:1])), ChainChecker(LAYOUT))
    assert err.value.reason == "bad_header"
    with pytest.raises(WireError) as err:  # claimed prefix that is not these tokens' parent: chain breaks
        receive(frame(chunk(0, 2, 2, prefix=(HASHES[1], HASHES[0]))), ChainChecker(LAYOUT))
    assert err.value.reason == "hash_chain"


def test_the_request_wire_carries_the_tenant_key_and_accepts_a_peer_without_one():
    scope = StaticTenantScope(namespace=b"\x01\x02", tenant_key=b"\xaa\xbb", kv_block_quota=10)
    wire = request_to_wire(GenerateRequest("r", scope, prompt_token_ids=[1, 2, 3]))
    back = request_from_wire(wire)
    assert (back.tenant.namespace, back.tenant.tenant_key) == (b"\x01\x02", b"\xaa\xbb")
    del wire["tenant"]["tenant_key"]  # what a gateway from before tenant keys sends
    assert request_from_wire(wire).tenant.tenant_key == b"\x01\x02"  # its namespace is its tenant


def test_a_frame_is_bound_to_its_connection():
    # a frame recorded on one connection (nonce) replayed on another fails its prefix MAC
    with pytest.raises(WireError) as err:
        receive(frame(chunk(0, 0, 2)), ChainChecker(LAYOUT), nonce=bytes(16))
    assert err.value.reason == "bad_mac"


class CountingSource(Source):
    """Counts what the reader asked for; a payload read (``read_into``) is a failure here."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read = 0

    def read_exactly(self, n: int) -> bytes:
        self.read += n
        return super().read_exactly(n)

    def read_into(self, buf: bytearray) -> None:
        raise AssertionError(f"allocated and read a {len(buf)}-byte payload before authenticating it")


def test_forged_sizes_are_rejected_after_the_prefix_alone():
    data = bytearray(frame(chunk(0, 0, 2)))
    data[10:18] = (1 << 30).to_bytes(8, "big")  # payload_len: a claim of 1 GiB
    source = CountingSource(bytes(data))
    with pytest.raises(WireError) as err:
        read_frame(source, KEY, NONCE, max_payload=1 << 31)
    assert err.value.reason == "bad_mac" and source.read == PREFIX_BYTES + MAC_BYTES


def test_the_tenant_key_travels_with_the_transfer_and_cannot_change_in_it():
    checker = ChainChecker(LAYOUT)
    a = receive(frame(chunk(0, 0, 2, tenant_key=b"\xaa\xbb")), checker)
    b = receive(frame(chunk(1, 2, 1, tenant_key=b"\xaa\xbb")), checker)
    assert a.tenant_key == b.tenant_key == b"\xaa\xbb"
    with pytest.raises(WireError) as err:  # a later chunk of the transfer claiming another tenant
        receive(frame(chunk(2, 3, 1, tenant_key=b"\xcc")), checker)
    assert err.value.reason == "mixed_transfer"
    # a sender that names no tenant key (the namespace is the tenant, or an older sender)
    assert receive(frame(chunk(0, 0, 1)), ChainChecker(LAYOUT)).tenant_key == NS
