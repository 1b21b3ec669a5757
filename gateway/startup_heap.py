"""Freeze the serving process's start-up heap out of the cyclic garbage collector.

A process that serves a local engine holds ~0.4 million GC-tracked objects once torch, the model,
the kernels and the gateway are loaded (the tiny model on CPU: 370-450 thousand). CPython's
collector walks all of them in every full (generation 2) collection, which it starts by itself
whenever the long-lived objects have grown by a quarter since the last one: on the 2-core build
machine that walk takes ~150 ms (``benchmarks/gc_pause.py``), during which the engine's step loop
and the event loop both wait for the GIL, i.e. a 150 ms hole in every stream's token cadence.

Nothing made during start-up becomes garbage later in a way the collector is needed for (the
model, compiled kernels, modules, the block pool live as long as the process), so after one
collection they move to the permanent generation (``gc.freeze``): later collections walk only
what serving made. vLLM's engine does the same after its start-up. ``thaw_startup_heap`` undoes it
when the app stops (a process that goes on after its app, such as a test run, collects normally).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrozenHeap:
    objects: int  # objects in the permanent generation after the freeze
    collect_ms: float  # the one full collection before it


def freeze_startup_heap() -> FrozenHeap:
    """Collect once (start-up's own garbage goes first), then freeze everything that is left."""
    t0 = time.perf_counter()
    gc.collect()
    collect_ms = 1e3 * (time.perf_counter() - t0)
    gc.freeze()
    frozen = FrozenHeap(objects=gc.get_freeze_count(), collect_ms=collect_ms)
    log.info("start-up heap frozen: %d objects out of the cyclic collector (its last full pass took %.0f ms)",
             frozen.objects, frozen.collect_ms)
    return frozen


def thaw_startup_heap() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()
