"""``prefixgate_kernels.jit_watch.CompileRecorder``: it holds Triton's compile hook only while recording, lets
every launch go on, and puts back whatever hook was set before it (on the GPU, the tier tests and the
stepload use it to count real compiles)."""

from __future__ import annotations

import pytest
import triton

from prefixgate_kernels.jit_watch import CompileRecorder


def test_the_recorder_keeps_launches_going_and_restores_the_previous_hook():
    seen: list[str] = []

    def earlier(**kw: object) -> None:
        seen.append(str(kw["repr"]))

    triton.knobs.runtime.jit_cache_hook = earlier
    try:
        with CompileRecorder() as rec:
            hook = triton.knobs.runtime.jit_cache_hook
            assert hook is not earlier
            # what Triton passes before compiling; a truthy return would skip the launch
            assert hook(key=("k",), repr="_kernel[num_warps=4](x: *fp32)", fn=None, compile={},
                        is_manual_warmup=False, already_compiled=False) is None
            # with Triton's serialised specialization, that is what is kept; without one, the cache key
            assert hook(key=("k2",), repr="_kernel[num_warps=4](x: *fp32, n: i32)", fn=None,
                        compile={"specialization_data": '{"name": "k", "attrs_vals": [[["tt.divisibility", 16]]], '
                                                        '"options": {"num_warps": 4}}'},
                        is_manual_warmup=False, already_compiled=False) is None
        assert rec.kernels == ["_kernel[num_warps=4](x: *fp32)", "_kernel[num_warps=4](x: *fp32, n: i32)"]
        # the options and the target are left out: the same for every launch of a process
        assert rec.specializations == ["('k',)", '{"attrs_vals":[[["tt.divisibility",16]]]}']
        assert rec.drain() == [("_kernel[num_warps=4](x: *fp32)", "('k',)"),
                               ("_kernel[num_warps=4](x: *fp32, n: i32)", '{"attrs_vals":[[["tt.divisibility",16]]]}')]
        assert rec.drain() == [] and rec.kernels == []
        assert triton.knobs.runtime.jit_cache_hook is earlier
        rec.stop()  # a second stop changes nothing
        assert triton.knobs.runtime.jit_cache_hook is earlier
        assert seen == []  # the earlier hook was not called while the recorder held the place
    finally:
        triton.knobs.runtime.jit_cache_hook = None


def test_the_recorder_lets_a_compile_with_an_unserialisable_constexpr_through():
    # Triton 3.6 serialises every compile's specialization while a hook is set, and a Gluon layout
    # constexpr made that raise under the recorder; the recorder's stand-in describes it as text
    import inspect
    from types import SimpleNamespace

    import triton.runtime.jit as triton_jit

    class Layout:  # not JSON-serialisable, like a Gluon NVMMASharedLayout
        def __repr__(self) -> str:
            return "Layout(swizzle=128)"

    original = triton_jit.serialize_specialization_data
    values = {"name": "k", "signature": {"x": "*fp16"}, "attrs": {}, "options": SimpleNamespace(num_warps=4),
              "key": "key", "target": SimpleNamespace(backend="cuda")}
    params = list(inspect.signature(original).parameters)  # this Triton's own argument list

    def call(serialize, constants):
        return serialize(**{p: constants if p == "constants" else values[p] for p in params})

    with pytest.raises(TypeError):
        call(original, {("L",): Layout()})
    with CompileRecorder():
        text = call(triton_jit.serialize_specialization_data, {("L",): Layout()})
        assert '"constant_vals": ["Layout(swizzle=128)"]' in text and '"name": "k"' in text
        # what JSON holds goes through Triton's own serialiser unchanged
        plain = call(triton_jit.serialize_specialization_data, {("N",): 3})
        assert plain == call(original, {("N",): 3})
    assert triton_jit.serialize_specialization_data is original
