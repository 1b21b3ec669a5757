"""``KVReceiver``: the decode engine's listener for KV transfers (a thread per connection).

    prefill engine ── chunk frames ──► receiver thread: read, authenticate, check (wire.ChainChecker)
                                          │ verified chunk
                                          ▼
                                       importer(chunk) -> Future   (runs on the engine thread,
                                          │                         between two steps: allocate,
                                          ▼                         write the bytes, index)
                   ◄──── ack frame ─── after the last chunk's import (or at the first bad chunk)

Receiving and checking overlap the engine's running steps; only the import (a memcpy into the
blocks plus indexing) takes engine-thread time. A chunk that fails any check ends the transfer:
the chunks before it stay imported (they are a verified prefix of the chain), the rest is a miss
the decode engine recomputes. A peer that vanishes mid-transfer leaves exactly that state too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from engine.disagg.api import TransferStatus
from engine.disagg.metrics import TransferMetrics
from engine.disagg.transport import SocketSource, send_all
from engine.disagg.wire import (
    NONCE_BYTES,
    ChainChecker,
    Chunk,
    EngineLayout,
    FrameKind,
    FramePrefix,
    WireError,
    encode_frame,
    hello,
    read_body,
    read_prefix,
)
from engine.kv_types import BlockHash

log = logging.getLogger(__name__)
MAX_BLOCKS_PER_CHUNK = 256  # the most blocks one chunk may carry (DisaggConfig.blocks_per_chunk <= this)


@dataclass(frozen=True)
class ImportOutcome:
    """What importing one chunk did: ``resident`` of its blocks are now indexed (``imported`` of
    them newly); ``refused`` says why the rest could not be (out of blocks), else ""."""

    resident: int
    imported: int
    refused: str = ""


class SharedLanding(Protocol):
    """One connection's way to the bytes of shared chunks (``Chunk.shared``: they stay in the
    sender's buffer). ``engine.disagg.shared_transport.TensorLanding`` is the implementation."""

    def land(self, chunk: Chunk) -> Chunk:
        """The chunk with its bytes copied into this engine's memory as ``payload``, after checking
        their keyed digest; raises ``WireError`` (a miss) if the buffer cannot be opened or differs."""
        ...

    def close(self) -> None:
        """After the last import of the connection: drop every mapping of the sender's buffers."""
        ...


# importer(chunk, chain): chain = every verified hash of the transfer from block 0 through this chunk
Importer = Callable[[Chunk, tuple[BlockHash, ...]], "Future[ImportOutcome]"]


class KVReceiver:
    """Listens on ``host:port`` (0 = any free port; see ``address``) until ``close``.

    A connection holds none of the ``max_connections`` transfer slots, and makes this process
    allocate nothing of what it declares, until its first frame's prefix is authenticated
    (``wire.read_prefix``: the node token's key and this connection's nonce); it must get there
    within ``auth_timeout_s``. At most ``max_pending`` connections wait to authenticate: one more
    closes the oldest of them, so idle or junk connections cannot keep a sender out (a sender
    authenticates within one round trip of connecting). Each frame after that must arrive whole
    within ``frame_timeout_s``, however its bytes are paced."""

    def __init__(self, host: str, port: int, key: bytes, layout: EngineLayout, importer: Importer,
                 metrics: TransferMetrics, *, max_blocks_per_chunk: int = MAX_BLOCKS_PER_CHUNK,
                 max_connections: int = 16, max_pending: int = 64, auth_timeout_s: float = 5.0,
                 frame_timeout_s: float = 60.0, landing: Callable[[], SharedLanding] | None = None) -> None:
        self.key, self.layout, self.importer, self.metrics = key, layout, importer, metrics
        self.landing = landing  # None: shared chunks are refused (socket bytes only)
        # What one authenticated frame may make this process allocate (one chunk per connection).
        self.max_chunk_bytes = max_blocks_per_chunk * layout.block_bytes
        self._slots = threading.BoundedSemaphore(max_connections)
        self.auth_timeout_s, self.frame_timeout_s = auth_timeout_s, frame_timeout_s
        self._pending = _PendingConnections(max_pending)
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._closing = False
        self._thread = threading.Thread(target=self._accept_loop, name="prefixgate-kv-receiver", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept (Linux)
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(5)

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._pending.add(conn):
                self.metrics.failures.labels("receive", "evicted_unauthenticated").inc()
            threading.Thread(target=self._serve, args=(conn,), name="prefixgate-kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            first = self._authenticate(conn)
            if first is None:
                return
            nonce, prefix = first
            if not self._slots.acquire(blocking=False):
                self.metrics.failures.labels("receive", "too_many_connections").inc()
                return
            try:
                self._serve_one(conn, nonce, prefix)
            finally:
                self._slots.release()

    def _authenticate(self, conn: socket.socket) -> tuple[bytes, FramePrefix] | None:
        """Send the hello, then read the first frame's prefix (50 bytes) within ``auth_timeout_s``
        and check its MAC. None: the peer is gone, too slow, or has not the key (a rejection it
        can read is sent where it spoke the protocol)."""
        nonce = os.urandom(NONCE_BYTES)
        source = SocketSource(conn, deadline=time.monotonic() + self.auth_timeout_s)
        try:
            conn.settimeout(self.auth_timeout_s)
            conn.sendall(hello(nonce))
            return nonce, read_prefix(source, self.key, nonce, self.max_chunk_bytes)
        except WireError as exc:
            self.metrics.failures.labels("receive", exc.reason).inc()
            log.warning("KV connection refused before its first chunk (%s)", exc)
            self._answer(conn, nonce, {"status": TransferStatus.REJECTED.value, "blocks_imported": 0,
                                       "reason": exc.reason}, source, drain_s=self.auth_timeout_s)
        except TimeoutError:
            self.metrics.failures.labels("receive", "auth_timeout").inc()
        except (EOFError, OSError):
            self.metrics.failures.labels("receive", "peer_gone").inc()
        finally:
            self._pending.discard(conn)
        return None

    def _serve_one(self, conn: socket.socket, nonce: bytes, prefix: FramePrefix) -> None:
        source = SocketSource(conn)
        status, reason, imported = self._receive(source, nonce, prefix)
        self.metrics.transfers.labels("receive", status.value).inc()
        if status is TransferStatus.FAILED:
            return  # the peer is gone: nobody to answer
        self._answer(conn, nonce, {"status": status.value, "blocks_imported": imported, "reason": reason}, source,
                     drain_s=self.frame_timeout_s)

    def _answer(self, conn: socket.socket, nonce: bytes, ack: dict[str, Any], source: SocketSource, *,
                drain_s: float) -> None:
        """Send the ack; after a rejection, read away what the sender may still be writing (until
        it closes, at most ``drain_s``), so that closing here sends no reset that would destroy
        the ack in its buffer."""
        with contextlib.suppress(OSError):
            conn.settimeout(self.frame_timeout_s)
            send_all(conn, encode_frame(self.key, nonce, FrameKind.ACK, ack))
            if ack["status"] != TransferStatus.REJECTED.value:
                return
            conn.shutdown(socket.SHUT_WR)
            source.deadline = time.monotonic() + drain_s
            with contextlib.suppress(EOFError):
                while True:
                    source.read_exactly(1 << 16)

    def _receive(self, source: SocketSource, nonce: bytes, prefix: FramePrefix) -> tuple[TransferStatus, str, int]:
        checker = ChainChecker(self.layout)
        pending: list[Future[ImportOutcome]] = []
        bad: WireError | None = None
        landing: SharedLanding | None = None
        next_prefix: FramePrefix | None = prefix
        try:
            while True:
                source.deadline = time.monotonic() + self.frame_timeout_s  # the whole frame, however paced
                if next_prefix is None:
                    next_prefix = read_prefix(source, self.key, nonce, self.max_chunk_bytes)
                kind, header, payload = read_body(source, self.key, nonce, next_prefix)
                next_prefix = None
                if kind is not FrameKind.CHUNK:
                    raise WireError("bad_frame", "expected a chunk")
                chunk = checker.check(header, payload)
                if chunk.shared is not None:
                    if self.landing is None:
                        raise WireError("shared_unsupported", "this receiver takes the bytes over the socket only")
                    landing = landing or self.landing()
                    chunk = landing.land(chunk)
                self.metrics.bytes.labels("receive").inc(chunk.shared.nbytes if chunk.shared else len(payload))
                pending.append(self.importer(chunk, tuple(checker.chain)))
                if chunk.last:
                    break
        except WireError as exc:
            bad = exc
            self.metrics.failures.labels("receive", exc.reason).inc()
            log.warning("KV transfer chunk rejected (%s); the rest is recomputed", exc)
        except (EOFError, OSError) as exc:
            reason = "timeout" if isinstance(exc, TimeoutError) else "peer_gone"
            self.metrics.failures.labels("receive", reason).inc()
            log.warning("KV transfer broken (%r); what arrived verified stays, the rest is recomputed", exc)
            _wait(pending, landing)
            return TransferStatus.FAILED, reason, 0
        outcomes = _wait(pending, landing)
        imported = sum(o.imported for o in outcomes)
        self.metrics.blocks.labels("receive").inc(imported)
        refused = next((o.refused for o in outcomes if o.refused), "")
        if bad is not None:
            return TransferStatus.REJECTED, bad.reason, imported
        if refused:
            partial = any(o.resident for o in outcomes)
            return (TransferStatus.PARTIAL if partial else TransferStatus.REFUSED), refused, imported
        return TransferStatus.IMPORTED, "", imported


class _PendingConnections:
    """Connections accepted but not yet authenticated, oldest first; beyond ``limit`` the oldest is
    shut down (its thread's read fails at once and the thread ends)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._conns: OrderedDict[socket.socket, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, conn: socket.socket) -> bool:
        """Track ``conn``; True when that evicted the oldest one."""
        with self._lock:
            self._conns[conn] = None
            if len(self._conns) <= self.limit:
                return False
            oldest, _ = self._conns.popitem(last=False)
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)
        return True

    def discard(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.pop(conn, None)


def _wait(pending: list[Future[ImportOutcome]], landing: SharedLanding | None) -> list[ImportOutcome]:
    out = []
    for f in pending:
        try:
            out.append(f.result(timeout=120))
        except Exception as exc:  # noqa: BLE001 - an import that failed is a miss, never data
            log.warning("KV import failed: %r", exc)
            out.append(ImportOutcome(0, 0, "import_error"))
    if landing is not None:
        try:
            landing.close()
        except Exception as exc:  # noqa: BLE001 - the imports are done; a failed unmap loses nothing
            log.warning("closing a shared KV buffer failed: %r", exc)
    return out
