"""Which transport the topology gets: the receiver's advertised address and this engine's device."""

from __future__ import annotations

import pytest
import torch

from engine.disagg.api import derive_transfer_key
from engine.disagg.transport import (
    CUDA_IPC,
    SocketTransport,
    advertise,
    choose_transport,
    host_identity,
    parse_address,
    parse_receiver,
)
from engine.disagg.wire import EngineLayout

LAYOUT = EngineLayout("tiny", "float32", 16, 4, 32768)
KEY = derive_transfer_key("t")


def test_advertised_address_round_trips_and_plain_addresses_stay_plain():
    assert advertise("127.0.0.1:9", ()) == "127.0.0.1:9"
    a = parse_receiver(advertise("127.0.0.1:9", (CUDA_IPC, "host_shm")))
    assert (a.host, a.port, a.shared, a.host_id) == ("127.0.0.1", 9, (CUDA_IPC, "host_shm"), host_identity())
    assert parse_address(advertise("[::1]:7", (CUDA_IPC,))) == ("::1", 7)
    assert parse_receiver("10.0.0.2:80").shared == ()
    with pytest.raises(ValueError, match="host:port"):
        parse_address("nope;shared=cuda_ipc")


def test_cpu_engines_and_other_hosts_get_the_socket_transport():
    here = advertise("127.0.0.1:9", (CUDA_IPC,))
    assert isinstance(choose_transport(here, KEY, LAYOUT, device="cpu"), SocketTransport)
    elsewhere = "127.0.0.1:9;shared=cuda_ipc;host=0123456789abcdef"
    assert isinstance(choose_transport(elsewhere, KEY, LAYOUT, device="cuda"), SocketTransport)
    assert isinstance(choose_transport("127.0.0.1:9", KEY, LAYOUT, device="cuda:1"), SocketTransport)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_ipc_transport_refuses_without_cuda():
    from engine.disagg.shared_transport import CudaIpcTransport

    with pytest.raises(RuntimeError, match="needs a CUDA engine"):
        CudaIpcTransport("127.0.0.1:9", KEY, LAYOUT, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_engine_sending_to_a_gpu_receiver_of_this_host_gets_cuda_ipc():
    from engine.disagg.shared_transport import CudaIpcTransport

    t = choose_transport(advertise("127.0.0.1:9", (CUDA_IPC,)), KEY, LAYOUT, device="cuda")
    assert isinstance(t, CudaIpcTransport) and t.staging_device == "cuda"
