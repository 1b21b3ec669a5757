"""Which transport the topology gets, and the CUDA IPC transport's chunk layout (GPU parts GPU-only)."""

from __future__ import annotations

import pytest
import torch

from engine.disagg.api import derive_transfer_key
from engine.disagg.transport import CudaIpcTransport, SocketTransport, choose_transport
from engine.disagg.wire import EngineLayout

LAYOUT = EngineLayout("tiny", "float32", 16, 4, 32768)
KEY = derive_transfer_key("t")


def test_cpu_engines_get_the_socket_transport():
    assert isinstance(choose_transport("127.0.0.1:9", KEY, LAYOUT, device="cpu", same_host_gpu=True), SocketTransport)
    assert isinstance(choose_transport("127.0.0.1:9", KEY, LAYOUT, device="cuda", same_host_gpu=False),
                      SocketTransport)


def test_ipc_chunk_ranges_tile_the_staging_tensor():
    ranges = CudaIpcTransport.chunk_ranges(num_blocks=37, block_bytes=32768, blocks_per_chunk=16)
    assert ranges == [(0, 16 * 32768), (16 * 32768, 16 * 32768), (32 * 32768, 5 * 32768)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_ipc_transport_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaIpcTransport("127.0.0.1:9", KEY, LAYOUT, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ipc_transport_on_a_gpu_host_is_chosen_and_says_its_copy_is_not_built():
    from engine.disagg.transport import OutgoingTransfer

    t = choose_transport("127.0.0.1:9", KEY, LAYOUT, device="cuda", same_host_gpu=True)
    assert isinstance(t, CudaIpcTransport)
    with pytest.raises(NotImplementedError):
        t.send(OutgoingTransfer("x", b"t", (), (), memoryview(b"")))
