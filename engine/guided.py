"""Grammar-constrained decoding with llguidance: compile a ``GuidedSpec``, mask logits per step.

    admission (compile worker)           every step (engine thread, per guided row only)
    --------------------------           ------------------------------------------------
    GrammarCompiler.admit(spec)          GuidedRow.sync(output_token_ids)   catch up / roll back
      spec -> Lark grammar text          GuidedRow.fill(bitmask row)        allowed tokens, 1 bit each
      validate under LLParserLimits      GuidedRow.dead_end()               llguidance's error state?
      build a prototype matcher          apply_bitmask(logits, bitmask)     disallowed -> -inf
      follow its forced start            (sampled token is consumed at the next sync)
      within a wall-clock bound          first step: GrammarCompiler.matcher = prototype.deep_copy()
      -> ValueError (a 400)
      the compile (or its refusal) is
      cached per (namespace, spec): done
      once per namespace; the cache is
      shared fairly among tenants

The request's admitter waits for its compile, bounded by COMPILE_TIMEOUT_S: ``AsyncEngine`` on its
event loop (``await_compiled``), holding no thread, so its prepare lanes never wait on one tenant's
grammar; a synchronous caller in its own thread (``check``, ``wait_compiled``).

A dead end (the matcher in its error state, where it allows only EOS) travels with the sampled
token (``SampledRow.grammar_dead_end``), and the engine ends that request with
``OutputFailure.GRAMMAR_DEAD_END`` instead of a normal stop: its output does not match the schema.

Building a matcher is the expensive part (0.1-0.5 s for a schema with thousands of
alternatives, measured here), so it happens at admission, off the engine thread; the engine
thread only copies the prototype (~70 us).

Why llguidance (not xgrammar): it is one abi3 wheel with no dependencies, so it installs beside
any torch (the CPU 2.13 wheel here, 2.11 on the GPU host); xgrammar 0.2.8 requires torch,
triton and apache-tvm-ffi from PyPI and would pull a second torch into a CPU venv. llguidance
computes a 100k-token mask in ~0.2 ms on this CPU, bounds its own work with lexer "fuel" and
size limits, and handles the JSON-schema subset that OpenAI's strict mode allows.

The mask is computed on the CPU into an int32 bitmask (32 tokens a word) and unpacked on the
logits' device with plain tensor ops, so the same code serves CPU and GPU logits.

The matcher advances lazily: at each step it consumes the output tokens it has not seen yet
(the token sampled last step, once the engine appended it), and rolls back when a step is
re-run after a failed batch. A request's matcher therefore always agrees with its output.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import llguidance
import llguidance.hf
import torch

from engine.protocol import GuidedSpec


class _Limits(TypedDict):  # the LLParserLimits set here (a plain dict would type every value the same)
    max_grammar_size: int
    initial_lexer_fuel: int
    step_lexer_fuel: int
    max_lexer_states: int


# Work bounds for one grammar: the schema's size, the compiled grammar's size, lexer fuel at
# start and per token (llguidance stops a step that runs out and reports an error), and the
# wall-clock time a compile may take before the request is refused.
MAX_SCHEMA_BYTES = 64 * 1024
_LIMITS: _Limits = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                        max_lexer_states=100_000)
COMPILE_TIMEOUT_S = 5.0
# Finished compiles kept in all (one per namespace and distinct spec: prototype matchers and
# refusals), shared fairly among tenants (_FairCache). Compiles queued or running are not in it.
_CACHE_SIZE = 256
COMPILE_WORKERS = 2
# Compiles one tenant may run at once. A compile that outlives its request's timeout keeps running
# (llguidance cannot be interrupted) and keeps counting against its tenant until it ends, so one
# tenant's slow schemas occupy at most this many of the COMPILE_WORKERS: the others stay free for
# every other tenant. Its further compiles wait in its own queue, holding no worker.
COMPILES_PER_TENANT = 1
# Compiles one tenant may have waiting in that queue. A compile outlives its request's timeout, so
# without a bound a tenant sending slow schemas would pile up work that runs long after its
# requests are gone; beyond it a new schema is refused at once (CompileQueueFullError, a 429).
COMPILES_QUEUED_PER_TENANT = 8

# Compact JSON (no free whitespace): otherwise a weak model can fill max_tokens with blanks.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**_LIMITS)


def lark_grammar(spec: GuidedSpec) -> str:
    """The Lark grammar text for ``spec`` (llguidance dialect: ``%json`` embeds a JSON schema)."""
    schema = json.loads(spec.json_schema)
    if isinstance(schema, dict):
        schema = {"x-guidance": _JSON_OPTIONS, **schema}
    body = f"%json {json.dumps(schema)}"
    item = " ".join(x for x in (_literal(spec.prefix), "value", _literal(spec.suffix)) if x)
    if spec.max_items == 1:
        return f"start: {item}\nvalue: {body}\n"
    # The separator goes between items, never after one: EOS stays allowed after every complete
    # item, so the grammar never pushes the model into another one; the bound stops a model that
    # keeps repeating itself.
    more = f"({_literal(spec.separator)} item){{0,{spec.max_items - 1}}}" if spec.separator else \
        f"item{{0,{spec.max_items - 1}}}"
    return f"start: item {more}\nitem: {item}\nvalue: {body}\n"


def _literal(text: str) -> str:
    """``text`` as a Lark string literal ("" for none)."""
    return json.dumps(text) if text else ""


# One spec's compile: queued, running, its prototype matcher, or its refusal (a ValueError). Shared
# by every request naming the spec: a waiter gives up on it (timeout, client gone), never cancels it.
GrammarCompile = concurrent.futures.Future[llguidance.LLMatcher]


def _timed_out(timeout_s: float) -> ValueError:
    return ValueError(f"the grammar did not compile within {timeout_s:g} s; simplify the schema")


def wait_compiled(compile_: GrammarCompile, timeout_s: float) -> None:
    """Block until ``compile_`` is done; its refusal (ValueError) re-raised, or ValueError after
    ``timeout_s`` (the compile goes on, counted against its tenant, and stays shared)."""
    try:
        compile_.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise _timed_out(timeout_s) from None


async def await_compiled(compile_: GrammarCompile, timeout_s: float) -> None:
    """``wait_compiled`` on an event loop, holding no thread while the grammar compiles. Shielded:
    a timeout or a cancelled caller (its client gone) must not cancel a compile other requests share."""
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compile_)), timeout_s)
    except TimeoutError:
        raise _timed_out(timeout_s) from None


class CompileQueueFullError(ValueError):
    """The spec's tenant already has ``COMPILES_QUEUED_PER_TENANT`` compiles waiting for its turn: a
    new spec is refused at once rather than queued (the engine answers 429: retry shortly)."""


@dataclass
class _TenantCompiles:
    """One tenant's compiles: how many are running and the ones waiting for its turn."""

    running: int = 0
    queued: deque[tuple[GuidedSpec, GrammarCompile]] = field(default_factory=deque)


class _FairCache:
    """Finished compiles (prototype matchers and refusals), ``capacity`` in all, least recently used
    first within each tenant. Over capacity, the tenant holding the most entries gives up its least
    recently used one (a tie: the inserting tenant if it is one of them, else the one whose entry
    was used longest ago). So a tenant holding no more than its fair share (capacity / tenants
    holding entries) never loses an entry to another tenant's inserts, a tenant that sends many
    distinct schemas evicts its own, and a lone tenant gets plain LRU over the whole capacity.
    Not thread-safe: the caller holds its lock."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the grammar cache needs room for at least one compile")
        self.capacity = capacity
        # tenant -> spec -> (when last used, the finished compile); oldest first
        self._tenants: dict[str, OrderedDict[GuidedSpec, tuple[int, GrammarCompile]]] = {}
        self._size = 0
        self._clock = 0  # use order across tenants: the tie-break between equally large tenants

    def __len__(self) -> int:
        return self._size

    def held(self, tenant: str) -> int:
        """How many entries ``tenant`` holds."""
        entries = self._tenants.get(tenant)
        return len(entries) if entries is not None else 0

    def get(self, spec: GuidedSpec) -> GrammarCompile | None:
        """The compile of ``spec``, now its tenant's most recently used one; None if not kept."""
        entries = self._tenants.get(_tenant_of(spec))
        if entries is None or spec not in entries:
            return None
        _, fut = entries.pop(spec)
        entries[spec] = (self._tick(), fut)
        return fut

    def put(self, spec: GuidedSpec, fut: GrammarCompile) -> None:
        """Keep ``fut`` (finished) for ``spec``, evicting per the fair-share rule while over capacity."""
        tenant = _tenant_of(spec)
        entries = self._tenants.setdefault(tenant, OrderedDict())
        if entries.pop(spec, None) is None:
            self._size += 1
        entries[spec] = (self._tick(), fut)
        while self._size > self.capacity:
            self._evict_oldest_of(self._largest(inserter=tenant))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _largest(self, inserter: str) -> str:
        """The tenant that gives up an entry: the one holding the most (ties as the class says)."""
        def rank(tenant: str) -> tuple[int, bool, int]:
            entries = self._tenants[tenant]
            oldest_use, _ = next(iter(entries.values()))
            return len(entries), tenant == inserter, -oldest_use
        return max(self._tenants, key=rank)

    def _evict_oldest_of(self, tenant: str) -> None:
        entries = self._tenants[tenant]
        entries.popitem(last=False)  # finished: nobody waits on it (a later ``matcher`` rebuilds it)
        self._size -= 1
        if not entries:
            del self._tenants[tenant]


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe.

    The cache key is the whole spec, its ``owner`` included: a grammar one namespace compiled is
    never a hit for another (its compile time would tell that someone used the schema; the prefix
    cache is salted the same way), and a refusal is cached the same way.

    One tenant never costs another its compiles: finished ones are kept ``cache_size`` in all and
    evicted from the tenant holding the most (``_FairCache``), so a tenant sending many distinct
    schemas evicts its own; a compile queued or running is never evicted (its waiters always get
    its result); and a tenant runs ``COMPILES_PER_TENANT`` compiles at once, with at most
    ``COMPILES_QUEUED_PER_TENANT`` more waiting (beyond that, ``CompileQueueFullError``).

    Building llguidance's view of the vocabulary takes 1-5 s for a 100k vocabulary and holds the
    GIL for most of it: the serving engine builds it at start (``AsyncEngine`` ->
    ``LLMEngine.warm_up``); elsewhere (tests, benchmarks) it happens on first use.
    """

    def __init__(self, hf_tokenizer: object, vocab_size: int, eos_token_id: int | None,
                 cache_size: int = _CACHE_SIZE) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_id
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="grammar")
        self._cache_lock = threading.Lock()  # guards the two maps below, the tenants' queues and the counters
        # spec -> its compile while queued or running (at most COMPILES_PER_TENANT +
        # COMPILES_QUEUED_PER_TENANT a tenant); then it moves to _done, under the lock, before its
        # waiters wake: a spec is always in exactly one of the two until _done evicts it
        self._pending: dict[GuidedSpec, GrammarCompile] = {}
        self._done = _FairCache(cache_size)  # spec -> its finished compile: a prototype matcher or the ValueError
        # spec -> its compile while anything holds it (a request's ``Request.grammar``, the maps
        # above): weak, so an entry goes with the last request that held it, with no release to miss
        self._held: weakref.WeakValueDictionary[GuidedSpec, GrammarCompile] = weakref.WeakValueDictionary()
        self._tenants: dict[str, _TenantCompiles] = {}  # only tenants with a compile running or queued
        self.compiles = 0  # grammars built so far (each distinct spec once per namespace while it stays cached)
        self.cache_hits = 0  # checks answered by a compile already started or done

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos)  # type: ignore[arg-type]
            return self._tokenizer

    def warm_up(self) -> None:
        """Build the vocabulary table now (it holds the GIL while it is built: do it before serving)."""
        _ = self.tokenizer

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's exact bytes (special tokens as their text)."""
        tok = self.tokenizer
        return [tok.decode_bytes([t]) for t in token_ids]

    def check(self, spec: GuidedSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """Raise ValueError (with the reason) unless ``spec`` compiles within the bounds;
        ``CompileQueueFullError`` (a ValueError) at once if its tenant has too many compiles waiting.

        Each distinct spec is compiled once: its compile (running, done, or refused) is shared by
        every request that names it, so a burst of requests with one schema, or a refused schema
        sent again, costs one compile, and ``matcher`` later copies that compile's prototype."""
        wait_compiled(self.admit(spec), timeout_s)

    def admit(self, spec: GuidedSpec) -> GrammarCompile:
        """``check`` without the wait: ``spec``'s compile, started, queued or found (``submit``),
        for the caller to wait on (``wait_compiled``, or ``await_compiled`` on an event loop). Raises
        at once, waiting on nothing, for a schema over ``MAX_SCHEMA_BYTES`` (ValueError) or a full
        tenant queue (``CompileQueueFullError``)."""
        if len(spec.json_schema.encode()) > MAX_SCHEMA_BYTES:
            raise ValueError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes")
        self.warm_up()  # before the timed wait: the bound is the grammar's, not the vocabulary's
        return self.submit(spec)

    def submit(self, spec: GuidedSpec) -> GrammarCompile:
        """The compile of ``spec``: the one already queued, running, finished or refused for its
        owner's namespace, else a new one, started now or queued behind its tenant's own
        (``CompileQueueFullError`` when that queue is full: nothing is queued then)."""
        with self._cache_lock:
            fut = self._pending.get(spec)
            if fut is None:
                fut = self._done.get(spec)
            if fut is None:  # evicted, but a live request still holds it: share it, not compile again
                fut = self._held.get(spec)
            if fut is not None:
                self.cache_hits += 1
                return fut
            key = _tenant_of(spec)
            tenant = self._tenants.get(key) or _TenantCompiles()
            must_wait = tenant.running >= COMPILES_PER_TENANT
            if must_wait and len(tenant.queued) >= COMPILES_QUEUED_PER_TENANT:
                raise CompileQueueFullError(
                    f"too many of your JSON schemas are waiting to compile ({COMPILES_QUEUED_PER_TENANT} queued "
                    "behind the one compiling); retry when they are done")
            self._tenants[key] = tenant
            fut = self._pending[spec] = concurrent.futures.Future()
            self._held[spec] = fut
            if must_wait:
                tenant.queued.append((spec, fut))
            else:
                self._start(spec, fut, tenant)
            return fut

    def compiling(self, tenant: str) -> tuple[int, int]:
        """(running, queued) compiles of ``tenant`` (a ``GrammarOwner.tenant``; "" for specs without one)."""
        with self._cache_lock:
            t = self._tenants.get(tenant)
            return (t.running, len(t.queued)) if t is not None else (0, 0)

    def cached(self, tenant: str) -> int:
        """Finished compiles of ``tenant`` (a ``GrammarOwner.tenant``) the cache keeps."""
        with self._cache_lock:
            return self._done.held(tenant)

    def _start(self, spec: GuidedSpec, fut: GrammarCompile, tenant: _TenantCompiles) -> None:
        """Run the compile in a worker, counted against ``tenant`` until it ends (caller holds _cache_lock)."""
        tenant.running += 1
        self._pool.submit(self._run, spec, fut)

    def _run(self, spec: GuidedSpec, fut: GrammarCompile) -> None:
        outcome: llguidance.LLMatcher | BaseException
        try:
            outcome = self._build(spec)
        except BaseException as exc:  # noqa: BLE001 - the refusal (or a bug) goes to the waiters
            outcome = exc
        try:
            self._finish(spec)
        finally:
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    def _finish(self, spec: GuidedSpec) -> None:
        """``spec``'s compile ended: keep it in the cache (before its waiters wake, so ``matcher``
        finds it there) and start its tenant's next queued compile."""
        key = _tenant_of(spec)
        with self._cache_lock:
            self._done.put(spec, self._pending.pop(spec))
            tenant = self._tenants[key]
            tenant.running -= 1
            while tenant.queued and tenant.running < COMPILES_PER_TENANT:
                self._start(*tenant.queued.popleft(), tenant)
            if not tenant.running and not tenant.queued:
                del self._tenants[key]

    def _build(self, spec: GuidedSpec) -> llguidance.LLMatcher:
        """A validated matcher in its start state; ValueError (a one-line reason) if it cannot be."""
        with self._cache_lock:
            self.compiles += 1
        tokenizer = self.tokenizer
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark_grammar(spec))
        except (ValueError, TypeError, RecursionError) as exc:
            raise ValueError(f"invalid schema: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=_limits())
        if is_error:
            raise ValueError(f"the JSON schema cannot be enforced while decoding: {_reason(messages[0])}")
        proto = llguidance.LLMatcher(tokenizer, grammar, limits=_limits(), log_level=0)
        if proto.is_error():
            raise ValueError(f"the JSON schema cannot be enforced while decoding: {_reason(proto.get_error())}")
        failure = _forced_start_failure(proto)
        if failure is not None:
            raise ValueError("the JSON schema cannot be enforced while decoding: the grammar fails on the text "
                             "every output must start with (for example, a required property that refers back "
                             f"to its own object forces an endless value): {failure}")
        return proto

    def matcher(self, spec: GuidedSpec) -> GuidedRow:
        """A fresh matcher for one request: a copy of the prototype ``check`` built. The compile is
        found while it is cached or while a request holds it (``Request.grammar``: an admitted
        request always does, so the engine thread never compiles for it); rebuilt here, on the
        caller's thread and uncached, only for a spec nothing holds any more."""
        with self._cache_lock:
            fut = self._pending.get(spec)
            if fut is None:
                fut = self._done.get(spec)
            if fut is None:
                fut = self._held.get(spec)
        if fut is None or fut.cancelled():
            return GuidedRow(self._build(spec))
        return GuidedRow(fut.result().deep_copy())


def _tenant_of(spec: GuidedSpec) -> str:
    return spec.owner.tenant if spec.owner is not None else ""


def _forced_start_failure(proto: llguidance.LLMatcher) -> str | None:
    """Why the grammar fails along the tokens it forces from its start (followed on a copy), or
    None. Those tokens are every output's start, whatever the model samples, so such a grammar
    would dead-end in every request: it is refused at admission instead. Cheap: a normal start
    forces a few tokens (~0.1 ms); a self-recursive required property forces ``{"c":{"c":...``
    until llguidance's item limit stops it (~30 ms, once per schema: the refusal is cached)."""
    probe = proto.deep_copy()
    forced = probe.compute_ff_tokens()
    if forced and not probe.is_error():
        probe.consume_tokens(forced)
    return _reason(probe.get_error()) if probe.is_error() else None


_WHERE = re.compile(r"^at \d+\(\d+\): ")
_GRAMMAR_LINE = re.compile(r"^\s*\d+ \| ")


def _reason(message: str) -> str:
    """llguidance's error as one line: without its position prefix and the listing of our own
    grammar text (which names internal options, not anything the client wrote)."""
    lines = []
    for line in message.splitlines():
        if _GRAMMAR_LINE.match(line):
            break
        lines.append(line.strip())
    text = _WHERE.sub("", " ".join(x for x in lines if x))
    return re.sub(r"\s+", " ", text)[:500] or "refused by the grammar compiler"


class GuidedRow:
    """One request's grammar state. Not thread-safe: the sampler's thread only."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._consumed: list[int] = []

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Bring the matcher to exactly ``output_token_ids`` (consume new ones, roll back a re-run)."""
        done = self._consumed
        common = 0
        limit = min(len(done), len(output_token_ids))
        while common < limit and done[common] == output_token_ids[common]:
            common += 1
        if common < len(done):
            self._matcher.rollback(len(done) - common)
            del done[common:]
        for t in output_token_ids[common:]:
            # a token the mask forbade (cannot happen unless the caller ignores the mask): the
            # matcher enters its error state and from then on allows only EOS
            self._matcher.consume_token(int(t))
            done.append(int(t))

    def dead_end(self) -> str | None:
        """Why no token can continue the output, or None while the grammar can go on. In its error
        state (a limit hit, e.g. a value the schema forces without end) llguidance's mask allows
        only EOS: the output would end there, incomplete, looking like a normal stop."""
        return _reason(self._matcher.get_error()) if self._matcher.is_error() else None

    def fill(self, bitmask_row: torch.Tensor) -> None:
        """Write the allowed-token bits of the next step into ``bitmask_row`` (int32, CPU, contiguous)."""
        assert bitmask_row.dtype == torch.int32 and bitmask_row.is_contiguous() and bitmask_row.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] float (any device), bitmask [R, ceil(V/32)] int32 (CPU): disallowed -> -inf."""
    rows, vocab = logits.shape
    assert bitmask.shape == (rows, bitmask_words(vocab)), f"bitmask {tuple(bitmask.shape)} for logits {(rows, vocab)}"
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    # bit j of word w allows token 32*w + j
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
