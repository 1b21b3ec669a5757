"""Subscribes to engine nodes' KV events and keeps the fleet index (``gateway.fleet_index``) current.

One daemon thread, one ZMQ SUB socket per node, polled together; the same code reads a PrefixGate
node (``engine.kv_events.KVEventPublisher``) and a vLLM server started with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'``::

    frames [topic, seq, payload] ─► decode_batch ─► BlockStored   -> index.stored(node, hashes)
                                                    BlockRemoved  -> index.removed(node, hashes)
                                                    AllBlocksCleared, or a gap in seq
                                                                  -> index.drop_node(node)

A gap in a node's sequence numbers means removals may have been lost, so its entries are dropped
rather than trusted (they come back as the node stores blocks again). A payload that does not
decode is counted and skipped: one bad node never stops the others' events.

vLLM's block hashes are its own (not the tenant-salted chain the router computes), so a vLLM
node's entries are kept but match no PrefixGate chain: for such a pool ``kv_aware`` routes by load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventDecodeError, decode_batch
from gateway.fleet_index import FleetIndex
from gateway.kv_event_translation import EventTranslator

log = logging.getLogger("prefixgate.kv_events")


@dataclass(frozen=True)
class EventSource:
    """A node's label (``node:<name>``, the router's name for it) and its KV event endpoint."""

    node: str
    endpoint: str


@dataclass
class SourceStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    bad_payloads: int = 0
    last_seq: int | None = None


def require_event_libraries() -> None:
    """Raise ``RuntimeError`` naming the install command when pyzmq or msgpack is missing."""
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"KV events need pyzmq and msgpack ({exc.name} is missing): "
                           "pip install 'prefixgate[fleet]'") from None


class KVEventSubscriber:
    def __init__(self, index: FleetIndex, sources: Sequence[EventSource], *, topic: str = "",
                 poll_ms: int = 100) -> None:
        self.index = index
        self.sources = tuple(sources)
        self._topic = topic.encode()
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {s.node: SourceStats() for s in self.sources}
        # vLLM's hashes -> the router's (PrefixGate nodes' pass through): one map per node
        self.translators = {s.node: EventTranslator() for s in self.sources}

    def start(self) -> None:
        """Connect to every source and start reading (returns once the sockets are connected)."""
        if self._thread is not None or not self.sources:
            return
        require_event_libraries()
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()
        self._connected.wait(5.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def apply(self, node: str, seq: int, payload: bytes) -> None:
        """Apply one message of ``node`` to the index (the thread calls this; tests may too)."""
        stats = self.stats[node]
        translator = self.translators[node]
        if stats.last_seq is not None and seq != stats.last_seq + 1:
            stats.gaps += 1
            self.index.drop_node(node)
            translator.clear()
            log.warning("kv events from %s: sequence %d after %d; its index entries were dropped",
                        node, seq, stats.last_seq)
        stats.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            stats.bad_payloads += 1
            log.warning("kv events from %s: %s", node, exc)
            return
        stats.batches += 1
        stats.events += len(batch.events)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.index.stored(node, translator.stored(ev))
            elif isinstance(ev, BlockRemoved):
                self.index.removed(node, translator.removed(ev))
            elif isinstance(ev, AllBlocksCleared):
                self.index.drop_node(node)
                translator.clear()

    def _run(self) -> None:
        import zmq

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        poller = zmq.Poller()
        sockets: dict[zmq.Socket, str] = {}
        try:
            for src in self.sources:
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, self._topic)
                sock.connect(src.endpoint)  # ZMQ reconnects by itself when a node restarts
                poller.register(sock, zmq.POLLIN)
                sockets[sock] = src.node
            self._connected.set()
            while not self._stop.is_set():
                for sock, _ in poller.poll(self._poll_ms):
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    node = sockets[sock]
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.stats[node].bad_payloads += 1
                        continue
                    self.apply(node, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            self._connected.set()
            for sock in sockets:
                sock.close()
