"""Hypothesis workloads: random allocate/share/free/evict at the pool level, and random
add/step/abort/preempt sequences through the whole engine, with ``check_integrity()`` after every
operation. Outputs must still equal the reference (so no block was ever read wrongly)."""

from engine_core_fakes import FakeRunner, reference_generate, scope
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prefix_index import block_hashes
from engine.protocol import GenerateRequest, SamplingParams

BS = 4
EBS = 8  # EngineConfig's smallest block size

pool_ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "free", "grow"]),
        st.integers(0, 2),  # namespace
        st.lists(st.integers(0, 2), min_size=1, max_size=14),  # tokens (tiny alphabet: many shared prefixes)
        st.integers(0, 10**6),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=pool_ops, policy=st.sampled_from(["lru", "cost"]), num_blocks=st.integers(3, 12))
def test_pool_random_ops_keep_invariants(ops, policy, num_blocks):
    pool = BlockPool(num_blocks, BS, policy)
    live: list[tuple[bytes, list[int], list[int]]] = []  # (namespace, tokens, table)
    for op, ns_i, tokens, pick in ops:
        ns = f"ns{ns_i}".encode()
        if op == "new":
            m = pool.index.match(ns, tokens)
            hashes = block_hashes(ns, tokens, BS)
            need = -(-len(tokens) // BS) - m.num_blocks
            revived = sum(1 for b in m.block_ids if pool.blocks[b].ref_cnt == 0)
            if need + revived > pool.num_free:
                continue
            pool.touch(m.block_ids, ns)
            table = list(m.block_ids) + pool.allocate(need, ns)
            for i in range(m.num_blocks, len(hashes)):
                table[i] = pool.register(table[i], hashes[i], i, table[i - 1] if i else None)
            live.append((ns, tokens, table))
        elif op == "free" and live:
            _, _, table = live.pop(pick % len(live))
            pool.free(table)
        elif op == "grow" and live:
            _, _, table = live[pick % len(live)]
            new = pool.allocate(1, live[pick % len(live)][0])
            if new is not None:
                table.extend(new)
        pool.check_integrity([t for _, _, t in live])
        assert pool.num_free + pool.num_used == num_blocks
    for _, _, table in live:
        pool.free(table)
    pool.check_integrity([])
    assert pool.num_free == num_blocks


engine_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, 2),  # tenant
            st.integers(0, 2),  # which shared base prompt
            st.integers(0, 32),  # how much of it
            st.lists(st.integers(97, 99), min_size=1, max_size=12),  # own suffix
            st.integers(1, 8),  # max_tokens
        ),
        st.tuples(
            st.just("add"),
            st.integers(0, 2),
            st.integers(0, 2),
            st.integers(0, 32),
            st.lists(st.integers(97, 99), min_size=1, max_size=12),
            st.integers(1, 8),
        ),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 10**6)),
    ),
    min_size=4,
    max_size=30,
)
BASES = [[100 + (i * k) % 50 for i in range(32)] for k in (1, 3, 7)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=engine_ops,
    policy=st.sampled_from(["lru", "cost"]),
    num_blocks=st.integers(7, 16),
    budget=st.sampled_from([8, 16, 32]),
    quota=st.sampled_from([None, 6]),
)
def test_engine_random_workload_keeps_invariants_and_outputs(ops, policy, num_blocks, budget, quota):
    runner = FakeRunner(num_kv_blocks=num_blocks, block_size=EBS)
    config = EngineConfig(
        model_dir="fake", block_size=EBS, max_num_seqs=3, max_num_batched_tokens=budget, eviction_policy=policy
    )
    engine = LLMEngine(config, runner)
    prompts: dict[str, tuple[list[int], int]] = {}
    done: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    n = 0

    def run_step():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        engine.check_integrity()

    for op in ops:
        if op[0] == "add":
            _, t, base, base_len, suffix, max_tokens = op
            prompt = BASES[base][:base_len] + suffix
            rid = f"r{n}"
            n += 1
            tenant = scope(f"t{t}", kv_block_quota=quota)
            if -(-(len(prompt) + max_tokens) // EBS) > min(num_blocks, quota or num_blocks):
                continue  # prepare() would reject it (tested elsewhere)
            engine.add_request(
                GenerateRequest(
                    rid, tenant, SamplingParams(max_tokens=max_tokens, temperature=0.0), prompt_token_ids=prompt
                )
            )
            prompts[rid] = (prompt, max_tokens)
        elif op[0] == "step":
            for _ in range(op[1]):
                run_step()
        elif engine.requests:
            rid = sorted(engine.requests)[op[1] % len(engine.requests)]
            out = engine.abort(rid)
            done.setdefault(rid, []).extend(out.new_token_ids)
            finish[rid] = "abort"
        engine.check_integrity()
    for _ in range(500):
        if not engine.has_unfinished():
            break
        run_step()
    assert not engine.has_unfinished(), "requests never finished (livelock)"
    assert engine.cache.num_used == 0 and engine.cache.num_free == num_blocks
    for rid, (prompt, max_tokens) in prompts.items():
        expected = reference_generate(prompt, max_tokens)
        got = done.get(rid, [])
        if finish[rid] == "abort":
            assert got == expected[: len(got)]
        else:
            assert finish[rid] == "length" and got == expected
