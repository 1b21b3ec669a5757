"""StaticInputs (engine/graph_inputs.py): named views into one host and one device byte buffer, written
through flat memoryviews, copied per buffer or in one copy."""

from __future__ import annotations

from array import array

import pytest
import torch

from engine.graph_inputs import StaticInputs

SHAPES = {
    "ids": ((5,), torch.int64),  # 40 bytes: the next buffer starts on the next 64-byte line
    "table": ((2, 3), torch.int32),
    "lens": ((3,), torch.int32),
    "last": ((1,), torch.int64),
}


def make() -> StaticInputs:
    return StaticInputs(SHAPES, torch.device("cpu"))


def test_views_have_their_shapes_and_do_not_overlap():
    s = make()
    for k, (shape, dtype) in SHAPES.items():
        assert s.host[k].shape == shape and s.host[k].dtype == dtype
        assert s.dev[k].shape == shape and s.dev[k].dtype == dtype
        assert s.host[k].data_ptr() % 64 == 0
    for i, k in enumerate(SHAPES):
        s.host[k].fill_(i + 1)
    for i, k in enumerate(SHAPES):
        assert bool((s.host[k] == i + 1).all()), f"{k} was overwritten by another buffer"


def test_words_write_the_host_buffers():
    s = make()
    ids, table = s.words("ids"), s.words("table")
    assert (ids.format, len(ids)) == ("q", 5)
    assert (table.format, len(table)) == ("i", 6)  # flat, row-major
    ids[1:4] = array("q", [7, -1, 2**40])
    table[3:6] = array("i", [9, 8, -5])
    s.words("last")[0] = 11
    assert s.host["ids"].tolist() == [0, 7, -1, 2**40, 0]
    assert s.host["table"].tolist() == [[0, 0, 0], [9, 8, -5]]
    assert s.host["last"].tolist() == [11]
    with pytest.raises(ValueError):  # a slice takes exactly as many elements as it spans
        ids[0:2] = array("q", [1, 2, 3])
    with pytest.raises(ValueError):  # and of its own type
        ids[0:2] = array("i", [1, 2])
    assert s.host["ids"].tolist() == [0, 7, -1, 2**40, 0]  # a refused write wrote nothing


def test_copy_all_moves_every_buffer_and_copy_the_leading_rows_only():
    s = make()
    s.words("ids")[:] = array("q", range(10, 15))
    s.words("table")[:] = array("i", range(6))
    s.words("lens")[:] = array("i", [4, 5, 6])
    s.copy({"ids": 2, "table": 1})
    assert s.dev["ids"].tolist() == [10, 11, 0, 0, 0]
    assert s.dev["table"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert s.dev["lens"].tolist() == [4, 5, 6]  # not named: whole
    s.copy_all()
    for k in SHAPES:
        assert torch.equal(s.dev[k], s.host[k]), k


def test_copy_through_moves_the_small_buffers_whole_and_the_last_ones_leading_rows():
    s = StaticInputs({"ids": ((3,), torch.int64), "lens": ((3,), torch.int32), "table": ((4, 5), torch.int32)},
                     torch.device("cpu"))
    s.words("ids")[:] = array("q", [7, 8, 9])
    s.words("lens")[:] = array("i", [1, 2, 3])
    s.words("table")[:] = array("i", range(20))
    s.copy_through("table", 2)
    assert s.dev["ids"].tolist() == [7, 8, 9] and s.dev["lens"].tolist() == [1, 2, 3]
    assert s.dev["table"].tolist() == [list(range(10))[:5], list(range(5, 10)), [0] * 5, [0] * 5]
    s.copy_through("table", 9)  # more rows than the buffer has: all of them
    assert s.dev["table"].tolist() == s.host["table"].tolist()
    with pytest.raises(ValueError, match="last buffer"):
        s.copy_through("lens", 1)
