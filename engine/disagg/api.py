"""The public face of disaggregation (the gateway may import this module and nothing else of it).

Torch-free. The roles, the shared transfer key, and the typed results of the two node calls the
gateway's split router makes: ``lookup`` on the decode node, ``prefill_and_send`` on the prefill node.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine.protocol import GenerateRequest

_KEY_LABEL = b"prefixgate kv transfer key v1"


class Role(enum.StrEnum):
    """What an engine process does in a split topology (``prefixgate serve --role``)."""

    BOTH = "both"  # an ordinary engine: prefill and decode of its own requests, no KV moves
    PREFILL = "prefill"  # also runs prefills for other engines and sends their KV blocks
    DECODE = "decode"  # also listens for KV blocks from prefill engines (a receiver port)


def derive_transfer_key(node_token: str) -> bytes:
    """The HMAC-SHA256 key both engines derive from the node token they already share: one secret
    to configure, and a MAC key that is not the bearer token itself."""
    if not node_token:
        raise ValueError("a KV transfer key needs a non-empty node token")
    return hmac.new(node_token.encode(), _KEY_LABEL, hashlib.sha256).digest()


class TransferStatus(enum.StrEnum):
    IMPORTED = "imported"  # every block the sender had is now indexed on the decode engine
    PARTIAL = "partial"  # a leading part was imported; the rest is a miss (recomputed there)
    REFUSED = "refused"  # the decode engine had no room (out of KV blocks)
    REJECTED = "rejected"  # a chunk failed a check (MAC, hashes, dtype, layers, size): a miss
    FAILED = "failed"  # the connection broke or the peer was unreachable


@dataclass(frozen=True)
class TransferReport:
    """What one transfer did. ``blocks_sent`` counts blocks put on the wire, ``blocks_imported``
    those the receiver indexed (already-resident blocks are neither re-sent nor re-imported)."""

    status: TransferStatus
    blocks_sent: int = 0
    blocks_imported: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    reason: str = ""

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class HandoffReport:
    """``prefill_and_send``'s answer: the prefill side's cache hit and timings, and the transfer."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefill engine took from its own prefix cache
    prefill_s: float
    transfer: TransferReport


@dataclass(frozen=True)
class LookupResult:
    """The decode node's view of a request before the split decision (one round trip)."""

    prompt_tokens: int
    cached_tokens: int  # its HBM prefix hit for this request now
    running: int
    waiting: int
    # its KV receiver's address now ("" = none): read on every lookup, so that a node restarted on
    # another KV port (--kv-port 0 picks a fresh one) gets its very next split
    receiver: str = ""


@runtime_checkable
class KVHandoff(Protocol):
    """What a node of a split topology offers beyond ``EngineClient`` (``engine.disagg.node.DisaggEngine``).

    - ``lookup`` tokenizes the request and matches it in this engine's prefix index (no blocks
      are taken), and says where its KV receiver listens now; raises ``EngineError`` for requests
      that cannot run.
    - ``prefill_and_send`` runs the request's prompt here (reusing this engine's prefix cache),
      then sends its full prompt blocks to the receiver at ``address`` ("host:port"); it returns
      after the receiver answered or the transfer failed (never raises for a failed transfer:
      the report says so). Only on a node whose role can send (``Role.PREFILL``). Blocks
      within ``skip_tokens`` are not sent.
    - ``receiver_address`` is "host:port" of this node's KV receiver, or None.
    """

    role: Role

    async def lookup(self, request: GenerateRequest) -> LookupResult: ...

    async def prefill_and_send(self, request: GenerateRequest, address: str, skip_tokens: int = 0) -> HandoffReport:
        """``skip_tokens``: the prefix the decode node holds already (its lookup); those blocks
        are named by hash, not sent."""
        ...

    def receiver_address(self) -> str | None: ...

    async def check_integrity(self) -> str:
        """"" when the cache manager's invariants hold (no block leaked or double-held), else why not."""
        ...

    async def stats(self) -> dict[str, Any]: ...


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})  # a bind address, not one a peer can connect to


def receiver_host(address: str) -> str:
    """The host of a receiver address ``host:port[;extras]`` (IPv6 without its brackets)."""
    return address.split(";", 1)[0].rpartition(":")[0].strip("[]")


def with_receiver_host(address: str, host: str) -> str:
    """``address`` (``host:port[;extras]``) with its host replaced by ``host``; port and extras kept."""
    base, sep, extras = address.partition(";")
    port = base.rpartition(":")[2]
    host = host.strip("[]")
    return f"{f'[{host}]' if ':' in host else host}:{port}{sep}{extras}"


@dataclass(frozen=True)
class DisaggConfig:
    """How ``engine.launch.build_engine`` sets up a split-topology role.

    node_token: the shared node token; the transfer MAC key is derived from it.
    kv_host / kv_port: where a decode engine's receiver listens (port 0 = any free port).
    kv_advertise_host: the host prefill nodes connect to, advertised instead of ``kv_host`` ("" =
        ``kv_host``; when that is a wildcard, the gateway puts in the host it reaches the node at).
    blocks_per_chunk: blocks per transfer chunk (one MAC each).
    """

    role: Role
    node_token: str
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    blocks_per_chunk: int = 16
    kv_advertise_host: str = ""

    def __post_init__(self) -> None:
        if self.role is not Role.BOTH and not self.node_token:
            raise ValueError(f"role {self.role.value} needs a node token (the KV transfer key is derived from it)")
        if not 0 <= self.kv_port <= 65535 or not 1 <= self.blocks_per_chunk <= 256:
            raise ValueError("kv_port must be in [0, 65535] and blocks_per_chunk in [1, 256]")
