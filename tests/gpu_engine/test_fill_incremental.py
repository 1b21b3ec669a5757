"""DecodeGraphs.fill rewrites only the block-table rows that changed: across steps whose batches
reorder, drop and add sequences and cross block boundaries, the padded static-buffer path (run
eagerly on CPU) still gives the eager forward's logits, so every row the kernels read is right."""

from __future__ import annotations

import torch

from engine.batch import ScheduledBatch, SequenceChunk
from tests.gpu_engine.helpers import GREEDY, small_runner


def test_incremental_block_tables_follow_batch_changes(tmp_path):
    runner = small_runner(tmp_path, "cpu")
    graphs = runner.decode_graphs
    assert graphs is None  # CPU: no captured graphs; build the padded static-buffer path by hand
    from engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(runner.model, runner.layer_caches, runner.ops, runner.block_size, max_blocks_per_seq=8,
                          sizes=(1, 2, 4, 8), device=torch.device("cpu"))
    tables = {"a": [3, 9, 4, 20], "b": [7, 8, 30], "c": [10, 11, 12, 13, 40]}
    lens = {"a": 30, "b": 14, "c": 62}  # prompt lengths: b crosses into its 2nd block, c into its 5th
    for name, n in lens.items():
        prompt = [(5 * i + ord(name)) % 500 for i in range(n)]
        runner.execute(ScheduledBatch([SequenceChunk(name, prompt, 0, tables[name], True, GREEDY)]))
    pos = dict(lens)
    orders = [["a", "b", "c"], ["c", "a"], ["b", "c", "a"], ["a", "c"], ["a", "b", "c"], ["c", "b", "a"], ["b"]]
    for step, order in enumerate(orders):
        if step == 4:
            assert pos["a"] // 16 == 2  # a is writing its 3rd block (id 4) at this step
            tables["a"] = [3, 9, 21, 20]  # copy-on-write replaced it: a's row must be rewritten
            runner.kv_cache[21] = runner.kv_cache[4]
            runner.kv_cache[4].normal_()  # the old block now holds another sequence's data
        chunks = [SequenceChunk(r, [(step * 13 + ord(r)) % 500], pos[r], tables[r], True, GREEDY) for r in order]
        eager = runner.forward(ScheduledBatch(chunks), all_logits=True).clone()
        padded = graphs.run(chunks).clone()
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4, msg=f"step {step} {order}")
        for r in order:
            pos[r] += 1
