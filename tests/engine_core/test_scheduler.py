"""Scheduler policy: fairness, quotas, preemption, queue reasons, prefix-aware ordering, chunking."""

from engine_core_fakes import make_request, scope

from engine.kv_cache_manager import KVCacheManager
from engine.kv_types import QueueReason
from engine.request import RequestStatus
from engine.scheduler import Scheduler

BS = 4


def sched(num_blocks=64, max_num_seqs=8, budget=64, policy="lru", mixed_cap=None) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, eviction_policy=policy), max_num_seqs, budget, clock=lambda: 100.0,
                     max_mixed_prefill_tokens=mixed_cap)


def run_step(s: Scheduler, token: int = 7):
    """Schedule, pretend the runner ran, append a token to every sampling chunk."""
    out = s.schedule()
    s.commit(out)
    for req, chunk in zip(out.requests, out.batch.chunks):
        if chunk.sample:
            req.append_output_token(token, 100.0)
    s.cache.check_integrity(s.block_tables())
    return out


def test_chunked_prefill_respects_the_token_budget():
    s = sched(budget=8)
    r = make_request("a", range(20))
    s.add(r)
    sizes = []
    for _ in range(3):
        out = run_step(s)
        sizes.append((out.batch.chunks[0].start_pos, out.batch.chunks[0].num_tokens, out.batch.chunks[0].sample))
    assert sizes == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert r.output_token_ids == [7]
    out = run_step(s)  # decode: one token at position 20
    assert (out.batch.chunks[0].start_pos, out.batch.chunks[0].token_ids) == (20, (7,))
    assert out.batch.chunks[0].block_table == tuple(r.block_table) and len(r.block_table) == 6


def test_continuous_batching_decodes_and_new_prefill_share_a_step():
    s = sched(budget=16)
    a = make_request("a", range(8))
    s.add(a)
    run_step(s)
    s.add(make_request("b", range(100, 120)))
    out = run_step(s)
    assert [(c.request_id, c.num_tokens) for c in out.batch.chunks] == [("a", 1), ("b", 15)]
    assert out.batch.num_tokens == 16


def test_tenant_with_one_request_is_admitted_while_another_has_100_queued():
    s = sched(max_num_seqs=2, budget=1000)
    big, small = scope("big"), scope("small")
    for i in range(100):
        s.add(make_request(f"big{i}", [i] * 8, big, arrival_time=float(i)))
    run_step(s)  # two of big's requests fill the batch
    s.add(make_request("lonely", [1000] * 8, small, arrival_time=200.0))
    for r in list(s.running):
        s.remove(r)  # both finish
    out = run_step(s)
    admitted = [r.request_id for r in out.admitted]
    assert "lonely" in admitted, admitted
    waiting = [r for q in s.waiting.values() for r in q]
    assert {r.queue_reason for r in waiting} == {QueueReason.BATCH_FULL}


def test_fairness_alternates_between_tenants_by_service():
    s = sched(max_num_seqs=1, budget=1000)
    for i in range(3):
        s.add(make_request(f"a{i}", [1, i] * 4, scope("a")))
        s.add(make_request(f"b{i}", [2, i] * 4, scope("b")))
    order = []
    for _ in range(6):
        out = run_step(s)
        order.append(out.admitted[0].request_id)
        s.remove(out.requests[0])
    assert [o[0] for o in order] == ["a", "b", "a", "b", "a", "b"]


def test_longest_cached_prefix_first_within_a_tenant():
    s = sched(max_num_seqs=1)
    warm = make_request("warm", list(range(12)) + [50])
    s.add(warm)
    run_step(s)
    s.remove(warm)  # its 3 full blocks stay indexed
    s.add(make_request("cold", [90] * 13))
    s.add(make_request("hit", list(range(12)) + [60]))
    out = run_step(s)
    assert out.admitted[0].request_id == "hit" and out.admitted[0].num_cached_tokens == 12
    assert out.batch.chunks[0].start_pos == 12 and out.batch.chunks[0].num_tokens == 1


def test_two_namespaces_never_share_cached_tokens():
    s = sched()
    a = make_request("a", list(range(16)) + [1], scope("a"))
    s.add(a)
    run_step(s)
    b = make_request("b", list(range(16)) + [1], scope("b"))
    a2 = make_request("a2", list(range(16)) + [1], scope("a"))
    s.add(b)
    s.add(a2)
    run_step(s)
    assert b.num_cached_tokens == 0 and a2.num_cached_tokens == 16
    assert set(b.block_table).isdisjoint(a.block_table)


def test_priority_class_goes_first_and_ttft_target_orders_admission():
    s = sched(max_num_seqs=1)
    s.add(make_request("low", [1] * 8, scope("low"), arrival_time=0.0))
    s.add(make_request("high", [2] * 8, scope("high", priority=5), arrival_time=50.0))
    s.add(make_request("slo", [3] * 8, scope("slo", ttft_target_s=1.0), arrival_time=40.0))
    order = []
    for _ in range(3):
        out = run_step(s)
        order.append(out.admitted[0].request_id)
        s.remove(out.requests[0])
    assert order == ["high", "slo", "low"]


def test_tenant_quota_blocks_admission_and_records_the_reason():
    s = sched()
    capped = scope("capped", kv_block_quota=4)
    s.add(make_request("c1", range(12), capped))  # 3 blocks
    s.add(make_request("c2", range(100, 112), capped))  # 3 more would exceed 4
    s.add(make_request("free", range(200, 212), scope("other")))
    out = run_step(s)
    assert sorted(r.request_id for r in out.admitted) == ["c1", "free"]
    c2 = s.waiting[b"capped"][0]
    assert c2.queue_reason is QueueReason.TENANT_OVER_QUOTA
    assert s.cache.used_by(b"capped") == 3
    assert s.queue_reasons() == {"tenant_over_quota": 1}


def test_quota_preempts_the_same_tenants_request_when_a_decode_needs_a_block():
    s = sched()
    capped = scope("capped", kv_block_quota=4)
    a = make_request("a", range(7), capped)  # 2 blocks, 8 slots
    b = make_request("b", range(100, 108), capped)  # 2 blocks (full) + needs a 3rd on decode
    other = make_request("o", range(200, 207), scope("other"))
    for r in (a, b, other):
        s.add(r)
    run_step(s)  # all prefilled; a and b now hold 4 blocks = quota
    out = run_step(s)  # a decodes into its slot 8 -> needs block 3: over quota -> preempt b
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert other.status is RequestStatus.RUNNING  # another tenant's request is never the victim


def test_preemption_when_blocks_run_out_requeues_and_rehits_its_prefix():
    s = sched(num_blocks=5, budget=100)
    a = make_request("a", range(8), arrival_time=0.0)
    b = make_request("b", range(100, 108), arrival_time=1.0)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 2 blocks + b: 2 blocks (prompt full) = 4 of 5 used... each needs a 3rd block
    out = run_step(s)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert s.num_preemptions == 1
    assert s.waiting[b"t"][0] is b and b.queue_reason is QueueReason.NO_KV_BLOCKS
    s.remove(a)
    out = run_step(s)
    assert out.admitted == [b]
    # b's prompt blocks stayed indexed: recompute starts after them (prompt 8 + 1 output token)
    assert out.batch.chunks[0].start_pos == 8 and b.num_cached_tokens == 0


def test_queue_reasons_token_budget_and_no_kv_blocks():
    s = sched(num_blocks=4, budget=8)
    s.add(make_request("a", range(8)))
    s.add(make_request("b", range(50, 58)))
    run_step(s)
    assert s.waiting[b"t"][0].queue_reason is QueueReason.TOKEN_BUDGET
    s2 = sched(num_blocks=4, budget=100)
    s2.add(make_request("a", range(12)))
    s2.add(make_request("b", range(50, 62)))
    run_step(s2)
    assert s2.waiting[b"t"][0].queue_reason is QueueReason.NO_KV_BLOCKS


def test_a_cold_request_is_not_starved_by_a_stream_of_prefix_hits():
    from engine.scheduler import MAX_BYPASS

    s = sched(max_num_seqs=1)
    warm = make_request("warm", list(range(12)) + [50])
    s.add(warm)
    run_step(s)
    s.remove(warm)
    s.add(make_request("cold", [90] * 13))
    admitted = []
    for i in range(MAX_BYPASS + 2):
        s.add(make_request(f"hit{i}", list(range(12)) + [60 + i]))
        out = run_step(s)
        admitted.append(out.admitted[0].request_id)
        s.remove(out.requests[0])
    assert admitted[:MAX_BYPASS] == [f"hit{i}" for i in range(MAX_BYPASS)]
    assert admitted[MAX_BYPASS] == "cold"


def _first_token_step(s: Scheduler, req, steps: int) -> int | None:
    for step in range(1, steps + 1):
        run_step(s)
        if req.output_token_ids:
            return step
    return None


def test_a_tenant_arriving_during_another_tenants_prefill_is_not_held_behind_it():
    """A running prefill takes the budget before admission; when another tenant's waiting request
    ranks ahead of its tenant (VTC service), the prefill yields this step's budget to admission and
    keeps what admission leaves, so the newcomer's first token does not wait for the whole prompt."""
    s = sched(num_blocks=128, budget=16)
    long = make_request("long", range(200), scope("burst"), max_tokens=2)
    s.add(long)
    run_step(s)  # long: 16 of 200 prompt tokens
    short = make_request("short", range(1000, 1008), scope("late"), max_tokens=2)
    s.add(short)
    assert _first_token_step(s, short, 4) is not None, "the newcomer waited behind the other tenant's prefill"
    assert not long.output_token_ids and long.num_computed_tokens > 16  # it kept progressing meanwhile
    # without another tenant waiting, a prefill takes the whole budget every step
    solo = sched(num_blocks=128, budget=16)
    alone = make_request("alone", range(200), scope("burst"))
    solo.add(alone)
    sizes = [run_step(solo).num_tokens for _ in range(3)]
    assert sizes == [[16], [16], [16]]


def test_a_yielding_prefill_gets_the_budget_admission_leaves_and_decodes_never_yield():
    s = sched(num_blocks=128, budget=16)
    dec = make_request("dec", range(300, 304), scope("late"), max_tokens=8)
    s.add(dec)
    run_step(s)  # dec prefilled (4 tokens), decodes from now on
    long = make_request("long", range(200), scope("burst"))
    s.add(long)
    run_step(s)
    s.add(make_request("short", range(1000, 1006), scope("late"), max_tokens=2))
    for _ in range(3):
        out = run_step(s)
        by_id = dict(zip((r.request_id for r in out.requests), out.num_tokens, strict=True))
        assert by_id.get("dec") == 1  # a decode is never held back
        assert sum(out.num_tokens) == 16  # whatever admission leaves goes to the yielding prefill


def test_a_step_with_decodes_carries_at_most_the_mixed_prefill_cap_and_the_prefill_still_progresses():
    """Issue: another request's decode rode in steps of max_num_batched_tokens prefill tokens
    (seconds on a CPU), so its time per token was set by other tenants' prompt sizes. While a decode
    runs, prefill chunks share at most max_mixed_prefill_tokens per step, and still get a chunk
    every step; once nobody decodes, the prefill takes the whole budget again."""
    s = sched(num_blocks=128, budget=64, mixed_cap=12)
    dec = make_request("dec", range(300, 304), scope("victim"), max_tokens=6)
    s.add(dec)
    run_step(s)  # dec's prompt; it decodes from now on
    long = make_request("long", range(200), scope("burst"), max_tokens=2)
    s.add(long)
    for _ in range(5):  # dec decodes in each of these steps (its last token comes at the 6th)
        out = run_step(s)
        by_id = dict(zip((r.request_id for r in out.requests), out.num_tokens, strict=True))
        assert by_id.get("dec") == 1
        assert 1 <= by_id.get("long", 0) <= 12, by_id
    assert len(dec.output_token_ids) == 6
    s.remove(dec)  # it finished
    out = run_step(s)  # nobody decodes any more: the prefill gets the whole budget
    assert out.num_tokens == [64]


def test_a_lone_prefill_gets_the_whole_budget_under_a_mixed_cap():
    s = sched(num_blocks=128, budget=64, mixed_cap=12)
    s.add(make_request("alone", range(200), scope("burst")))
    assert [run_step(s).num_tokens for _ in range(3)] == [[64], [64], [64]]


def test_a_waiting_newcomer_caps_the_prefill_steps_it_waits_behind():
    """While another request waits, a running prefill's steps are capped too, so the newcomer's
    first token waits for steps of at most the cap, not of the whole budget."""
    s = sched(num_blocks=128, budget=64, mixed_cap=12)
    long = make_request("long", range(200), scope("burst"), max_tokens=2)
    s.add(long)
    run_step(s)  # alone: the whole budget
    short = make_request("short", range(1000, 1006), scope("late"), max_tokens=2)
    s.add(short)
    out = run_step(s)  # late starts at burst's counter: not ahead yet, but the step is capped
    assert out.num_tokens == [12]
    out = run_step(s)  # burst has been served more now: it yields, and short is admitted first
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_tokens, strict=True)] == [("short", 6), ("long", 6)]
    assert short.output_token_ids


def test_a_preempted_request_still_reports_the_prompt_it_had_computed():
    """An abort bills the prompt tokens a request prefilled (engine.async_engine.prefill_report); a
    preemption resets the computed count, not the work done, so the report keeps the furthest point."""
    from engine.async_engine import prefill_report

    s = sched(num_blocks=5, budget=100)
    a = make_request("a", range(8), arrival_time=0.0)
    b = make_request("b", range(100, 108), arrival_time=1.0)
    s.add(a)
    s.add(b)
    run_step(s)  # both prompts computed
    out = run_step(s)
    assert out.preempted == [b] and b.num_computed_tokens == 0
    report = prefill_report(b)
    assert (report.prefilled_tokens, report.cached_tokens) == (8, 0)
