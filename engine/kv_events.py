"""KV cache events: which blocks an engine stored and evicted, published for a fleet's router.

The wire is vLLM's (``--kv-events-config``; checked against vLLM 0.32's own decoder), so one subscriber in the gateway serves PrefixGate
nodes and vLLM servers alike::

    engine step loop ──BlockEventObserver──► KVEventPublisher (queue) ──thread──► ZMQ PUB socket
                                                                                  │ tcp://host:port
    gateway  KVEventSubscriber (SUB, one per node) ◄──────────────────────────────┘
    frames:  [topic, seq (8-byte big-endian, +1 per batch), msgpack(KVEventBatch)]
    KVEventBatch = [ts, [event, ...], data_parallel_rank]     (vLLM 0.32: an array)
    event        = {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                    "block_size", "lora_id", "medium", "lora_name"}       (a map, tagged by "type")
                 | {"type": "BlockRemoved", "block_hashes", "medium"}
                 | {"type": "AllBlocksCleared"}
    Older vLLM releases sent each event as a tagged array (["BlockStored", hashes, ...]); the
    decoder reads both, and ignores fields and event kinds it does not know (newer engines add some).

What a PrefixGate node puts in the fields, and why:
    - ``block_hashes`` are the engine's own chained SHA-256 hashes (``engine.prefix_index``),
      salted by the tenant namespace: the gateway computes the same chain over the token ids it
      routes, so an index lookup needs no tokens and no tree.
    - ``token_ids`` is empty: a tenant's prompt never leaves the node in the clear; the salted
      hashes say where a prefix lives without saying what it is.
    - ``parent_block_hash`` is None: a chained hash already names its whole prefix.
    - ``medium`` is ``"hbm"``: only the HBM index is published (a block spilled to DRAM/NVMe is
      still restorable there; the router under-counts it, which costs a little affinity).

A subscriber that connects late misses what was published before (ZMQ PUB/SUB has no history);
the index is approximate by design and its entries expire.

``msgpack`` and ``pyzmq`` come with ``pip install prefixgate[fleet]``; they are imported only when
events are encoded or a socket is opened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.kv_types import BlockHash

ExternalBlockHash = bytes | int  # vLLM sends bytes (sha256 hashers) or int (builtin hash)
MEDIUM_HBM = "hbm"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 16
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # vLLM 0.32: per block, the extra keys its hash covered (LoRA name, multimodal ids, the
    # request's cache_salt string on the first block, ...); None where none (PrefixGate nodes).
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[ExternalBlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...] = ()
    data_parallel_rank: int | None = None


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch in the schema above."""


def _event_to_wire(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(ev.block_hashes), "parent_block_hash": ev.parent_block_hash,
                "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": ev.lora_id,
                "medium": ev.medium, "lora_name": ev.lora_name,
                "extra_keys": None if ev.extra_keys is None else [None if k is None else list(k) for k in ev.extra_keys]}
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of ``batch`` in vLLM's layout (a default ``data_parallel_rank`` is omitted)."""
    import msgpack

    wire = [batch.ts, [_event_to_wire(e) for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(wire, use_bin_type=True)


def _hashes(value: Any) -> tuple[ExternalBlockHash, ...]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) for h in value):
        raise KVEventDecodeError("block_hashes must be a list of bytes or ints")
    return tuple(value)


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event_fields(item: Any) -> tuple[str, dict[str, Any]]:
    """An event's tag and fields, from the map form (vLLM 0.32) or the tagged array (older)."""
    if isinstance(item, dict) and isinstance(item.get("type"), str):
        return item["type"], item
    if isinstance(item, list) and item and isinstance(item[0], str):
        names = _FIELDS.get(item[0], ())
        return item[0], dict(zip(names, item[1:], strict=False))
    raise KVEventDecodeError(f"an event must be a map with a 'type' or a tagged array, got {type(item).__name__}")


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _extra_keys(value: Any) -> tuple[tuple[Any, ...] | None, ...] | None:
    """vLLM's per-block extra keys (lists on the wire), or None when absent or malformed."""
    if not isinstance(value, list):
        return None
    return tuple(tuple(k) if isinstance(k, list | tuple) else None for k in value)


def _event_from_wire(item: Any) -> KVEvent | None:
    """One event; None for a kind this reader does not know (a newer engine's event)."""
    tag, f = _event_fields(item)
    if tag == "BlockStored":
        if "block_hashes" not in f or not isinstance(f.get("block_size"), int):
            raise KVEventDecodeError("BlockStored needs block_hashes and an integer block_size")
        lora = f.get("lora_id")
        return BlockStored(_hashes(f["block_hashes"]), f.get("parent_block_hash"), tuple(f.get("token_ids") or ()),
                           f["block_size"], lora if isinstance(lora, int) else None, _text(f.get("medium")),
                           _text(f.get("lora_name")), _extra_keys(f.get("extra_keys")))
    if tag == "BlockRemoved":
        if "block_hashes" not in f:
            raise KVEventDecodeError("BlockRemoved needs block_hashes")
        return BlockRemoved(_hashes(f["block_hashes"]), _text(f.get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in ``payload``; raises ``KVEventDecodeError`` if it is not one."""
    import msgpack

    try:
        wire = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(wire, list) or len(wire) < 2 or not isinstance(wire[0], int | float) \
            or not isinstance(wire[1], list):
        raise KVEventDecodeError("a batch must be [ts, [events...], (data_parallel_rank)]")
    events = tuple(e for e in (_event_from_wire(i) for i in wire[1]) if e is not None)
    rank = wire[2] if len(wire) > 2 and isinstance(wire[2], int) else None
    return KVEventBatch(float(wire[0]), events, rank)


@dataclass
class _Pending:
    """Events queued by the step loop since the last send, coalesced per kind in order."""

    events: list[KVEvent] = field(default_factory=list)


class KVEventPublisher:
    """A ``BlockEventObserver`` that publishes the engine's HBM index changes on a ZMQ PUB socket.

    The step loop only appends to a list under a lock; a daemon thread owns the socket (ZMQ
    sockets are not thread-safe) and sends one batch every ``interval_s`` while there is news.
    Consecutive stores (or removals) are merged into one event, so a prefill of a long prompt is
    one ``BlockStored`` however many blocks it filled.

    Args:
        endpoint: where to bind, e.g. ``tcp://127.0.0.1:5557`` (``tcp://127.0.0.1:*`` = any free
            port; ``endpoint`` then reads the bound one).
        block_size: the engine's tokens per block (sent in every ``BlockStored``).
        topic: the first frame of every message (vLLM's default is empty).

    Raises (from ``start``): ``RuntimeError`` with the reason when the socket cannot be bound.
    """

    def __init__(self, endpoint: str, block_size: int, *, topic: str = "", interval_s: float = 0.02) -> None:
        self._requested = endpoint
        self.block_size = block_size
        self._topic = topic.encode()
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._pending = _Pending()
        self._bound: str | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.batches_sent = 0

    @property
    def endpoint(self) -> str:
        """The bound endpoint (after ``start``)."""
        return self._bound or self._requested

    def start(self) -> KVEventPublisher:
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise RuntimeError(f"kv events: cannot bind {self._requested}: {self._error}") from self._error
        return self

    # ------------------------------------------------------------------ BlockEventObserver

    def blocks_stored(self, hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        with self._lock:
            last = self._pending.events[-1] if self._pending.events else None
            if isinstance(last, BlockStored):
                self._pending.events[-1] = BlockStored(last.block_hashes + tuple(hashes), last.parent_block_hash,
                                                       (), self.block_size, medium=MEDIUM_HBM)
            else:
                self._pending.events.append(BlockStored(tuple(hashes), parent, (), self.block_size, medium=MEDIUM_HBM))
        self._wake.set()

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            last = self._pending.events[-1] if self._pending.events else None
            if isinstance(last, BlockRemoved):
                self._pending.events[-1] = BlockRemoved(last.block_hashes + tuple(hashes), MEDIUM_HBM)
            else:
                self._pending.events.append(BlockRemoved(tuple(hashes), MEDIUM_HBM))
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)

    # ------------------------------------------------------------------ the socket's thread

    def _take(self) -> tuple[KVEvent, ...]:
        with self._lock:
            events, self._pending = tuple(self._pending.events), _Pending()
        return events

    def _run(self) -> None:
        import zmq

        ctx: zmq.SyncContext = zmq.Context.instance()
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 500)
        try:
            sock.bind(self._requested)
            self._bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        seq = 0
        try:
            while True:
                self._wake.wait()
                stopping = self._stop.is_set()
                if not stopping:
                    time.sleep(self._interval_s)  # gather a step's worth of changes into one batch
                self._wake.clear()
                events = self._take()
                if events:
                    payload = encode_batch(KVEventBatch(time.time(), events))
                    sock.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    seq += 1
                    self.batches_sent += 1
                if stopping:
                    return
        finally:
            sock.close()
