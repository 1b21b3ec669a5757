"""Which Triton kernels a stretch of code compiles: a compile on a worker thread is a stall.

Triton calls ``knobs.runtime.jit_cache_hook`` before it compiles (or loads from its disk cache) a
launch it holds no kernel for, on whichever thread launches. ``CompileRecorder`` sets that hook for a
while and keeps the kernels' names: the tier benchmark counts the compiles in each stepload run, a
test asserts that spills compile nothing after the sealer's self-test. Triton's interpreter
compiles nothing, so on the CPU the list stays empty. One recorder at a time (the hook is global).
"""

from __future__ import annotations

from types import TracebackType

import triton


class CompileRecorder:
    """``kernels``: the name and specialised signature of every launch compiled between ``start``
    and ``stop`` (or inside ``with``), in order, by any thread."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._previous: object = None
        self._on = False

    def _record(self, **kw: object) -> None:  # None: the launch goes on
        self.kernels.append(str(kw["repr"]))

    def start(self) -> None:
        self._previous, self._on = triton.knobs.runtime.jit_cache_hook, True
        triton.knobs.runtime.jit_cache_hook = self._record

    def stop(self) -> None:
        """Put the previous hook back; a no-op when not started (safe in a ``finally``)."""
        if self._on:
            triton.knobs.runtime.jit_cache_hook, self._on = self._previous, False

    def __enter__(self) -> CompileRecorder:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
