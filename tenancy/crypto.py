"""Envelope encryption: one key-encryption key (KEK) wraps a data key per tenant (or share group).

::

    KEK (32 bytes: $PREFIXGATE_KEK, or the file home/kek.key, created 0600 on first run)
      └─ wraps ─► data key of tenant t (AES-256), stored wrapped in the data_keys table
                    └─ encrypts ─► KV blocks that leave HBM (TenantCipher, AES-256-GCM)

Deleting a tenant deletes its wrapped data key (with SQLite ``secure_delete`` on and the WAL
truncated), so its spilled KV can never be decrypted again, even by someone holding the database
and the KEK: crypto-shredding. Rotating the KEK re-wraps every data key; the KV blobs themselves
never change.

Blob formats (both start with a version byte so the format can evolve)::

    KV blob:          0x01 | nonce (12) | AES-256-GCM(data key, nonce, plaintext, aad) + tag (16)
    KV blob (GPU):    0x02 | 00 00 00 | nonce (12) | ChaCha20-Poly1305(device key, nonce, plaintext, aad) + tag (16)
                      device key = HMAC-SHA256(data key, "prefixgate/kv-chacha20-poly1305/v1"); the
                      three zero bytes put the ciphertext at byte 16, so a GPU reads it as aligned words
    wrapped data key: 0x01 | nonce (12) | AES-256-GCM(KEK, nonce, data key, b"prefixgate/dek/v1\\0" + owner) + tag
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
import sys
import threading
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from tenancy.errors import KeyMaterialError
from tenancy.fsutil import fsync_dir

log = logging.getLogger("tenancy.crypto")

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
BLOB_VERSION = 0x01
DEVICE_BLOB_VERSION = 0x02  # ChaCha20-Poly1305, opened on the engine's GPU (engine.tiers.device_aead)
_DEVICE_HEADER = 16  # version byte, 3 zero bytes, nonce
_DEVICE_KEY_LABEL = b"prefixgate/kv-chacha20-poly1305/v1"
_DEK_AAD = b"prefixgate/dek/v1\x00"
KEK_ENV = "PREFIXGATE_KEK"
KEK_FILE_ENV = "PREFIXGATE_KEK_FILE"


def decode_key(text: str, *, what: str) -> bytes:
    """Decode a 32-byte key written as 64 hex digits or base64 (standard or URL-safe)."""
    text = text.strip()
    raw: bytes | None = None
    if len(text) == 2 * KEY_BYTES:
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = None
    if raw is None:
        try:
            raw = base64.b64decode(text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4),
                                   validate=True)
        except (binascii.Error, ValueError):
            raise KeyMaterialError(f"{what} is neither hex nor base64") from None
    if len(raw) != KEY_BYTES:
        raise KeyMaterialError(f"{what} must decode to {KEY_BYTES} bytes, got {len(raw)}")
    return raw


def encode_key(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def write_secret_file(path: Path, raw: bytes) -> None:
    """Write ``raw`` (base64) to ``path`` atomically with mode 0600: tmp file, fsync, rename.
    A missing directory is created 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (encode_key(raw) + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)  # the umask may have narrowed it further, never widened; make it exact
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_secret_file(path: Path, *, what: str) -> bytes:
    try:
        text = path.read_text(encoding="ascii")
    except OSError as exc:
        raise KeyMaterialError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise KeyMaterialError(f"{what} {path} is not base64/hex text") from None
    return decode_key(text, what=f"{what} {path}")


class SecretFileMissingError(KeyMaterialError):
    """A secret file is absent where the database says one is already in use (``create=False``)."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"the {what} file {path} is missing")
        self.path = path
        self.what = what


def load_or_create_secret(path: Path, *, what: str, create: bool = True) -> tuple[bytes, bool]:
    """Read a 32-byte secret from ``path``; create it (random, 0600) if absent and ``create``.

    Returns ``(secret, created)``. Creation is atomic and first-wins across processes (a complete
    temp file is hard-linked into place, which fails if the name exists), so two processes starting
    on a fresh home agree on one secret. Creation warns on stderr because losing this file loses
    whatever it protects, so the operator must know it now exists and should be backed up.

    ``create=False`` (the database already records this secret's fingerprint): a missing file raises
    SecretFileMissingError and nothing is written, so restoring the backup overwrites nothing. An
    existing file that other users may read is accepted with one warning naming it and its mode.
    """
    if path.exists():
        warn_if_others_may_read(path, what=what)
        return read_secret_file(path, what=what), False
    if not create:
        raise SecretFileMissingError(path, what)
    raw = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{secrets.token_hex(4)}")
    write_secret_file(tmp, raw)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return read_secret_file(path, what=what), False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    _warn(f"created a new {what} at {path} (mode 0600); back it up: without it the data it protects is lost")
    return raw, True


_warned_loose: set[Path] = set()  # one warning per file per process (the KEK is re-read after a rotation)


def warn_if_others_may_read(path: Path, *, what: str) -> None:
    """Warn once when ``path`` grants its group or other users any access (mode & 0o077).

    A warning, not a refusal (ssh refuses): a home restored from a backup or a volume mounted with
    wide modes must still start, but the operator must know the secret is exposed."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return  # the read that follows reports it
    if not mode & 0o077 or path in _warned_loose:
        return
    _warned_loose.add(path)
    _warn(f"the {what} file {path} has mode {mode:04o}: users other than its owner may read it; "
          f"run: chmod 600 {path}")


def _warn(message: str) -> None:
    """One warning line: through logging when the host app configured it, else on stderr."""
    if log.hasHandlers():
        log.warning(message)
    else:
        print(f"prefixgate: warning: {message}", file=sys.stderr)


class KeyEncryptionKey:
    """The KEK: wraps and unwraps data keys. Immutable; rotation makes a new one."""

    def __init__(self, raw: bytes, *, source: str) -> None:
        if len(raw) != KEY_BYTES:
            raise KeyMaterialError(f"KEK must be {KEY_BYTES} bytes")
        self._aead = AESGCM(raw)
        self._fingerprint = hmac.new(raw, b"prefixgate/kek-fingerprint/v1", hashlib.sha256).hexdigest()[:16]
        self.raw = raw
        self.source = source  # "env" or the file path, for messages

    @classmethod
    def generate(cls, *, source: str) -> KeyEncryptionKey:
        return cls(secrets.token_bytes(KEY_BYTES), source=source)

    @classmethod
    def load(cls, home: Path, *, create: bool = True) -> KeyEncryptionKey:
        """$PREFIXGATE_KEK (hex/base64), else $PREFIXGATE_KEK_FILE, else home/kek.key (created if
        absent and ``create``; else SecretFileMissingError)."""
        env = os.environ.get(KEK_ENV)
        if env:
            return cls(decode_key(env, what=f"${KEK_ENV}"), source="env")
        path = kek_path(home)
        raw, _ = load_or_create_secret(path, what="key-encryption key (KEK)", create=create)
        return cls(raw, source=str(path))

    @property
    def fingerprint(self) -> str:
        """A short public id of this KEK (HMAC of a constant), stored in the db to detect a wrong KEK."""
        return self._fingerprint

    def wrap(self, data_key: bytes, owner: str) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return bytes([BLOB_VERSION]) + nonce + self._aead.encrypt(nonce, data_key, _DEK_AAD + owner.encode())

    def unwrap(self, blob: bytes, owner: str) -> bytes:
        if len(blob) != 1 + NONCE_BYTES + KEY_BYTES + TAG_BYTES or blob[0] != BLOB_VERSION:
            raise KeyMaterialError(f"wrapped data key of {owner} is malformed")
        try:
            return self._aead.decrypt(blob[1 : 1 + NONCE_BYTES], blob[1 + NONCE_BYTES :], _DEK_AAD + owner.encode())
        except InvalidTag:
            raise KeyMaterialError(
                f"the data key of {owner} does not unwrap under the KEK from {self.source}: wrong KEK?"
            ) from None


def kek_path(home: Path) -> Path:
    env = os.environ.get(KEK_FILE_ENV)
    return Path(env).expanduser() if env else home / "kek.key"


def new_data_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


class TenantCipher:
    """The engine's ``BlockCipher`` under one tenant's (or share group's) data key.

    ``encrypt`` seals with AES-256-GCM (blob version 0x01); ``encrypt_for_device`` with
    ChaCha20-Poly1305 under a key derived from the same data key (version 0x02), for KV that the
    engine's GPU decrypts (``engine.tiers.device_aead``); ``decrypt`` opens both, so the CPU stays
    the fallback and the oracle of the GPU path. Two keys rather than one: one key should serve one
    algorithm only. Deleting the data key shreds both.

    Thread-safe: the AEAD objects keep no per-call state (each call builds its own cipher context),
    and the nonce comes from ``secrets`` (a CSPRNG), so concurrent calls share nothing mutable except
    the key references, which ``destroy`` swaps under a lock.
    """

    def __init__(self, data_key: bytes, *, owner: str) -> None:
        self._aead: AESGCM | None = AESGCM(data_key)
        device_key = hmac.new(data_key, _DEVICE_KEY_LABEL, hashlib.sha256).digest()
        self._device_key: bytes | None = device_key
        self._chacha: ChaCha20Poly1305 | None = ChaCha20Poly1305(device_key)
        self._lock = threading.Lock()
        self.owner = owner

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> bytes:
        """blob = version byte | fresh 96-bit nonce | ciphertext + tag.

        After ``destroy`` (tenant deleted) it still returns a blob of the same shape, but under a
        one-time random key that is dropped at once: the engine's spill path keeps working (it is
        not written to expect an exception here) and what it stores can never be decrypted.
        """
        aead = self._aead
        if aead is None:
            aead = AESGCM(AESGCM.generate_key(bit_length=256))
        nonce = secrets.token_bytes(NONCE_BYTES)
        return bytes([BLOB_VERSION]) + nonce + aead.encrypt(nonce, bytes(plaintext), bytes(aad))

    def encrypt_for_device(self, plaintext: bytes | memoryview, aad: bytes) -> bytes:
        """blob = 0x02 | 3 zero bytes | fresh 96-bit nonce | ChaCha20-Poly1305 ciphertext + tag.
        After ``destroy``: a blob of that shape under a one-time key (as ``encrypt``)."""
        chacha = self._chacha
        if chacha is None:
            chacha = ChaCha20Poly1305(ChaCha20Poly1305.generate_key())
        nonce = secrets.token_bytes(NONCE_BYTES)
        return bytes([DEVICE_BLOB_VERSION, 0, 0, 0]) + nonce + chacha.encrypt(nonce, bytes(plaintext), bytes(aad))

    def device_key(self) -> bytes | None:
        """The 32-byte ChaCha20-Poly1305 key of ``encrypt_for_device`` blobs, for the engine's own GPU
        to open them (it goes into device memory only; never log it); None once destroyed."""
        return self._device_key

    def decrypt(self, blob: bytes | memoryview, aad: bytes) -> bytes | None:
        """The plaintext, or None for any bad blob (truncated, tampered, wrong key or aad, destroyed key)."""
        opened = self._parse(blob)
        if opened is None:
            return None
        aead, nonce, sealed = opened
        try:
            return aead.decrypt(nonce, sealed, bytes(aad))
        except (InvalidTag, ValueError, OverflowError):
            return None

    def decrypt_into(self, blob: bytes | memoryview, aad: bytes, out: memoryview) -> bool:
        """Decrypt straight into ``out`` (exactly the plaintext's length: e.g. a pinned staging
        buffer, so no plaintext copy is allocated). False for any bad blob; ``out`` then holds
        garbage the caller must not use."""
        opened = self._parse(blob)
        if opened is None:
            return False
        aead, nonce, sealed = opened
        try:
            aead.decrypt_into(nonce, sealed, bytes(aad), out)
        except (InvalidTag, ValueError, OverflowError):
            return False
        return True

    def _parse(self, blob: bytes | memoryview) -> tuple[AESGCM | ChaCha20Poly1305, bytes, memoryview] | None:
        """(AEAD, nonce, ciphertext + tag as a zero-copy view) of a well-formed blob under a live key."""
        view = memoryview(blob).cast("B")
        if len(view) < 1 + NONCE_BYTES + TAG_BYTES:
            return None
        if view[0] == BLOB_VERSION:
            aes = self._aead
            return None if aes is None else (aes, bytes(view[1 : 1 + NONCE_BYTES]), view[1 + NONCE_BYTES :])
        if view[0] == DEVICE_BLOB_VERSION and len(view) >= _DEVICE_HEADER + TAG_BYTES and bytes(view[1:4]) == b"\0\0\0":
            chacha = self._chacha
            return None if chacha is None else (chacha, bytes(view[4:_DEVICE_HEADER]), view[_DEVICE_HEADER:])
        return None

    def destroy(self) -> None:
        """Forget the key in this process (the stored copy is shredded by the service)."""
        with self._lock:
            self._aead = None
            self._chacha = None
            self._device_key = None

    @property
    def destroyed(self) -> bool:
        return self._aead is None

    def __repr__(self) -> str:  # never print key material
        return f"TenantCipher(owner={self.owner!r}, destroyed={self.destroyed})"
