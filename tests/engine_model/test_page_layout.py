"""The KV pool laid out head by head (``kv_page_layout="head"``, the GPU's default) against token by token:
the same tokens, the same cached values, and blocks that travel between the two in one format."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_layout import KVPageLayout
from tests.engine_model.driver import BlockAllocator, Seq, blocks_needed, run


def test_layout_views():
    layout = KVPageLayout.HEAD
    assert layout.block_shape(2, 8, 3, 4) == (2, 2, 3, 8, 4)
    assert KVPageLayout.TOKEN.block_shape(2, 8, 3, 4) == (2, 2, 8, 3, 4)
    pages = torch.randn(5, *layout.block_shape(2, 8, 3, 4))
    view = layout.token_view(pages)
    assert view.shape == (5, 2, 2, 8, 3, 4) and view.data_ptr() == pages.data_ptr()
    assert torch.equal(view[1, 0, 1, 6, 2], pages[1, 0, 1, 2, 6])  # slot 6 of KV head 2
    plain = torch.randn(5, *KVPageLayout.TOKEN.block_shape(2, 8, 3, 4))
    assert KVPageLayout.TOKEN.token_view(plain) is plain
    assert KVPageLayout.for_device(torch.device("cpu")) is KVPageLayout.TOKEN
    assert KVPageLayout.for_device(torch.device("cuda", 0)) is KVPageLayout.HEAD


def test_config_rejects_an_unknown_layout(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_page_layout must be one of auto/token/head"):
        EngineConfig(model_dir=tiny_model_dir, kv_page_layout="heads")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_head_major_pool_decodes_and_exports_as_the_token_pool(kv_dtype, tiny_model_dir, runner_cache):
    token = runner_cache(tiny_model_dir, kv_dtype=kv_dtype)
    head = runner_cache(tiny_model_dir, kv_dtype=kv_dtype, kv_page_layout="head")
    assert (token.kv_layout, head.kv_layout) == (KVPageLayout.TOKEN, KVPageLayout.HEAD)
    assert head.kv_pages.is_contiguous() and not head.kv_cache.is_contiguous()
    outs, tables = [], []
    for runner in (token, head):
        alloc = BlockAllocator(runner.num_kv_blocks, seed=4)
        seqs = [Seq(f"s{i}", list(range(3000 + 40 * i, 3000 + 40 * i + n)), []) for i, n in enumerate((13, 29))]
        for s in seqs:
            s.block_table = alloc.take(blocks_needed(len(s.tokens) + 6, runner.block_size))
        outs.append(run(runner, seqs, max_new=6, chunk=8))  # chunked prefill, then decodes
        tables.append(seqs[1].block_table)
    assert outs[0] == outs[1]
    assert tables[0] == tables[1]  # the same scrambled ids: the same blocks hold the same tokens
    ids = tables[0][:3]
    data = token.export_blocks(ids)
    assert torch.equal(head.export_blocks(ids), data)  # blocks leave either pool in token order
    assert torch.equal(head.gather_blocks_async(ids).cpu(), data)  # the device-spill copy: a run of ids
    assert torch.equal(head.gather_blocks_async(ids[1:2]).cpu(), data[1:2])  # and one block (the slice copy)
    # a block exported by the token pool imports into the head pool as the same values
    spare = [b for b in range(head.num_kv_blocks) if b not in tables[0]][:3]
    head.import_blocks(spare, data)
    assert torch.equal(head.kv_cache[spare], token.kv_cache[ids])
    assert torch.equal(head.export_blocks(spare), data)


def test_block_copies_move_whole_head_major_blocks(tiny_model_dir, runner_cache):
    from engine.batch import BlockCopy

    head = runner_cache(tiny_model_dir, kv_page_layout="head")
    head.kv_cache[5].normal_()
    head.kv_cache[6].normal_()
    head.copy_blocks([BlockCopy(src=5, dst=9), BlockCopy(src=6, dst=10)])
    assert torch.equal(head.kv_cache[9], head.kv_cache[5]) and torch.equal(head.kv_cache[10], head.kv_cache[6])
