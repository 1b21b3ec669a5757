"""Issue #17, session 6 round 2: per-request work the front door no longer does, pinned to what it did.

As in ``test_front_door_cuts.py``: each test compares the cheaper path with the code it replaced
(kept here as the oracle where it fits), so a cut that changed a value fails here, not only in the
benchmark.
"""

from __future__ import annotations

import os
import re
import threading

import pytest

from gateway import pipeline
from gateway.pipeline import new_request_id

# -- request ids: cut from one os.urandom read instead of one read (a GIL release) per request ---------

_ID = {"chat": re.compile(r"chatcmpl-[0-9a-f]{32}"), "completion": re.compile(r"cmpl-[0-9a-f]{32}")}


def _old_request_id(kind: str) -> str:
    """The previous ``new_request_id``: one ``os.urandom(16)`` per id."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + os.urandom(16).hex()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_request_id_has_the_old_shape(kind: str) -> None:
    assert _ID[kind].fullmatch(_old_request_id(kind))
    for _ in range(3 * pipeline._IDS_PER_READ):  # across refills
        assert _ID[kind].fullmatch(new_request_id(kind))


def test_request_ids_are_unique_across_batches_and_threads() -> None:
    ids: list[list[str]] = [[] for _ in range(8)]

    def draw(out: list[str]) -> None:
        out.extend(new_request_id("chat") for _ in range(5 * pipeline._IDS_PER_READ))

    threads = [threading.Thread(target=draw, args=(out,)) for out in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for out in ids for i in out]
    assert len(set(every)) == len(every) == 8 * 5 * pipeline._IDS_PER_READ


def test_request_ids_look_random() -> None:
    """Each hex digit about equally often (a slicing error would repeat or skip digits)."""
    digits = "".join(new_request_id("chat")[len("chatcmpl-"):] for _ in range(4 * pipeline._IDS_PER_READ))
    counts = [digits.count(d) for d in "0123456789abcdef"]
    expected = len(digits) / 16
    assert all(abs(c - expected) < 0.1 * expected for c in counts), counts


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_the_parents_ids() -> None:
    new_request_id("chat")  # the parent holds a batch with unread ids
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, "\n".join(new_request_id("chat") for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split("\n"))
    os.waitpid(pid, 0)
    parent = {new_request_id("chat") for _ in range(50)}
    assert len(child) == 50
    assert not child & parent
