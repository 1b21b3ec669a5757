"""``TenancyService``: the one object the gateway and the CLI use (the API other teams code against).

::

    gateway request ─► authenticate(key) ─► scope_for(ctx, user) ─► admit(ctx, estimated_tokens=)
                          │ (TTL cache)           │ (namespace)            │ (rpm/tpm buckets, budget)
                          ▼                       ▼                        ▼
                      TenantContext ──────── engine (TenantScope) ──── record_usage(UsageRecord)
                                                                          │ (queue, writer thread)
                                                                          ▼
                                                                 usage table (ledger) ─► report

State lives under ``home``: ``prefixgate.db`` (SQLite, WAL; or PostgreSQL with ``database_url``),
``kek.key`` (unless $PREFIXGATE_KEK) and ``server.secret`` (both 0600, created on first run with a
warning on stderr; never created for a database that already records one: a missing file is then an
error; a file others may read is accepted with a warning). The home is created 0700. With
``redis_url`` the rpm/tpm buckets, budgets and revocations are fleet-wide.

Thread-safety: every method may be called from any thread. One connection, guarded by a lock,
serves the request path (auth misses, budget refreshes, admin calls); the ledger writer has its
own connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tenancy import chat_completions, responses, store
from tenancy import keys as keymod
from tenancy.crypto import (
    KEK_ENV,
    KeyEncryptionKey,
    SecretFileMissingError,
    TenantCipher,
    encode_key,
    kek_path,
    new_data_key,
    read_secret_file,
    write_secret_file,
)
from tenancy.database import Database, DatabaseTarget, DatabaseUnavailableError, ErrorKind, resolve_database
from tenancy.errors import (
    AuthenticationError,
    ConflictError,
    InvalidSettingError,
    KeyMaterialError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    TenancyError,
)
from tenancy.fsutil import fsync_dir
from tenancy.ledger import QUARANTINE_FILENAME, LedgerStats, LedgerWriter
from tenancy.miss_privacy import apply_miss_policy, keyed_family
from tenancy.namespace import metrics_label, namespace_for, parse_share_scope, tenant_key_for
from tenancy.pricing import PriceBook
from tenancy.quota import Limiter, RateLimiter, check_budget, period_bounds
from tenancy.types import (
    ChatCompletionPage,
    ChatCompletionQuery,
    CreatedKey,
    CreatedTenant,
    FleetEvent,
    KeyInfo,
    Price,
    Quotas,
    SharedLimitsStatus,
    StoredChatCompletion,
    TenantContext,
    TenantInfo,
    UsageRecord,
)

if TYPE_CHECKING:
    from tenancy.shared_limits import SharedLimits

# The gateway imports only this module: everything it needs is re-exported here.
__all__ = [
    "AuthenticationError", "ConflictError", "CreatedKey", "CreatedTenant", "InvalidSettingError", "KeyInfo",
    "KeyMaterialError", "LedgerStats", "NotFoundError", "PermissionDeniedError", "Price", "QuotaExceededError", "Quotas",
    "DatabaseUnavailableError", "FleetStatus", "RotationResult", "SharedLimitsStatus", "TenancyError", "TenancyService", "TenantCipher", "TenantContext", "TenantInfo",
    "UsageRecord",
]

_KEK_FINGERPRINT = "kek_fingerprint"
_SECRET_FINGERPRINT = "server_secret_fingerprint"
NAMESPACE_KEY_OWNER = "system:namespace"  # data_keys owner of the namespace root key
_RECENT_IDS = 50_000
STORED_TTL_S = 30 * 86_400.0  # stored responses and chat completions: kept 30 days, as OpenAI keeps them
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(UsageRecord) if f.name != "price_as")  # price_as: not a column  # request ids remembered to keep in-memory spend idempotent like the ledger
# How long a request-path read (budget check, /v1/usage) waits for the ledger to commit this
# process's queued rows before it answers from what is committed: a slow disk must not turn into 500s.
_READ_FLUSH_S = 2.0


@dataclass(frozen=True)
class RotationResult:
    old_fingerprint: str
    new_fingerprint: str
    data_keys: int
    kek_file: str | None  # where the new KEK was written, or None when the KEK came from the env
    new_kek_b64: str | None  # only when the KEK came from $PREFIXGATE_KEK: shown once, set it yourself


@dataclass(frozen=True)
class FleetStatus:
    """``database``: "sqlite" or "postgresql". ``shared_limits``: None without ``--redis-url``."""

    database: str
    shared_limits: SharedLimitsStatus | None

    @property
    def degraded(self) -> bool:
        """Serving, but with per-process limits because Redis does not answer."""
        return self.shared_limits is not None and not self.shared_limits.connected


@dataclass
class _Spend:
    period_start: float
    total_usd: float
    loaded_at: float  # monotonic


def data_key_owner(tenant_id: str, share_scope: str) -> str:
    """Whose data key encrypts this tenant's spilled KV: its own, or its share group's (shared cache)."""
    kind, group = parse_share_scope(share_scope)
    return f"group:{group}" if kind == "group" else f"tenant:{tenant_id}"


def _deleted_owner(db: Database, owner: str) -> bool:
    """True when ``owner`` is a tenant's own data key (``tenant:<id>``) and that tenant is gone."""
    kind, _, tenant_id = owner.partition(":")
    return kind == "tenant" and store.get_tenant(db, tenant_id=tenant_id) is None


def _has_metadata(completion: dict[str, Any], wanted: Mapping[str, str]) -> bool:
    """Whether the completion's metadata holds every pair of ``wanted`` (OpenAI's list filter)."""
    metadata = completion.get("metadata") or {}
    return all(metadata.get(key) == value for key, value in wanted.items())


def _tenant_gone() -> AuthenticationError:
    """A cached key whose tenant has since been deleted: refused like an unknown key (HTTP 401)."""
    return AuthenticationError("Incorrect API key provided: its tenant has been deleted.")


class TenancyService:
    """Tenants, keys, quotas, envelope encryption and the usage ledger behind one object."""

    def __init__(
        self,
        home: Path,
        *,
        auth_cache_ttl_s: float = 5.0,
        reference_model: str | None = None,
        ledger_batch_max: int = 256,
        ledger_max_delay_s: float = 0.05,
        database_url: str | None = None,
        redis_url: str | None = None,
        stored_ttl_s: float | None = STORED_TTL_S,
    ) -> None:
        """Prefer ``TenancyService.open(home)``.

        ``stored_ttl_s``: how long a stored response or chat completion is kept (OpenAI's 30 days by
        default; None keeps them until they or their tenant are deleted). Older ones are deleted when
        the service opens and, a tenant's, by its next store write (save, delete); reads filter them out, so one is never served.

        ``database_url``: None (the SQLite file under ``home``), ``sqlite:///PATH`` or
        ``postgresql://...`` (shared by a fleet). ``redis_url``: fleet-wide rate limits, budgets and
        revocation (see ``tenancy.shared_limits``). KEK and server secret stay under ``home``: every
        gateway of a fleet needs the same two (copy ``kek.key`` and ``server.secret``, or set
        $PREFIXGATE_KEK and copy ``server.secret``); a different one fails start-up with one line.
        Raises DatabaseUnavailableError (one line) when the database cannot be reached.
        """
        self.home = Path(home)
        try:
            self.database: DatabaseTarget = resolve_database(self.home, database_url)
        except ValueError as exc:
            raise DatabaseUnavailableError(str(exc)) from None
        self.db_path = self.database.sqlite_path  # None on PostgreSQL
        self.auth_cache_ttl_s = auth_cache_ttl_s
        if stored_ttl_s is not None and not stored_ttl_s > 0:
            raise ValueError(f"stored_ttl_s must be > 0 or None, got {stored_ttl_s}")
        self.stored_ttl_s = stored_ttl_s
        self._lock = threading.RLock()
        self._db = self.database.connect()
        try:
            # The KEK first: a home whose kek.key is bad (or not this database's) fails before a
            # fresh server.secret is written next to it.
            self._kek = self._load_checked_kek()
            self._secret = self._load_server_secret()
            self._pepper = self._secret.pepper
            self._check_server_secret()
            self._purge_stored(None)
            self._namespace_key = self._load_namespace_key()
            self._miss_family_key = hmac.new(self._namespace_key, b"prefixgate/miss-family/v1", hashlib.sha256).digest()
            self._prices = PriceBook(reference_model)
            self._limiter: Limiter = RateLimiter()
            self._shared: SharedLimits | None = None
            if redis_url:  # an unreachable Redis is not fatal (local limits until it answers); a bad URL is
                from tenancy.shared_limits import SharedLimits  # redis is the optional `fleet` extra

                self._shared = SharedLimits(redis_url, fallback=self._limiter, on_change=self._on_fleet_change)
                self._limiter = self._shared
        except BaseException:
            self._db.close()
            raise
        self._auth_cache: dict[bytes, tuple[TenantContext, float]] = {}
        self._ciphers: dict[str, TenantCipher] = {}
        self._spend: dict[str, _Spend] = {}
        self._recent_ids: OrderedDict[str, None] = OrderedDict()
        self._clear_miss_data: dict[str, bool] = {}  # tenant id -> store_miss_context
        self._next_sweep = 0.0
        spill = None if self.database.sqlite_path is not None else self.home / QUARANTINE_FILENAME
        self._ledger = LedgerWriter(self.database, spill_path=spill, batch_max=ledger_batch_max,
                                    max_delay_s=ledger_max_delay_s)
        self._closed = False

    @classmethod
    def open(cls, home: Path, *, auth_cache_ttl_s: float = 5.0, **kwargs: Any) -> TenancyService:
        """Open (creating on first run) the state under ``home``: db, KEK, server secret.
        ``database_url`` / ``redis_url`` as in ``__init__``."""
        home = Path(home).expanduser()
        home.mkdir(mode=0o700, parents=True, exist_ok=True)  # secrets and the database: the owner's only
        return cls(home, auth_cache_ttl_s=auth_cache_ttl_s, **kwargs)

    def __enter__(self) -> TenancyService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- KEK -------------------------------------------------------------------------------------

    def _pending_kek_path(self) -> Path:
        return kek_path(self.home).with_name(kek_path(self.home).name + ".new")

    def _load_checked_kek(self) -> KeyEncryptionKey:
        """Load the KEK and check it against the fingerprint stored in the db, finishing or discarding
        a rotation that a crash cut short (``kek.key.new`` present).

        The pending-file check runs under the database write lock, which a rotation holds from
        before it writes ``kek.key.new`` until its commit, so this never mistakes a rotation in
        progress for a dead one.
        """
        kek = self._load_kek()
        pending = self._pending_kek_path()
        with self._lock:
            if kek.source != "env" and pending.exists():
                with self._db.transaction():
                    return self._reconcile_kek(kek, pending)
            return self._reconcile_kek(kek, None)

    def _stored_fingerprint(self, meta_key: str) -> str | None:
        with self._lock:
            return store.get_meta(self._db, meta_key)

    def _load_kek(self) -> KeyEncryptionKey:
        """The KEK. Its file is created only for a database that records no KEK yet (a first run):
        a missing ``kek.key`` next to data encrypted under one is refused, and no new file is left
        behind for the operator to overwrite when restoring the backup."""
        stored = self._stored_fingerprint(_KEK_FINGERPRINT)
        try:
            return KeyEncryptionKey.load(self.home, create=stored is None)
        except SecretFileMissingError as exc:
            raise KeyMaterialError(
                f"{exc}, but this database's data keys are wrapped by a KEK (fingerprint {stored}); restore "
                f"{exc.path.name} from a backup or set ${KEK_ENV} (no new KEK was created)") from None

    def _load_server_secret(self) -> keymod.ServerSecret:
        """The server secret; created only for a database that records none yet (as ``_load_kek``)."""
        stored = self._stored_fingerprint(_SECRET_FINGERPRINT)
        try:
            return keymod.ServerSecret.load(self.home, create=stored is None)
        except SecretFileMissingError as exc:
            raise KeyMaterialError(
                f"{exc}, but this database's API keys were made with a server secret (fingerprint {stored}); "
                f"restore {exc.path.name} from a backup or copy it from a gateway that shares this database "
                "(no new secret was created)") from None

    def _reconcile_kek(self, kek: KeyEncryptionKey, pending: Path | None) -> KeyEncryptionKey:
        store.set_meta_if_absent(self._db, _KEK_FINGERPRINT, kek.fingerprint)  # first run: adopt this KEK
        stored = store.get_meta(self._db, _KEK_FINGERPRINT)
        if stored == kek.fingerprint:
            if pending is not None and pending.exists():
                pending.unlink()  # a rotation died before its commit: the current KEK is still right
            return kek
        if pending is not None and pending.exists():
            new = KeyEncryptionKey(read_secret_file(pending, what="pending KEK"), source=str(kek_path(self.home)))
            if new.fingerprint == stored:  # a rotation committed but died before renaming the file
                self._install_pending_kek(pending, new)
                return new
        raise KeyMaterialError(
            f"the KEK from {kek.source} (fingerprint {kek.fingerprint}) is not the one this database was "
            f"encrypted with (fingerprint {stored}); restore the right KEK or set $PREFIXGATE_KEK"
        )

    def _install_pending_kek(self, pending: Path, new: KeyEncryptionKey) -> None:
        """Rename ``kek.key.new`` over ``kek.key``; tolerate another process having done it first."""
        try:
            os.replace(pending, kek_path(self.home))
        except FileNotFoundError:
            current = read_secret_file(kek_path(self.home), what="key-encryption key (KEK)")
            if KeyEncryptionKey(current, source="file").fingerprint != new.fingerprint:
                raise
        fsync_dir(kek_path(self.home).parent)

    def _check_server_secret(self) -> None:
        """Refuse a server secret other than the one this database's key hashes were made with.

        Without this, a second gateway started on a fresh ``--home`` against a shared database
        would create its own secret and reject every API key as "incorrect".
        """
        mine = hmac.new(self._secret.raw, b"prefixgate/secret-fingerprint/v1", hashlib.sha256).hexdigest()[:16]
        with self._lock:
            store.set_meta_if_absent(self._db, _SECRET_FINGERPRINT, mine)
            stored = store.get_meta(self._db, _SECRET_FINGERPRINT)
        if stored != mine:
            raise KeyMaterialError(
                f"the server secret under {self.home} (fingerprint {mine}) is not the one this database's API "
                f"keys were made with (fingerprint {stored}); copy {keymod.SECRET_FILENAME} from a gateway "
                "that shares this database"
            )

    def _load_namespace_key(self) -> bytes:
        """The key cache namespaces are derived with: the server secret combined with a random root
        key kept wrapped by the KEK (created once, shared by every process on this database).

        Why both: a namespace seeds the block hash chain, so whoever can derive one can test a
        guessed prompt against anything keyed by it (the NVMe index). With the root key under the
        KEK, a stolen ``--home`` without the KEK derives nothing. KEK rotation re-wraps the root key
        like any data key, so namespaces (and the cache) survive it.
        """
        with self._lock:
            wrapped = store.get_wrapped_key(self._db, NAMESPACE_KEY_OWNER)
            if wrapped is None:
                with self._db.transaction():
                    kek = self._kek_for_wrapping()
                    store.insert_wrapped_key_if_absent(self._db, NAMESPACE_KEY_OWNER,
                                                       kek.wrap(new_data_key(), NAMESPACE_KEY_OWNER))
                    wrapped = store.get_wrapped_key(self._db, NAMESPACE_KEY_OWNER)
                assert wrapped is not None
            root = self._kek.unwrap(wrapped, NAMESPACE_KEY_OWNER)
        return hmac.new(self._secret.namespace_key, b"prefixgate/ns-key/v2\0" + root, hashlib.sha256).digest()

    def _kek_for_wrapping(self) -> KeyEncryptionKey:
        """The KEK to wrap a new data key with; call inside a write transaction.

        Another process may have rotated the KEK since this one loaded it; wrapping under the old
        one would store a data key nobody else can unwrap, so re-read it when the fingerprint moved.
        """
        stored = store.get_meta(self._db, _KEK_FINGERPRINT)
        if stored == self._kek.fingerprint:
            return self._kek
        candidates = [self._load_kek()]
        pending = self._pending_kek_path()
        if candidates[0].source != "env" and pending.exists():  # rotation committed, file not yet renamed
            candidates.append(KeyEncryptionKey(read_secret_file(pending, what="pending KEK"),
                                               source=str(kek_path(self.home))))
        for kek in candidates:
            if kek.fingerprint == stored:
                self._kek = kek
                return kek
        raise KeyMaterialError(f"no available KEK matches this database's (fingerprint {stored})")

    def rotate_kek(self) -> RotationResult:
        """Re-wrap every data key under a fresh KEK. KV blobs stay valid (data keys do not change).

        File-held KEK: under the database write lock, the new KEK goes to ``kek.key.new``, every data
        key is re-wrapped and the new fingerprint stored, all in one transaction; then the file is
        renamed over ``kek.key``. ``open`` finishes or discards a rotation a crash cut short, and a
        concurrent rotation in another process fails cleanly (its KEK is no longer the stored one).
        Env-held KEK: the new KEK is returned once (base64) and the operator must put it in
        $PREFIXGATE_KEK before the next start.
        """
        with self._lock:
            old = self._kek
            from_env = old.source == "env"
            new = KeyEncryptionKey.generate(source="env" if from_env else str(kek_path(self.home)))
            pending = self._pending_kek_path()
            with self._db.transaction():
                stored = store.get_meta(self._db, _KEK_FINGERPRINT)
                if stored != old.fingerprint:
                    raise KeyMaterialError(
                        "the KEK was rotated by another process since this one started; run it again"
                    )
                if not from_env:
                    write_secret_file(pending, new.raw)
                wrapped = store.all_wrapped_keys(self._db)
                store.set_wrapped_keys(self._db, [(o, new.wrap(old.unwrap(w, o), o)) for o, w in wrapped])
                store.set_meta(self._db, _KEK_FINGERPRINT, new.fingerprint)
            if not from_env:
                self._install_pending_kek(pending, new)
            self._db.shred_freed_pages()
            self._kek = new
            return RotationResult(
                old.fingerprint, new.fingerprint, len(wrapped),
                None if from_env else str(kek_path(self.home)), encode_key(new.raw) if from_env else None,
            )

    def _cipher(self, owner: str) -> TenantCipher:
        """The cipher for a data-key owner, unwrapping (or creating) its data key once per process.

        A tenant's own key is made lazily too (a tenant in a share group gets it with its first stored
        response), but never for a tenant that no longer exists: ``delete_tenant`` shredded that key,
        and a key cached in this process's auth cache must not bring it back (AuthenticationError)."""
        with self._lock:
            cipher = self._ciphers.get(owner)
            if cipher is not None:
                return cipher
            wrapped = store.get_wrapped_key(self._db, owner)
            if wrapped is None:
                with self._db.transaction():  # the writer lock: a concurrent delete_tenant waits or has committed
                    if _deleted_owner(self._db, owner):
                        raise _tenant_gone()
                    kek = self._kek_for_wrapping()
                    store.insert_wrapped_key_if_absent(self._db, owner, kek.wrap(new_data_key(), owner))
                    wrapped = store.get_wrapped_key(self._db, owner)
                assert wrapped is not None
            try:
                data_key = self._kek.unwrap(wrapped, owner)
            except KeyMaterialError:
                # Another process (`prefixgate kek rotate`) may have rotated the KEK since we started.
                self._kek = self._load_checked_kek()
                data_key = self._kek.unwrap(wrapped, owner)
            cipher = self._ciphers[owner] = TenantCipher(data_key, owner=owner)
            return cipher

    # -- request path ----------------------------------------------------------------------------

    def authenticate(self, api_key: str | None) -> TenantContext:
        """The tenant behind ``api_key``; raises AuthenticationError. Cached for ``auth_cache_ttl_s``.

        A key revoked through this service stops working at once; one revoked by another process
        (the CLI) within the TTL.
        """
        if not api_key:
            raise AuthenticationError(
                "You didn't provide an API key. Pass it as 'Authorization: Bearer pg-...' "
                "(create one with `prefixgate tenant create NAME`)."
            )
        digest = keymod.hash_key(self._pepper, api_key)
        now = time.monotonic()
        hit = self._auth_cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        self._sweep_ciphers(now)
        key_id = keymod.parse_key_id(api_key)
        invalid = AuthenticationError(f"Incorrect API key provided: {keymod.redact(api_key)}.")
        if key_id is None:
            raise invalid
        with self._lock:
            found = store.key_with_tenant(self._db, key_id)
        if found is None:
            raise invalid
        row, tenant = found
        if not keymod.verify_key(self._pepper, api_key, bytes(row["key_hash"])):
            raise invalid
        if row["revoked_at"] is not None:
            raise AuthenticationError(f"API key {keymod.visible_prefix(key_id)} has been revoked.")
        ctx = self._context(tenant, key_id)
        with self._lock:  # a fleet invalidation (another thread) must not be overwritten by this fill
            if len(self._auth_cache) > 10_000:
                self._auth_cache = {d: v for d, v in self._auth_cache.items() if v[1] > now}
            self._auth_cache[digest] = (ctx, now + self.auth_cache_ttl_s)
        return ctx

    def _sweep_ciphers(self, now: float) -> None:
        """Destroy in-memory data keys whose stored key is gone (a tenant deleted by another process).

        Runs on authentication cache misses, at most once per TTL, so a running gateway stops
        decrypting a deleted tenant's spilled KV within about one TTL of the delete while traffic flows.
        """
        if now < self._next_sweep or not self._ciphers:
            return
        self._next_sweep = now + self.auth_cache_ttl_s
        with self._lock:
            stored = store.data_key_owners(self._db)
            for owner in [o for o in self._ciphers if o not in stored]:
                self._ciphers.pop(owner).destroy()

    def _context(self, t: TenantInfo, key_id: str) -> TenantContext:
        self._clear_miss_data[t.tenant_id] = t.store_miss_context
        return TenantContext(
            tenant_id=t.tenant_id,
            name=t.name,
            key_id=key_id,
            is_admin=t.is_admin,
            share_scope=t.share_scope,
            canon_mode=t.canon_mode,
            per_user_vars=t.per_user_vars,
            namespace=namespace_for(
                self._namespace_key, tenant_id=t.tenant_id, share_scope=t.share_scope, key_id=key_id, user=None
            ),
            tenant_key=tenant_key_for(self._namespace_key, t.tenant_id),
            metrics_label=metrics_label(t.name),
            cipher=self._cipher(data_key_owner(t.tenant_id, t.share_scope)),
            priority=t.priority,
            kv_block_quota=t.quotas.kv_blocks_hbm,
            kv_block_quota_dram=t.quotas.kv_blocks_dram,
            kv_block_quota_nvme=t.quotas.kv_blocks_nvme,
            ttft_target_s=t.ttft_target_s,
            quotas=t.quotas,
            cache_retention_s=t.cache_retention_s,
        )

    def scope_for(self, ctx: TenantContext, user: str | None = None) -> TenantContext:
        """``ctx`` with the namespace of its share scope for end user ``user`` (the OpenAI ``user`` field).

        Only ``share_scope == "user"`` changes the namespace; other scopes ignore ``user``. The
        ``tenant_key`` stays the tenant's: every end user's requests count against one quota and
        one fair share, however many namespaces they are cached in.
        """
        if parse_share_scope(ctx.share_scope)[0] != "user":
            return ctx
        ns = namespace_for(
            self._namespace_key, tenant_id=ctx.tenant_id, share_scope=ctx.share_scope, key_id=ctx.key_id,
            user=user,
        )
        return dataclasses.replace(ctx, namespace=ns, user=user or None)

    def admit(self, ctx: TenantContext, *, estimated_tokens: int) -> None:
        """Admit one request of about ``estimated_tokens`` (prompt + max_tokens) or raise QuotaExceededError.

        Checks the budget (this period's ledger spend) first, then consumes rpm/tpm.
        """
        if ctx.quotas.budget_usd is not None:
            now = datetime.now(UTC)
            check_budget(ctx.quotas, self._spent(ctx.tenant_id, ctx.quotas.budget_period, now), now)
        self._limiter.admit(ctx.tenant_id, ctx.quotas, estimated_tokens)

    def _spent(self, tenant_id: str, period: str, now: datetime) -> float:
        """USD spent this period: a ledger sum refreshed every TTL plus what this process recorded since,
        or, with Redis, the fleet-wide counter every gateway adds to (never below the ledger's sum)."""
        local = self._local_spent(tenant_id, period, now)
        if self._shared is None:
            return local
        return self._shared.spent(tenant_id, period, period_bounds(period, now)[0].timestamp(), floor=local)

    def _local_spent(self, tenant_id: str, period: str, now: datetime) -> float:
        start = period_bounds(period, now)[0].timestamp()
        with self._lock:
            s = self._spend.get(tenant_id)
            mono = time.monotonic()
            if s is not None and s.period_start == start and mono - s.loaded_at <= self.auth_cache_ttl_s:
                return s.total_usd
        # Our own queued rows must be in the sum. Outside the lock: other tenants' requests must not
        # wait on this tenant's refresh, and a slow ledger only makes the sum a little stale.
        self._flush_for_read()
        with self._lock:
            s = self._spend.get(tenant_id)
            if s is None or s.period_start != start or mono - s.loaded_at > self.auth_cache_ttl_s:
                s = self._spend[tenant_id] = _Spend(start, store.spent_since(self._db, tenant_id, start), mono)
            return s.total_usd

    def price(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
              cache_creation_tokens: int = 0) -> Price:
        return self._prices.price(model, prompt_tokens, cached_tokens, completion_tokens, cache_creation_tokens)

    def record_usage(self, rec: UsageRecord) -> Price:
        """Price ``rec`` and queue it for the ledger (idempotent on ``request_id``). Returns at once,
        with the price (a repeated request id's too, though its row is not queued again): the
        gateway's metrics take cost and saving from it rather than pricing the request twice.

        The ledger writer makes every field storable (bounded text, valid UTF-8); here the miss
        explanation loses its prompt text and clear family unless the tenant chose to keep them.
        """
        priced = rec.price_as or rec.model
        p = self.price(priced, rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens,
                       rec.cache_creation_tokens)
        # Not dataclasses.asdict: it deep-copies every field (~70 us here), and this runs per request.
        row = {f: getattr(rec, f) for f in _RECORD_FIELDS}
        row.update(cost_usd=p.cost_usd, saved_usd=p.saved_usd, priced_as=p.priced_as)
        if rec.miss_context is not None or rec.miss_family is not None:
            apply_miss_policy(row, store_clear=self._stores_clear_miss_data(rec.tenant_id),
                              key=self._miss_family_key)
        if rec.miss_tokens:  # what the re-prefilled tokens would have saved had they been cached
            row["miss_usd"] = self.price(priced, rec.miss_tokens, rec.miss_tokens, 0).saved_usd
        with self._lock:
            if rec.request_id in self._recent_ids:
                return p
            self._recent_ids[rec.request_id] = None
            if len(self._recent_ids) > _RECENT_IDS:
                self._recent_ids.popitem(last=False)
            s = self._spend.get(rec.tenant_id)
            if s is not None and rec.created_at >= s.period_start:
                s.total_usd += p.cost_usd
        if self._shared is not None and p.cost_usd > 0:
            self._shared.add_spend(rec.tenant_id, rec.created_at, p.cost_usd)
        self._ledger.submit(row)
        return p

    def _stores_clear_miss_data(self, tenant_id: str) -> bool:
        known = self._clear_miss_data.get(tenant_id)
        if known is None:
            info = self.get_tenant(tenant_id)
            known = self._clear_miss_data[tenant_id] = bool(info is not None and info.store_miss_context)
        return known

    def flush(self) -> None:
        """Block until every recorded usage row is committed (or quarantined, see ``tenancy.ledger``)."""
        self._ledger.flush()

    def _flush_for_read(self) -> None:
        # On a timeout, answer from what is committed; the writer keeps going and counts what it cannot store.
        with contextlib.suppress(TimeoutError):
            self._ledger.flush(timeout=_READ_FLUSH_S)

    def ledger_stats(self) -> LedgerStats:
        """Counters of the ledger writer: committed, quarantined, spilled, lost rows and retries."""
        return self._ledger.stats()

    def close(self) -> None:
        """Commit queued usage rows and close the database. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._shared is not None:
            self._shared.close()
        self._ledger.close()
        with self._lock:
            self._db.close()

    def usage(self, ctx: TenantContext, since: datetime | None = None, *, tenant: str | None = None) -> dict:
        """The usage report (``tenancy.report`` JSON shape) of ``ctx``'s own tenant; admins see all tenants
        (or the one named ``tenant``). A non-admin naming another tenant gets PermissionDeniedError."""
        if tenant is not None and not ctx.is_admin and tenant != ctx.name:
            raise PermissionDeniedError("only an admin key may read another tenant's usage")
        if not ctx.is_admin:
            tenant_ids: list[str] | None = [ctx.tenant_id]
        elif tenant is not None:
            info = self.get_tenant_by_name(tenant)
            if info is None:
                raise NotFoundError(f"no tenant named {tenant!r}")
            tenant_ids = [info.tenant_id]
        else:
            tenant_ids = None
        return self.report(tenant_ids=tenant_ids, since=since)

    def report(
        self, *, tenant_ids: list[str] | None = None, since: datetime | None = None, until: datetime | None = None
    ) -> dict:
        """Operator view (the CLI): the report over ``tenant_ids`` (None = all), after flushing the ledger."""
        from tenancy import report

        self._flush_for_read()
        with self._lock:
            return report.build_report(self._db, tenant_ids=tenant_ids, since=since, until=until)

    # -- stored responses (the Responses API) -------------------------------------------------

    def save_response(self, ctx: TenantContext, response_id: str, body: dict[str, Any]) -> None:
        """Keep ``body`` (the response and the conversation behind it) for ``ctx``'s tenant.

        The body is serialized and sealed outside the service's lock: a conversation can be
        megabytes, and the lock is the one the event loop takes on an authentication miss and a
        budget check, so another tenant's request must not wait on this one's JSON and AES.

        Raises AuthenticationError when the tenant is gone: deleted (by another process, the CLI)
        while its key was still in this process's auth cache. Its key is then as unknown as any,
        and no data key is made again for it (``_cipher`` refuses a deleted tenant's owner too)."""
        with self._lock:
            self._require_live_tenant(ctx)
            self._purge_stored(ctx.tenant_id)
            cipher = self._response_cipher(ctx)
        sealed = responses.seal(cipher, ctx.tenant_id, response_id, body)
        self._insert_for_tenant(ctx, lambda: responses.insert(self._db, ctx.tenant_id, response_id, sealed))

    def _insert_for_tenant(self, ctx: TenantContext, insert: Callable[[], None]) -> None:
        """Run ``insert`` (rows of ``ctx``'s tenant) under the lock; a tenant deleted since it was
        checked makes the INSERT's foreign key fail, which is then the deleted tenant's 401."""
        with self._lock:
            try:
                insert()
            except Exception as exc:
                if self._db.classify(exc) is ErrorKind.REFUSED and store.get_tenant(
                        self._db, tenant_id=ctx.tenant_id) is None:
                    raise _tenant_gone() from None
                raise

    def load_response(self, ctx: TenantContext, response_id: str) -> dict[str, Any] | None:
        """The stored body, or None when this tenant has no response with that id (another tenant's included).
        AuthenticationError when the tenant is gone (as ``save_response``). Opened and parsed outside
        the lock, as ``save_response`` seals."""
        with self._lock:
            self._require_live_tenant(ctx)
            cipher = self._response_cipher(ctx)
            sealed = responses.sealed_body(self._db, ctx.tenant_id, response_id, self._stored_since())
        return None if sealed is None else responses.open_body(cipher, ctx.tenant_id, response_id, sealed)

    def _require_live_tenant(self, ctx: TenantContext) -> None:
        """Refuse a context whose tenant was deleted (by another process) while its key stayed in
        this process's auth cache: its key is then as unknown as any (HTTP 401)."""
        if store.get_tenant(self._db, tenant_id=ctx.tenant_id) is None:
            raise _tenant_gone()

    def _stored_since(self) -> float:
        """The oldest creation time (epoch s) a stored item may have and still be served: the reads
        filter by it, so an expired item is never served whether or not it was deleted yet."""
        return 0.0 if self.stored_ttl_s is None else time.time() - self.stored_ttl_s

    def _purge_stored(self, tenant_id: str | None) -> None:
        """Delete the tenant's (every tenant's, for None) stored responses and chat completions older
        than ``stored_ttl_s``: two indexed DELETEs, run by the store's writes (and at open), never by
        its reads, which stay reads (a purge on every read doubled a load's time under the lock)."""
        if self.stored_ttl_s is None:
            return
        before = time.time() - self.stored_ttl_s
        responses.purge(self._db, tenant_id, before)
        chat_completions.purge(self._db, tenant_id, before)

    def _response_cipher(self, ctx: TenantContext) -> TenantCipher:
        """The tenant's own data key (not a share group's): its stored responses die with it."""
        return self._cipher(f"tenant:{ctx.tenant_id}")

    def delete_response(self, ctx: TenantContext, response_id: str) -> bool:
        """True when this tenant's response was deleted; AuthenticationError when the tenant is gone."""
        with self._lock:
            self._require_live_tenant(ctx)
            self._purge_stored(ctx.tenant_id)
            return responses.delete(self._db, ctx.tenant_id, response_id)

    # -- stored chat completions (store: true on /v1/chat/completions) -------------------------
    # The same store, lock discipline and key as the stored responses above: SQL under the lock,
    # JSON and AES outside it, the tenant's own data key, a deleted tenant refused (401).

    def save_chat_completion(self, ctx: TenantContext, stored: StoredChatCompletion) -> None:
        """Keep ``stored`` for ``ctx``'s tenant (a re-save of its own id replaces it).
        AuthenticationError when the tenant is gone, as ``save_response``."""
        with self._lock:
            self._require_live_tenant(ctx)
            self._purge_stored(ctx.tenant_id)
            cipher = self._response_cipher(ctx)
        cid = stored.completion_id
        head = chat_completions.seal(cipher, "head", ctx.tenant_id, cid, stored.completion)
        messages = chat_completions.seal(cipher, "messages", ctx.tenant_id, cid, stored.messages)
        self._insert_for_tenant(
            ctx, lambda: chat_completions.insert(self._db, ctx.tenant_id, cid, stored.model, head, messages))

    def load_chat_completion(self, ctx: TenantContext, completion_id: str) -> dict[str, Any] | None:
        """The stored ``chat.completion`` object, or None when this tenant has none with that id
        (another tenant's included)."""
        with self._lock:
            self._require_live_tenant(ctx)
            cipher = self._response_cipher(ctx)
            sealed = chat_completions.sealed_part(self._db, "head", ctx.tenant_id, completion_id, self._stored_since())
        if sealed is None:
            return None
        completion: dict[str, Any] | None = chat_completions.open_part(cipher, "head", ctx.tenant_id,
                                                                       completion_id, sealed)
        return completion

    def chat_completion_messages(self, ctx: TenantContext, completion_id: str) -> list[dict[str, Any]] | None:
        """The stored input messages of this tenant's completion ``completion_id``, or None."""
        with self._lock:
            self._require_live_tenant(ctx)
            cipher = self._response_cipher(ctx)
            sealed = chat_completions.sealed_part(self._db, "messages", ctx.tenant_id, completion_id,
                                                  self._stored_since())
        if sealed is None:
            return None
        messages: list[dict[str, Any]] | None = chat_completions.open_part(cipher, "messages", ctx.tenant_id,
                                                                           completion_id, sealed)
        return messages

    def list_chat_completions(self, ctx: TenantContext, query: ChatCompletionQuery) -> ChatCompletionPage | None:
        """One page of this tenant's stored completions; None when ``query.after`` names none of them.

        ``model`` is filtered in SQL; the metadata filter needs each head opened, so rows are read
        in batches of one page (under the lock) and opened outside it until the page is full: with
        no metadata filter, one batch. A head that fails its tag is skipped (never served)."""
        with self._lock:
            self._require_live_tenant(ctx)
            cipher = self._response_cipher(ctx)
            since = self._stored_since()
            cursor = None
            if query.after is not None:
                cursor = chat_completions.cursor_of(self._db, ctx.tenant_id, query.after, since)
                if cursor is None:
                    return None
        wanted = query.limit + 1  # one more than the page: whether there is a next one
        found: list[dict[str, Any]] = []
        while len(found) < wanted:
            with self._lock:
                batch = chat_completions.heads_after(self._db, ctx.tenant_id, after=cursor, order=query.order,
                                                     model=query.model, limit=wanted, since=since)
            for row in batch:
                completion = chat_completions.open_part(cipher, "head", ctx.tenant_id, row.completion_id, row.head)
                if completion is not None and _has_metadata(completion, query.metadata):
                    found.append(completion)
            if len(batch) < wanted:
                break
            cursor = batch[-1].cursor
        return ChatCompletionPage(found[:query.limit], has_more=len(found) > query.limit)

    def update_chat_completion_metadata(self, ctx: TenantContext, completion_id: str,
                                        metadata: dict[str, str]) -> dict[str, Any] | None:
        """Replace the stored completion's ``metadata`` (nothing else changes); the updated object,
        or None when this tenant has no such completion. Two updates at once: the later write wins."""
        completion = self.load_chat_completion(ctx, completion_id)
        if completion is None:
            return None
        completion = {**completion, "metadata": metadata}
        with self._lock:
            cipher = self._response_cipher(ctx)
        head = chat_completions.seal(cipher, "head", ctx.tenant_id, completion_id, completion)
        with self._lock:
            self._require_live_tenant(ctx)
            if not chat_completions.replace_head(self._db, ctx.tenant_id, completion_id, head):
                return None  # deleted since it was read
        return completion

    def delete_chat_completion(self, ctx: TenantContext, completion_id: str) -> bool:
        """True when this tenant's stored completion was deleted; AuthenticationError when the tenant is gone."""
        with self._lock:
            self._require_live_tenant(ctx)
            self._purge_stored(ctx.tenant_id)
            return chat_completions.delete(self._db, ctx.tenant_id, completion_id)

    # -- administration ------------------------------------------------------------------------

    def create_tenant(self, name: str, *, admin: bool = False, **settings: Any) -> CreatedTenant:
        """Create a tenant, its data key and a first API key (returned once, never stored in clear).

        ``settings``: share_scope ("tenant" | "user" | "group:NAME"), canon_mode ("off" | "safe" |
        "reorder"), per_user_vars, priority, ttft_target_s, rpm, tpm, budget_usd, budget_period,
        kv_blocks (= kv_blocks_hbm), kv_blocks_dram, kv_blocks_nvme, cache_retention_s, store_miss_context
        (keep prompt text and clear family names of cache-miss explanations in the ledger; default False).
        """
        key_id, api_key = keymod.new_api_key()
        with self._lock, self._db.transaction():
            tenant_id = store.insert_tenant(self._db, name, is_admin=admin, settings=settings)
            store.insert_key(self._db, tenant_id, key_id, keymod.hash_key(self._pepper, api_key))
            share_scope = settings.get("share_scope", "tenant")
            owner = data_key_owner(tenant_id, share_scope)
            kek = self._kek_for_wrapping()
            store.insert_wrapped_key_if_absent(self._db, owner, kek.wrap(new_data_key(), owner))
        return CreatedTenant(tenant_id=tenant_id, name=name, api_key=api_key, key_id=key_id)

    def get_tenant_by_name(self, name: str) -> TenantInfo | None:
        with self._lock:
            return store.get_tenant(self._db, name=name)

    def get_tenant(self, tenant_id: str) -> TenantInfo | None:
        with self._lock:
            return store.get_tenant(self._db, tenant_id=tenant_id)

    def list_tenants(self) -> list[TenantInfo]:
        with self._lock:
            return store.list_tenants(self._db)

    def _require(self, name: str) -> TenantInfo:
        info = self.get_tenant_by_name(name)
        if info is None:
            raise NotFoundError(f"no tenant named {name!r} (see `prefixgate tenant list`)")
        return info

    def update_tenant(self, name: str, **settings: Any) -> TenantInfo:
        """Change settings/quotas. Other processes see it within their auth cache TTL."""
        info = self._require(name)
        with self._lock:
            store.update_tenant(self._db, info.tenant_id, settings)
            self._forget_tenant(info.tenant_id)
        self._publish(FleetEvent.UPDATED, info.tenant_id)
        return self._require(name)

    def delete_tenant(self, name: str) -> TenantInfo:
        """Delete the tenant and its keys and shred its data key: KV it spilled can never be decrypted again.

        Its ledger rows are kept (billing history), scrubbed of the prompt text and clear families of
        cache-miss explanations it chose to keep (``store.scrub_miss_data``). Share-group data keys survive.
        """
        info = self._require(name)
        owner = f"tenant:{info.tenant_id}"
        self._flush_for_read()  # its queued usage rows first: they are scrubbed with the rest
        with self._lock:
            store.delete_tenant(self._db, info.tenant_id, owner,
                                lambda family: keyed_family(self._miss_family_key, info.tenant_id, family))
            # secure_delete zeroed the row in the new page version; truncating the WAL drops old ones.
            self._db.shred_freed_pages()
            cipher = self._ciphers.pop(owner, None)
            if cipher is not None:
                cipher.destroy()
            self._forget_tenant(info.tenant_id)
        self._publish(FleetEvent.DELETED, info.tenant_id)
        return info

    def create_key(self, name: str) -> CreatedKey:
        info = self._require(name)
        key_id, api_key = keymod.new_api_key()
        with self._lock:
            store.insert_key(self._db, info.tenant_id, key_id, keymod.hash_key(self._pepper, api_key))
        return CreatedKey(info.tenant_id, key_id, api_key, keymod.visible_prefix(key_id))

    def list_keys(self, name: str | None = None) -> list[KeyInfo]:
        tenant_id = self._require(name).tenant_id if name is not None else None
        with self._lock:
            return store.list_keys(self._db, tenant_id)

    def revoke_key(self, key: str) -> str:
        """Revoke the API key that ``key`` names, at once in this process; other processes stop
        accepting it within their TTL. Returns its key id.

        ``key`` is the key id, its visible prefix ``pg-<id>``, or the whole API key (an admin pastes
        the key that leaked). A whole key must be that key: one whose secret does not match is no key
        at all, and revoking the key whose id it carries would cut off the wrong client.

        Raises:
            NotFoundError: no such key, or ``key`` names none. The message shows at most the key id,
                never a secret (errors end up in shell history and CI logs).
        """
        key_id = keymod.parse_key_id(key)
        if key_id is not None:
            self._require_secret(key_id, key)
        else:
            key_id = keymod.named_key_id(key)
        if key_id is None:
            raise NotFoundError("not an API key id: pass the key id `prefixgate key list` prints (8 hex "
                                "characters), its pg-<id> prefix or the whole API key")
        with self._lock:
            tenant_id = store.revoke_key(self._db, key_id)
            self._forget_tenant(tenant_id)
        self._publish(FleetEvent.REVOKED, tenant_id)
        return key_id

    def _require_secret(self, key_id: str, api_key: str) -> None:
        """Refuse a whole key whose secret is not the stored one (an unknown id is the store's error)."""
        with self._lock:
            found = store.key_with_tenant(self._db, key_id)
        if found is not None and not keymod.verify_key(self._pepper, api_key, bytes(found[0]["key_hash"])):
            raise NotFoundError(f"the key given is not API key {keymod.visible_prefix(key_id)}: its secret does "
                                f"not match, so nothing was revoked (to revoke that key anyway, pass its id {key_id})")

    def _forget_tenant(self, tenant_id: str) -> None:
        with self._lock:
            self._auth_cache = {d: v for d, v in self._auth_cache.items() if v[0].tenant_id != tenant_id}
            self._spend.pop(tenant_id, None)
            self._clear_miss_data.pop(tenant_id, None)

    # -- fleet -----------------------------------------------------------------------------------

    def _publish(self, event: FleetEvent, tenant_id: str) -> None:
        """Tell the other gateways (Redis pub/sub) so they drop cached keys at once, not after their TTL."""
        if self._shared is not None:
            self._shared.publish(event, tenant_id)

    def _on_fleet_change(self, event: FleetEvent, tenant_id: str | None) -> None:
        """Another gateway revoked, deleted or changed ``tenant_id`` (None: messages may have been
        missed while Redis was away, so forget every cached key)."""
        if tenant_id is None:
            with self._lock:
                self._auth_cache = {}
                self._spend.clear()
                self._clear_miss_data.clear()
                self._next_sweep = 0.0
            return
        self._forget_tenant(tenant_id)
        if event is FleetEvent.DELETED:
            with self._lock:
                cipher = self._ciphers.pop(f"tenant:{tenant_id}", None)
            if cipher is not None:
                cipher.destroy()

    def fleet_status(self) -> FleetStatus:
        """Which database and which limits this process uses, and whether Redis answers (``/health``)."""
        shared = self._shared.status() if self._shared is not None else None
        return FleetStatus(database=self.database.kind, shared_limits=shared)
