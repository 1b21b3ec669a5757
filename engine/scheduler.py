"""Continuous batching with chunked prefill, prefix-aware admission, tenant fairness and preemption.

One ``schedule()`` call builds one engine step under a token budget (``max_num_batched_tokens``)
and a batch-size cap (``max_num_seqs``)::

    0. the blocks of requests that finished in the previous step are freed (``finish``: after
       their outputs were handed out, before anyone below may need the blocks).
    1. running requests, highest priority class first, then in admission order:
         each gets min(its uncomputed tokens, budget left) tokens (a decode is 1 token, a prefill
         continues its next chunk); new blocks come from the cache manager; when none are free, or the
         tenant's KV quota would be exceeded, the lowest-priority, latest-admitted request is
         preempted by recompute (blocks freed, requeued at the front of its tenant's queue;
         its full blocks stay indexed, so its readmission usually hits them). A prefill chunk
         whose tenant ranks behind another tenant's waiting request (by the key of step 2)
         yields: it runs after step 2 with the budget admission leaves, so a tenant arriving
         during another's burst of prompts is not queued behind the whole burst (decodes never
         yield).
    2. waiting requests, while budget and batch slots remain, and nobody was preempted:
         tenant  = highest priority class, then earliest TTFT deadline (arrival + ttft_target_s),
                   then least service received (Virtual Token Counter fairness: a tenant with
                   100 queued requests cannot starve one with a single request);
         request = longest cached prefix within that tenant, then arrival order, skipping requests
                   whose prefix is being restored from a lower tier or whose next prefix block a
                   running request is computing (they would recompute what is about to be cached);
         admitted only if the cache manager finds its first chunk's blocks (free, within quota).
    3. every request still waiting records why (``QueueReason``).

A step that more than one request may share (more than one running, or anyone waiting) carries at
most ``max_mixed_prefill_tokens`` prefill tokens (``StepBudget``; decodes count only against
``max_num_batched_tokens``): on a CPU a step of 2,048 prefill tokens takes seconds, and every decode
in it, and every request arriving meanwhile, would wait that long for its next token. Prefills still
progress in every such step (the earliest admitted first), and a lone request's prefill gets the
whole ``max_num_batched_tokens``.

"Tenant" above is ``Request.tenant_key`` (``TenantScope.tenant_key``), never the namespace: a
tenant whose end users each get a namespace (share scope ``user``) has one queue, one service
counter and one quota, and tenants sharing a namespace (share scope ``group:NAME``) each keep
their own.

Blocks come only from the ``KVCacheManager`` (match, admit, grow, commit, free, poll_restores);
the scheduler never touches the pool. Requests join and leave between steps (continuous
batching). The scheduler owns no tensors; the result is an ``engine.batch.ScheduledBatch`` for the
runner. No torch here.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.batch import ScheduledBatch, SequenceChunk
from engine.kv_cache_manager import KVCacheManager
from engine.kv_types import MatchResult, QueueReason
from engine.request import Request, RequestStatus

# Times a waiting request may be passed over for requests with longer cached prefixes.
MAX_BYPASS = 8


@dataclass
class StepBudget:
    """The tokens one step may still carry (``tokens``) and, of those, the prefill tokens
    (``prefill_tokens``: fewer than ``tokens`` in a shared step). A chunk of one token (a decode)
    counts only against ``tokens``: decodes are what the prefill cap protects."""

    tokens: int
    prefill_tokens: int

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0

    @property
    def prefill_exhausted(self) -> bool:
        return self.tokens <= 0 or self.prefill_tokens <= 0

    def grant(self, uncomputed: int) -> int:
        """Tokens a request with ``uncomputed`` tokens left to compute gets in this step."""
        if uncomputed <= 1:
            return min(uncomputed, self.tokens)
        return max(0, min(uncomputed, self.tokens, self.prefill_tokens))

    def spend(self, uncomputed: int, n: int) -> None:
        """Charge a chunk of ``n`` tokens of a request that had ``uncomputed`` left."""
        self.tokens -= n
        if uncomputed > 1:
            self.prefill_tokens -= n


@dataclass
class SchedulerOutput:
    """One step: the batch for the runner plus which request each chunk belongs to."""

    batch: ScheduledBatch
    requests: list[Request]  # requests[i] owns batch.chunks[i]
    num_tokens: list[int]  # tokens of chunk i
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Args:
    cache: the KV cache manager (its ``enable_caching`` decides whether prefixes are ever matched).
    max_num_seqs: most running requests.
    max_num_batched_tokens: tokens per step (prefill chunks + decodes).
    clock: monotonic time source (tests pass a fake one).
    max_mixed_prefill_tokens: most prefill tokens in a step that more than one request may share
        (see the module docstring); None = no cap beyond the step's budget.
    """

    def __init__(
        self,
        cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        max_mixed_prefill_tokens: int | None = None,
    ) -> None:
        if max_mixed_prefill_tokens is not None and max_mixed_prefill_tokens < 1:
            raise ValueError(f"max_mixed_prefill_tokens must be >= 1 or None, got {max_mixed_prefill_tokens}")
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_mixed_prefill_tokens = max_mixed_prefill_tokens
        self.clock = clock
        self.waiting: OrderedDict[bytes, deque[Request]] = OrderedDict()  # tenant key -> its queue
        self.running: list[Request] = []
        self.service: dict[bytes, float] = {}  # tokens served per tenant key (VTC counters)
        self.num_preemptions = 0
        self._admit_seq = itertools.count(1)
        self._finished: list[Request] = []  # finished in a step, blocks not yet freed (``finish``)

    # ------------------------------------------------------------------ queue membership

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, request: Request) -> None:
        key = request.tenant_key
        if not self.waiting.get(key) and not any(r.tenant_key == key for r in self.running):
            # A tenant returning from idle starts at the least-served active tenant's counter, so
            # it can neither bank credit while idle nor be punished for service long ago.
            active = [self.service[t] for t in self._active_tenants() if t in self.service]
            self.service[key] = max(self.service.get(key, 0.0), min(active, default=0.0))
        self.waiting.setdefault(key, deque()).append(request)
        request.status = RequestStatus.WAITING

    def _active_tenants(self) -> set[bytes]:
        return {key for key, q in self.waiting.items() if q} | {r.tenant_key for r in self.running}

    def remove(self, request: Request) -> None:
        """Take a request out of the scheduler and free its blocks now (``finish`` frees later:
        the engine's step loop uses that, aborts included, with ``release_finished``)."""
        self._detach(request)
        if request in self._finished:
            self._finished.remove(request)
        self._free_blocks(request)

    def finish(self, request: Request) -> None:
        """Take a request that finished in this step out of the scheduler; its blocks go back to the
        pool at the next ``release_finished`` (the start of the next ``schedule`` at the latest).

        Why later: freeing a long prompt's blocks (513 for 8,192 tokens, ~0.35 ms of host time) would
        otherwise sit between the request's last token and the step returning it, i.e. on the
        time to first token of every one-token request. Admission loses nothing: ``schedule``
        releases before it grows or admits anyone, which is where the blocks would be used first.
        The device cannot be writing them when they are reused: any step that still computes one
        of their positions was queued before the step that reuses them, on the same stream."""
        self._detach(request)
        self._finished.append(request)

    def release_finished(self) -> int:
        """Free the blocks of the requests ``finish`` took out; returns how many requests."""
        done, self._finished = self._finished, []
        for request in done:
            self._free_blocks(request)
        return len(done)

    @property
    def has_pending_release(self) -> bool:
        """Finished requests whose blocks ``release_finished`` has not returned yet."""
        return bool(self._finished)

    def _detach(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            queue = self.waiting.get(request.tenant_key)
            if queue is not None and request in queue:
                queue.remove(request)

    def _free_blocks(self, request: Request) -> None:
        if request.retention:  # explicit cache control: mark the spans before letting go
            self.cache.retain(request.tenant, request.block_table, request.num_registered_blocks,
                              request.retention)
        self.cache.free(request.request_id, request.tenant, request.block_table)
        request.block_table = []
        request.num_registered_blocks = 0

    def block_tables(self) -> list[list[int]]:
        """Every live request's block table (for ``KVCacheManager.check_integrity``)."""
        tables = [r.block_table for r in self.running]
        tables += [r.block_table for r in self._finished if r.block_table]
        tables += [r.block_table for q in self.waiting.values() for r in q if r.block_table]
        return tables

    def queue_reasons(self) -> Counter[str]:
        return Counter(r.queue_reason.value for q in self.waiting.values() for r in q if r.queue_reason)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        self.release_finished()  # before anyone grows or is admitted: they may need those blocks
        out = SchedulerOutput(ScheduledBatch(()), [], [])
        chunks: list[SequenceChunk] = []
        self.cache.poll_restores((r for q in self.waiting.values() for r in q), idle=not self.running)
        now = self.clock()

        self.running.sort(key=lambda r: (-r.tenant.priority, r.admit_seq))
        yielding = self._yielding_prefills()  # prefills that wait for a waiting tenant ranked ahead
        budget = self._step_budget(shared=len(self.running) + self.num_waiting > 1)
        deferred: list[Request] = []  # the yielding prefills, in running order
        i = 0
        while i < len(self.running) and not budget.exhausted:
            req = self.running[i]
            uncomputed = req.num_uncomputed_tokens
            n = budget.grant(uncomputed)
            if n == 0:  # the prefill cap is spent (or, defensively, nothing is left to compute)
                i += 1
                continue
            if req.request_id in yielding:
                deferred.append(req)
                i += 1
                continue
            if not self._grow(req, i, req.num_computed_tokens + n, out):
                continue  # req itself was preempted; running[i] is now the next request
            self._emit(req, n, out, chunks)
            budget.spend(uncomputed, n)
            i += 1

        over_quota: set[bytes] = set()
        blocked: dict[str, QueueReason] = {}  # request id -> a reason of its own (restoring, computing)
        if out.preempted:
            stop_reason = QueueReason.NO_KV_BLOCKS  # admitting now would only preempt again
        else:
            stop_reason = self._admit(budget, now, out, chunks, over_quota, blocked)
        self._continue_deferred(deferred, budget, out, chunks)
        for key, queue in self.waiting.items():
            for req in queue:
                if self.cache.is_restoring(req.request_id):
                    req.queue_reason = QueueReason.RESTORING
                elif req.request_id in blocked:
                    req.queue_reason = blocked[req.request_id]
                else:
                    req.queue_reason = QueueReason.TENANT_OVER_QUOTA if key in over_quota else stop_reason
        out.batch = ScheduledBatch(tuple(chunks))
        return out

    def _step_budget(self, shared: bool) -> StepBudget:
        """The step's budget; a step that more than one request may share carries at most
        ``max_mixed_prefill_tokens`` prefill tokens (a lone request's prefill gets them all)."""
        tokens = self.max_num_batched_tokens
        if shared and self.max_mixed_prefill_tokens is not None:
            return StepBudget(tokens, min(tokens, self.max_mixed_prefill_tokens))
        return StepBudget(tokens, tokens)

    def _yielding_prefills(self) -> set[str]:
        """Ids of the running prefills that yield this step to another tenant's waiting request
        (``_yields``). Decode-only batches never rank the waiting tenants."""
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        if not prefills or not self.waiting:
            return set()
        order = self._waiting_order()
        return {r.request_id for r in prefills if self._yields(r, order)}

    def _waiting_order(self) -> list[tuple[tuple[int, float, float], bytes]]:
        """Waiting tenants, best first, by the key admission picks them by (``_tenant_order``)."""
        return sorted((self._tenant_order(key), key) for key, queue in self.waiting.items() if queue)

    def _yields(self, req: Request, waiting_order: list[tuple[tuple[int, float, float], bytes]]) -> bool:
        """Whether running prefill ``req`` waits this step for another tenant's waiting request.

        Running requests take the token budget before anyone is admitted, so without this a tenant
        that arrives while another's burst is prefilling would wait for the whole burst: the
        burst's prompts, admitted while nobody else waited, keep the budget until all are
        computed. A prefill chunk (more than one token: decodes never wait) therefore goes after
        admission when some other tenant's waiting request ranks strictly ahead of its own tenant
        by admission's key (priority, then TTFT deadline, then VTC service); it still gets
        whatever budget admission leaves (``_continue_deferred``)."""
        mine = (-req.tenant.priority, req.ttft_deadline, self.service.get(req.tenant_key, 0.0))
        for order, key in waiting_order:
            if key != req.tenant_key:
                return order < mine
        return False

    def _continue_deferred(self, deferred: list[Request], budget: StepBudget, out: SchedulerOutput,
                           chunks: list[SequenceChunk]) -> None:
        """Give the prefills that yielded to admission the budget it left, in running order. Growing
        one may preempt only requests that have no chunk in this step yet (or itself)."""
        emitted = {r.request_id for r in out.requests}
        for req in deferred:
            if budget.prefill_exhausted:
                return
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted meanwhile
            uncomputed = req.num_uncomputed_tokens
            n = budget.grant(uncomputed)
            if not self._grow(req, self.running.index(req), req.num_computed_tokens + n, out, emitted):
                continue
            self._emit(req, n, out, chunks)
            emitted.add(req.request_id)
            budget.spend(uncomputed, n)

    def _grow(self, req: Request, pos: int, context_len: int, out: SchedulerOutput,
              scheduled: set[str] | None = None) -> bool:
        """Give ``req`` blocks for ``context_len`` tokens, preempting later requests if needed
        (never one of ``scheduled``: those already have a chunk in this step).

        Returns False if ``req`` itself had to be preempted."""
        need = req.blocks_needed(context_len) - len(req.block_table)
        while need > 0:
            got = self.cache.grow(req.tenant, need)
            if not isinstance(got, QueueReason):
                req.block_table.extend(got)
                break
            over_quota = got is QueueReason.TENANT_OVER_QUOTA
            victim = self._pick_victim(pos, req.tenant_key if over_quota else None, scheduled) or req
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _pick_victim(self, after: int, tenant_key: bytes | None, scheduled: set[str] | None = None) -> Request | None:
        """The last running request after position ``after`` (lowest priority, latest admitted),
        of tenant ``tenant_key`` if given (a quota is freed only by the same tenant's references,
        in whichever of its namespaces), and not among ``scheduled`` request ids."""
        for j in range(len(self.running) - 1, after, -1):
            cand = self.running[j]
            if (tenant_key is None or cand.tenant_key == tenant_key) and (
                    scheduled is None or cand.request_id not in scheduled):
                return cand
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        req.queue_reason = QueueReason.NO_KV_BLOCKS
        self.waiting.setdefault(req.tenant_key, deque()).appendleft(req)
        self.num_preemptions += 1
        out.preempted.append(req)

    def _admit(
        self, budget: StepBudget, now: float, out: SchedulerOutput, chunks: list[SequenceChunk],
        over_quota: set[bytes], blocked: dict[str, QueueReason],
    ) -> QueueReason:
        """Admit waiting requests, spending ``budget``; returns the reason the rest keep waiting. Tenants refused for
        their KV quota are added to ``over_quota``; requests that wait for a reason of their own
        (a restore, a prefix being computed) to ``blocked``."""
        while True:
            if budget.prefill_exhausted:  # a newcomer's first chunk is a prefill
                return QueueReason.TOKEN_BUDGET
            if len(self.running) >= self.max_num_seqs:
                return QueueReason.BATCH_FULL
            tenants = [key for key, q in self.waiting.items()
                       if key not in over_quota and any(r.request_id not in blocked for r in q)]
            if not tenants:
                return QueueReason.NO_KV_BLOCKS  # only over-quota or blocked requests (or none) remain
            key = min(tenants, key=self._tenant_order)
            queue = self.waiting[key]
            picked = self._pick_in_tenant(queue, blocked)
            if picked is None:
                continue  # every request of this tenant is blocked now
            match, req = picked
            uncomputed = req.num_tokens - match.cached_tokens
            n = budget.grant(uncomputed)
            new_blocks = req.blocks_needed(match.cached_tokens + n) - match.num_blocks
            table = self.cache.admit(req, match, new_blocks)
            if table is QueueReason.TENANT_OVER_QUOTA:
                over_quota.add(key)
                continue
            if table is QueueReason.NO_KV_BLOCKS:
                return QueueReason.NO_KV_BLOCKS
            if isinstance(table, QueueReason):
                blocked[req.request_id] = table
                continue
            for r in queue:  # everyone queued ahead of req was passed over once more
                if r is req:
                    break
                r.num_bypassed += 1
            queue.remove(req)
            req.block_table = table
            req.num_registered_blocks = match.num_blocks
            req.num_computed_tokens = match.cached_tokens
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(match.cached_tokens, req.num_prompt_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            req.queue_reason = None
            req.admit_seq = next(self._admit_seq)
            self.running.append(req)
            self._emit(req, n, out, chunks)
            out.admitted.append(req)
            budget.spend(uncomputed, n)

    def _pick_in_tenant(
        self, queue: deque[Request], blocked: dict[str, QueueReason]
    ) -> tuple[MatchResult, Request] | None:
        """Longest cached prefix first (ties: queue order), except that a request passed over
        ``MAX_BYPASS`` times goes first, so a cold request is not starved by a stream of hits.
        Requests whose prefix is being restored or computed are added to ``blocked`` and skipped."""
        matches: list[tuple[MatchResult, Request]] = []
        for r in queue:
            if r.request_id in blocked:
                continue
            if self.cache.is_restoring(r.request_id):
                blocked[r.request_id] = QueueReason.RESTORING
                continue
            m = self.cache.match(r)
            if m.computing:
                blocked[r.request_id] = QueueReason.PREFIX_COMPUTING
                continue
            if r.num_bypassed >= MAX_BYPASS:
                return m, r
            matches.append((m, r))
        if not matches:
            return None
        return min(matches, key=lambda mr: -mr[0].cached_tokens)  # min is stable: queue order on ties

    def _tenant_order(self, key: bytes) -> tuple[int, float, float]:
        """Sort key of a waiting tenant: priority class, earliest TTFT deadline, least service."""
        queue = self.waiting[key]
        priority = max(r.tenant.priority for r in queue)
        deadline = min(r.ttft_deadline for r in queue)
        return (-priority, deadline, self.service.get(key, 0.0))

    def _emit(self, req: Request, n: int, out: SchedulerOutput, chunks: list[SequenceChunk]) -> None:
        chunks.append(self._chunk(req, n))
        out.requests.append(req)
        out.num_tokens.append(n)
        # charged at once, so the next admission in this same step already sees it
        self.service[req.tenant_key] = self.service.get(req.tenant_key, 0.0) + n

    def _chunk(self, req: Request, n: int) -> SequenceChunk:
        start = req.num_computed_tokens
        targets: tuple[int, ...] = ()
        if req.prompt_scoring_left and start + 1 < req.num_prompt_tokens:
            # row j predicts token start + j + 1, up to the prompt's last (engine.batch.SequenceChunk)
            targets = req.token_slice(start + 1, min(n, req.num_prompt_tokens - 1 - start))
        sample = start + n == req.num_tokens
        return SequenceChunk(
            request_id=req.request_id,
            token_ids=req.token_slice(start, n),
            start_pos=start,
            block_table=tuple(req.block_table),
            sample=sample,
            sampling=req.sampling,
            output_token_ids=tuple(req.output_token_ids),
            prompt_targets=targets,
            # the prompt itself (not a copy) where the sampler may need it: a repetition penalty's
            # first pick builds the request's seen-token row from it (engine.penalties)
            prompt_token_ids=req.prompt_token_ids if sample and req.sampling.repetition_penalty != 1.0 else (),
        )

    # ------------------------------------------------------------------ after the step

    def commit(self, out: SchedulerOutput) -> None:
        """Record that the step ran: advance computed tokens and index blocks that became full.

        Call after the runner wrote the batch's K/V and before appending sampled tokens."""
        for req, n in zip(out.requests, out.num_tokens):
            if req.is_finished or req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += n
            req.num_prompt_tokens_reached = max(req.num_prompt_tokens_reached,
                                                min(req.num_computed_tokens, req.num_prompt_tokens))
            full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
            start = req.num_registered_blocks
            if full > start:
                req.block_table[start:full] = self.cache.commit(
                    req.request_id, req.tenant, req.block_table, req.block_hashes[start:full], start
                )
                req.num_registered_blocks = full

