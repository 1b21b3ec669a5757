"""Which Triton kernels a stretch of code compiles: a compile on a worker thread is a stall.

Triton calls ``knobs.runtime.jit_cache_hook`` before it compiles (or loads from its disk cache) a
launch it holds no kernel for, on whichever thread launches. ``CompileRecorder`` sets that hook for a
while and keeps the kernels' names: the tier benchmark counts the compiles in each stepload run, a
test asserts that spills compile nothing after the sealer's self-test. Triton's interpreter
compiles nothing, so on the CPU the list stays empty. One recorder at a time (the hook is global).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from types import TracebackType

import triton
import triton.runtime.jit as _triton_jit


class CompileRecorder:
    """``kernels``: the name and specialised signature of every launch compiled between ``start``
    and ``stop`` (or inside ``with``), in order, by any thread. ``specializations``: for each, what
    Triton keyed the compile on (its serialised signature, constexprs and per-argument attributes such
    as an integer's divisibility by 16, or the cache key where a Triton gives no such record): two
    compiles of one kernel differ there, which says which argument made the second one."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self.specializations: list[str] = []
        self._lock = threading.Lock()  # compiles come on any launching thread; drain() reads on another
        self._previous: object = None
        self._serializer: Callable[..., str] | None = None
        self._on = False

    def _record(self, **kw: object) -> None:  # None: the launch goes on
        compile_args = kw.get("compile")
        data = compile_args.get("specialization_data") if isinstance(compile_args, dict) else None
        keyed_on = _what_it_keys_on(data) if isinstance(data, str) else str(kw.get("key"))
        with self._lock:
            self.kernels.append(str(kw["repr"]))
            self.specializations.append(keyed_on)

    def drain(self) -> list[tuple[str, str]]:
        """(kernel, specialization) of each compile recorded since the last drain, and forget them."""
        with self._lock:
            out = list(zip(self.kernels, self.specializations, strict=True))
            self.kernels, self.specializations = [], []
        return out

    def start(self) -> None:
        self._previous, self._on = triton.knobs.runtime.jit_cache_hook, True
        triton.knobs.runtime.jit_cache_hook = self._record
        # With any hook set, Triton serialises each compile's specialization to JSON before calling it,
        # and Triton 3.6 cannot serialise a Gluon layout constexpr: the Hopper prefill's launch raised
        # TypeError under the recorder (session 40). While recording, that serialiser falls back to
        # text for what JSON cannot hold; stop() puts the original back.
        self._serializer = getattr(_triton_jit, "serialize_specialization_data", None)
        if self._serializer is not None:
            _triton_jit.serialize_specialization_data = _tolerant(self._serializer)

    def stop(self) -> None:
        """Put the previous hook back; a no-op when not started (safe in a ``finally``)."""
        if self._on:
            triton.knobs.runtime.jit_cache_hook, self._on = self._previous, False
            if self._serializer is not None:
                _triton_jit.serialize_specialization_data = self._serializer

    def __enter__(self) -> CompileRecorder:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# The parts of Triton's serialised specialization that tell two compiles of one kernel apart (its
# options and target are the same for every launch of a process, and long).
_KEYED_ON = ("signature", "constant_keys", "constant_vals", "attrs_keys", "attrs_vals")


def _what_it_keys_on(data: str) -> str:
    try:
        parsed = json.loads(data)
    except ValueError:
        return data
    if not isinstance(parsed, dict):
        return data
    return json.dumps({k: parsed[k] for k in _KEYED_ON if k in parsed}, separators=(",", ":"))


def _tolerant(serialize: Callable[..., str]) -> Callable[..., str]:
    """Triton's ``serialize_specialization_data`` (name, signature, constexprs, attributes, ...), with
    the constexprs and attributes as text where JSON cannot hold them (a Gluon layout)."""

    def serialize_or_describe(*args: object, **kwargs: object) -> str:
        try:
            return serialize(*args, **kwargs)
        except TypeError:
            named = dict(zip(("name", "signature", "constants", "attrs"), args)) | kwargs
            name, signature, constants, attrs = (named.get(k) for k in ("name", "signature", "constants", "attrs"))
            consts = constants if isinstance(constants, dict) else {}
            attributes = attrs if isinstance(attrs, dict) else {}
            return json.dumps({"name": str(name), "signature": signature,
                               "constant_keys": [str(k) for k in consts], "constant_vals": [str(v) for v in consts.values()],
                               "attrs_keys": [str(k) for k in attributes],
                               "attrs_vals": [str(v) for v in attributes.values()]}, default=str)

    return serialize_or_describe
