"""The serving process's start-up heap leaves the cyclic collector while the app runs (gateway.startup_heap)."""

from __future__ import annotations

import gc
import weakref

from fastapi.testclient import TestClient

from gateway.startup_heap import freeze_startup_heap, thaw_startup_heap


class _Node:
    pass


def test_frozen_objects_are_not_walked_until_thawed():
    n = _Node()
    n.self = n  # a reference cycle: only the cyclic collector can free it
    gone = weakref.ref(n)
    try:
        frozen = freeze_startup_heap()
        # Frozen objects can only leave the permanent generation (freed by refcount, in any of the
        # process's threads: earlier tests' daemon threads free theirs at any time), never join it
        # without another freeze: the count reported is the most there can be, not an exact match later.
        assert frozen.objects >= gc.get_freeze_count() > 0.99 * frozen.objects
        del n
        gc.collect()
        assert gone() is not None  # frozen: full collections do not look at it
    finally:
        thaw_startup_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # back in the oldest generation and collected


def test_the_lifespan_freezes_with_its_own_engine_and_thaws_at_stop(tmp_path, tiny_model_dir):
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    assert gc.get_freeze_count() == 0
    app = create_app(GatewaySettings(home=tmp_path, model="tiny", model_dir=tiny_model_dir, kv_blocks=64))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() > 10_000  # torch, the model and the gateway at least
    assert gc.get_freeze_count() == 0


def test_an_injected_engine_leaves_the_collector_alone():
    from gateway_fakes import FakeEngine

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    with TestClient(create_app(GatewaySettings(), engine=FakeEngine())) as client:
        assert client.get("/health").status_code == 200
        assert gc.get_freeze_count() == 0
