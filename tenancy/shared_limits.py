"""Fleet-wide rate limits, budgets and revocation on Redis (``--redis-url``).

::

    gateway A ─┐  EVALSHA token_bucket(rpm key, tpm key)   one atomic script per admission: the
    gateway B ─┼─────────────────────────────────────────► fleet admits together what one gateway would
    gateway C ─┘  INCRBYFLOAT spend:{tenant}:{period}       every recorded cost, read back by admit()
                  PUBLISH prefixgate:tenancy {event}  ───► every gateway drops that tenant's cached keys

The buckets are the ones ``tenancy.quota`` keeps in process (capacity = the per-minute limit,
refilled at limit/60 per second), stored as Redis hashes and updated by a Lua script that reads
the server's clock (``TIME``), so gateways with skewed clocks share one bucket correctly. An idle
bucket expires after two minutes: by then it would be full again anyway.

Redis away: admission falls back to the local buckets (the limit then holds per gateway, as it did
before Redis), ``status()`` says so (``/health``, the ``prefixgate_redis_up`` gauge), and Redis is
tried again after ``retry_s`` (1 s), doubling up to ``max_retry_s`` (8 s) while it stays away, so a
dead server costs one bounded attempt (``socket_timeout_s``, 0.2 s) per interval, not one per request. Revocation falls back to the auth-cache TTL; after a reconnection every cached key
is dropped, since messages sent meanwhile were lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

import redis

from tenancy.database import redact_url
from tenancy.errors import InvalidSettingError
from tenancy.quota import Limiter, period_bounds, rate_error
from tenancy.types import FleetEvent, Quotas, SharedLimitsStatus

log = logging.getLogger("tenancy.shared_limits")
_T = TypeVar("_T")

CHANNEL = "prefixgate:tenancy"
_PREFIX = "prefixgate:"

# KEYS: rpm bucket, tpm bucket. ARGV: rpm limit, tpm limit (0 = none), tokens wanted.
# Returns {0, "0"} admitted (both consumed), {1, wait} no request slot, {2, wait} not enough tokens,
# {3, "0"} more tokens than the bucket ever holds. Nothing is consumed unless every check passes.
_TOKEN_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, limit)
  local v = redis.call('HMGET', key, 'level', 'ts', 'cap')
  local lvl, ts, cap = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if lvl == nil or ts == nil or cap ~= limit then return limit end
  return math.min(limit, lvl + math.max(0, now - ts) * limit / 60)
end
local rpm, tpm, need = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r, k
if rpm > 0 then
  r = level(KEYS[1], rpm)
  if r < 1 then return {1, tostring((1 - r) * 60 / rpm)} end
end
if tpm > 0 then
  if need > tpm then return {3, '0'} end
  k = level(KEYS[2], tpm)
  if k < need then return {2, tostring((need - k) * 60 / tpm)} end
end
if rpm > 0 then
  redis.call('HSET', KEYS[1], 'level', tostring(r - 1), 'ts', tostring(now), 'cap', tostring(rpm))
  redis.call('EXPIRE', KEYS[1], 120)
end
if tpm > 0 then
  redis.call('HSET', KEYS[2], 'level', tostring(k - need), 'ts', tostring(now), 'cap', tostring(tpm))
  redis.call('EXPIRE', KEYS[2], 120)
end
return {0, '0'}
"""

# KEYS: spend counter. ARGV: floor (this gateway's ledger view), ttl. The counter never reads below
# the ledger: after a Redis restart it starts again from what the ledger already holds.
_SPEND_AT_LEAST = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if cur < floor then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  cur = floor
end
return tostring(cur)
"""
_SPEND_TTL_S = 32 * 86400  # longer than a month: a period's counter outlives the period


class SharedLimits:
    """A ``tenancy.quota.Limiter`` on Redis, falling back to ``fallback`` while Redis is away.

    ``on_change(event, tenant_id)`` runs on the subscriber thread for every message from another
    process, and with ``tenant_id=None`` after a reconnection (messages may have been missed).
    """

    def __init__(self, url: str, *, fallback: Limiter,
                 on_change: Callable[[FleetEvent, str | None], None],
                 retry_s: float = 1.0, max_retry_s: float = 8.0, socket_timeout_s: float = 0.2) -> None:
        try:
            self._redis = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                               socket_connect_timeout=socket_timeout_s, decode_responses=True)
        except ValueError as exc:
            raise InvalidSettingError(f"--redis-url {redact_url(url)!r}: {exc}") from None
        self._url = redact_url(url)
        self._fallback = fallback
        self._on_change = on_change
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._backoff_s = retry_s  # doubles while Redis stays away: a black-holed server costs less and less
        self._bucket = self._redis.register_script(_TOKEN_BUCKET)
        self._spend_at_least = self._redis.register_script(_SPEND_AT_LEAST)
        self._origin = secrets.token_hex(8)  # this process's own messages need no handling
        self._lock = threading.Lock()
        self._connected = True
        self._retry_at = 0.0
        self._fallbacks = 0
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._call(self._redis.ping)  # says at start whether Redis answers; never fatal
        self._listener = threading.Thread(target=self._listen, name="prefixgate-redis-sub", daemon=True)
        self._listener.start()

    # -- health ----------------------------------------------------------------------------------

    def status(self) -> SharedLimitsStatus:
        with self._lock:
            return SharedLimitsStatus(self._url, self._connected, self._fallbacks, self._last_error)

    def _usable(self) -> bool:
        with self._lock:
            return self._connected or time.monotonic() >= self._retry_at

    def _up(self) -> None:
        with self._lock:
            if not self._connected:
                log.warning("Redis at %s answers again: rate limits and budgets are fleet-wide again", self._url)
            self._connected = True
            self._backoff_s = self._retry_s

    def _down(self, exc: BaseException) -> None:
        with self._lock:
            if self._connected:
                log.error("Redis at %s does not answer (%s): using this gateway's local limits", self._url, exc)
            self._connected = False
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._max_retry_s, self._backoff_s * 2)
            self._last_error = f"{type(exc).__name__}: {exc}"

    def _call(self, fn: Callable[[], _T]) -> _T | None:
        """``fn()`` against Redis, or None (and the state marked down) when Redis does not answer."""
        if not self._usable():
            return None
        try:
            result = fn()
        except redis.RedisError as exc:
            self._down(exc)
            return None
        self._up()
        return result

    # -- limits ----------------------------------------------------------------------------------

    def admit(self, tenant_id: str, quotas: Quotas, estimated_tokens: int) -> None:
        if estimated_tokens < 0:
            raise ValueError("estimated_tokens must be >= 0")
        if quotas.rpm is None and quotas.tpm is None:
            return
        # A hash tag ({tenant}) keeps both buckets of a tenant in one Redis Cluster slot.
        keys = [f"{_PREFIX}rl:{{{tenant_id}}}:rpm", f"{_PREFIX}rl:{{{tenant_id}}}:tpm"]
        args = [quotas.rpm or 0, quotas.tpm or 0, estimated_tokens]
        answer = self._call(lambda: self._bucket(keys=keys, args=args))
        if answer is None:
            with self._lock:
                self._fallbacks += 1
            self._fallback.admit(tenant_id, quotas, estimated_tokens)
            return
        code, wait = int(answer[0]), float(answer[1])
        if code == 1:
            raise rate_error(quotas, estimated_tokens, "rpm", wait)
        if code == 2:
            raise rate_error(quotas, estimated_tokens, "tpm", wait)
        if code == 3:
            raise rate_error(quotas, estimated_tokens, "tpm", None)

    def add_spend(self, tenant_id: str, created_at: float, cost_usd: float) -> None:
        """Add one request's cost to the tenant's day and month counters (skipped while Redis is away)."""
        when = datetime.fromtimestamp(created_at, UTC)

        def incr() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for period in ("day", "month"):
                key = self._spend_key(tenant_id, period, period_bounds(period, when)[0].timestamp())
                pipe.incrbyfloat(key, cost_usd)
                pipe.expire(key, _SPEND_TTL_S)
            pipe.execute()

        self._call(incr)

    def spent(self, tenant_id: str, period: str, period_start: float, *, floor: float) -> float:
        """The fleet's spend of ``tenant_id`` this period, never below ``floor``; ``floor`` without Redis."""
        key = self._spend_key(tenant_id, period, period_start)
        answer = self._call(lambda: self._spend_at_least(keys=[key], args=[repr(float(floor)), _SPEND_TTL_S]))
        return floor if answer is None else max(floor, float(answer))

    @staticmethod
    def _spend_key(tenant_id: str, period: str, period_start: float) -> str:
        return f"{_PREFIX}spend:{{{tenant_id}}}:{period}:{int(period_start)}"

    # -- revocation broadcast --------------------------------------------------------------------

    def publish(self, event: FleetEvent, tenant_id: str) -> None:
        """Best effort: a gateway that misses it still drops the key within its auth-cache TTL."""
        message = json.dumps({"event": event.value, "tenant_id": tenant_id, "origin": self._origin})
        self._call(lambda: self._redis.publish(CHANNEL, message))

    def _listen(self) -> None:
        missed = False
        while not self._stop.is_set():
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CHANNEL)
                self._up()  # Redis answers: admissions need not wait out their backoff
                if missed:
                    self._on_change(FleetEvent.UPDATED, None)
                    missed = False
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None:
                        self._handle(message.get("data"))
            except redis.RedisError as exc:
                missed = True
                self._down(exc)
                self._stop.wait(self._retry_s)
            except Exception:  # a bad callback must not end revocation for the process
                log.exception("fleet event handling failed")
                missed = True
                self._stop.wait(self._retry_s)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()

    def _handle(self, data: object) -> None:
        try:
            item = json.loads(data) if isinstance(data, str) else None
            if not isinstance(item, dict):
                raise TypeError("not a JSON object")
            event = FleetEvent(item["event"])
            tenant_id = item["tenant_id"]
            origin = item.get("origin")
        except (ValueError, TypeError, KeyError):
            log.warning("ignoring a malformed message on %s", CHANNEL)
            return
        if origin != self._origin and isinstance(tenant_id, str):
            self._on_change(event, tenant_id)

    def close(self) -> None:
        self._stop.set()
        self._listener.join(2.0)
        with contextlib.suppress(Exception):
            self._redis.close()
