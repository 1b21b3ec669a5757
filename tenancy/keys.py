"""API keys and the server secret.

An API key looks like ``pg-1a2b3c4d_<43 url-safe chars>``: ``pg-1a2b3c4d`` is the visible prefix
(``1a2b3c4d`` is the key id, safe to show and log), the rest is 256 random bits shown once at
creation. Only ``HMAC-SHA256(pepper, key)`` is stored, where the pepper is derived from the server
secret (``home/server.secret``, 0600), so a stolen database alone cannot be used to test guesses.

Lookup is by key id (indexed), then the stored hash is compared in constant time
(``hmac.compare_digest``), so response time does not leak how much of a guess was right.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

from tenancy.crypto import load_or_create_secret

KEY_PREFIX = "pg-"
KEY_ID_HEX = 8
SECRET_FILENAME = "server.secret"


@dataclass(frozen=True)
class ServerSecret:
    """The 32-byte server secret and the keys derived from it (one label per use, never reused)."""

    raw: bytes

    @classmethod
    def load(cls, home: Path, *, create: bool = True) -> ServerSecret:
        """``home/server.secret``, created if absent and ``create`` (else SecretFileMissingError)."""
        raw, _ = load_or_create_secret(home / SECRET_FILENAME, what="server secret", create=create)
        return cls(raw)

    @property
    def namespace_key(self) -> bytes:
        return self.raw

    @property
    def pepper(self) -> bytes:
        return hmac.new(self.raw, b"prefixgate/api-key-pepper/v1", hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "ServerSecret(<hidden>)"


def new_api_key() -> tuple[str, str]:
    """Returns ``(key_id, api_key)``."""
    key_id = secrets.token_hex(KEY_ID_HEX // 2)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def visible_prefix(key_id: str) -> str:
    return f"{KEY_PREFIX}{key_id}"


def _is_key_id(text: str) -> bool:
    return len(text) == KEY_ID_HEX and all(c in "0123456789abcdef" for c in text)


def parse_key_id(api_key: str) -> str | None:
    """The key id inside ``api_key``, or None when it does not have our shape."""
    if not api_key.startswith(KEY_PREFIX):
        return None
    key_id, sep, rest = api_key[len(KEY_PREFIX) :].partition("_")
    if not sep or len(rest) < 32 or not _is_key_id(key_id):
        return None
    return key_id


def named_key_id(text: str) -> str | None:
    """The key id that an administrator's ``text`` names without the secret: the id itself
    (``1a2b3c4d``, what ``key list`` prints) or the visible prefix (``pg-1a2b3c4d``). None for
    anything else; a whole key is :func:`parse_key_id`'s."""
    bare = text.removeprefix(KEY_PREFIX)
    return bare if _is_key_id(bare) else None


def hash_key(pepper: bytes, api_key: str) -> bytes:
    # Not the one-shot hmac.digest: it releases the GIL around every call, so on the request path
    # (each authentication) the ledger thread takes the GIL over and the request waits (~100 us with
    # a busy thread; measured in issue #17). hmac.new keeps it for inputs under 2 KiB.
    return hmac.new(pepper, api_key.encode("utf-8"), hashlib.sha256).digest()


def verify_key(pepper: bytes, api_key: str, stored_hash: bytes) -> bool:
    return hmac.compare_digest(hash_key(pepper, api_key), stored_hash)


_SHOWN_TAIL = 4  # characters of a foreign key's end an error may show (as OpenAI's "sk-...abcd")


def redact(api_key: str) -> str:
    """What an error message (which clients log) may show of a key that did not authenticate.

    Our own key shape: its public key id (``pg-1a2b3c4d****``, what ``key list`` prints; 11 of at
    least 44 characters). Anything else (a short secret, another provider's key pasted by mistake):
    only its last 4 characters, and only when that is at most a third of it (``****abcd``), else
    nothing (``****``), so no short secret is ever echoed whole and no key's readable prefix is."""
    if not api_key:
        return "<empty>"
    if parse_key_id(api_key) is not None:
        return api_key[: len(KEY_PREFIX) + KEY_ID_HEX] + "****"
    if len(api_key) >= 3 * _SHOWN_TAIL:
        return "****" + api_key[-_SHOWN_TAIL:]
    return "****"
