"""Spills on a CUDA host: KV sealed in HBM with ChaCha20-Poly1305, only ciphertext crosses the link.

The step loop queues a gather of the evicted blocks on its own stream (no host sync: the kernels
of later steps that reuse the blocks are queued after it), and records an event::

    compute stream:  ... step n ... gather(victims) ─ev─ step n+1 (may overwrite the victims) ...
    sealer stream:                       wait ev: ChaCha20 XOR → ct (HBM) ─ Poly1305(ct) ─ D2H ct → pinned
    tier worker:                                  wait for the D2H, finish the tag on the host, store

so what the step loop pays for a spill is a few kernel launches; encryption and the copy run on
the GPU's other engines and a worker thread waits for them. The ciphertext lands straight in the
pinned buffer the DRAM tier keeps (``PinnedBlob.adopt`` of an extent of its page-locked arena,
``DramTier.host_buffer``): written into host memory once, by DMA, with no page-locked allocation
on the way (that would stall the step loop's CUDA calls: ``engine.tiers.pinned_arena``).
The blob is the same as ``TenantCipher.encrypt_for_device`` makes (``engine.tiers.device_aead``),
so the restore path, and the CPU (``cryptography``) as its oracle, open it unchanged.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable

import numpy as np
import torch

from engine.tiers.device_aead import (
    DEVICE_BLOB_VERSION,
    DEVICE_HEADER_BYTES,
    TAG_BYTES,
    DevicePlaintext,
    device_blob_parts,
)
from engine.tiers.device_kv import DeviceKV
from engine.tiers.dram import PinnedBlob
from prefixgate_kernels import chacha20_poly1305 as gpu_aead
from prefixgate_kernels import chacha20_poly1305_ref as ref_aead

# Two sizes, one per class of the seal kernels' specialised ``nbytes`` (divisible by 16 or not):
# four ChaCha20 blocks and a partial one with a partial Poly1305 block, then whole blocks as every
# KV spill is (a block of K and V rows is a multiple of 16 bytes).
SELF_TEST_SIZES = (4 * 64 + 12, 16 * 64)


class DeviceSealer:
    """``SegmentSealer`` on one device. Seals take turns on one side stream (they share the link);
    the lock is held only while queueing, the wait for the device is outside it."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pin = self.device.type == "cuda"
        self._lock = threading.Lock()
        self.sealed = 0  # segments, for tests and the benchmark
        if self.device.type == "cuda":
            self.self_test()

    def self_test(self) -> None:
        """Seal a few random bytes on the device and compare with the pure-Python RFC 8439 reference.

        Run once at construction on CUDA: a device whose kernels disagree with the reference is
        refused before it seals anything, and every variant of the kernels a spill can launch is
        compiled and loaded before the first one. Without that, the first spill compiled on the
        tier worker while the step loop waited on the backlog (the H200: the step that handed the
        first run down took 47 ms; later, with one 268-byte test whose length fell in the other
        specialisation class than a spill's, one backlog wait of 0.11-0.56 s in the first spilling
        run of each process). The kernels specialise only ``nbytes`` and the word offsets (0 here
        as in every seal): ``SELF_TEST_SIZES`` has one length of each class."""
        key, aad = secrets.token_bytes(32), b"prefixgate-device-seal-self-test"
        for nbytes in SELF_TEST_SIZES:
            plain = secrets.token_bytes(nbytes)
            data = torch.frombuffer(bytearray(plain), dtype=torch.uint8).to(self.device).view(1, -1)
            raw = bytes(self._seal(key, DeviceKV(data), aad, None).view())  # not counted as a segment
            parts = device_blob_parts(raw)
            if parts is None or raw[DEVICE_HEADER_BYTES:] != ref_aead.seal(key, parts.nonce, plain, aad):
                raise RuntimeError(f"ChaCha20-Poly1305 on {self.device} disagrees with the RFC 8439 reference "
                                   f"({nbytes} bytes): device sealing refused")

    def seal(self, key: bytes, plain: DevicePlaintext, aad: bytes,
             host_buffer: Callable[[int], np.ndarray] | None = None) -> PinnedBlob:
        blob = self._seal(key, plain, aad, host_buffer)
        with self._lock:
            self.sealed += 1
        return blob

    def _seal(self, key: bytes, plain: DevicePlaintext, aad: bytes,
              host_buffer: Callable[[int], np.ndarray] | None) -> PinnedBlob:
        if not isinstance(plain, DeviceKV):
            raise TypeError("DeviceSealer seals DeviceKV")
        data = plain.data
        nbytes = data.numel()
        if nbytes % 4 or not data.is_contiguous():
            raise ValueError("device plaintext must be contiguous whole words")
        nonce = secrets.token_bytes(12)
        size = DEVICE_HEADER_BYTES + nbytes + TAG_BYTES
        host = host_buffer(size) if host_buffer is not None else torch.empty(size, dtype=torch.uint8,
                                                                             pin_memory=self._pin).numpy()
        blob = torch.from_numpy(host)  # the D2H target; pinned where ``host`` is page-locked
        sums = torch.empty(5, dtype=torch.int64, pin_memory=self._pin)
        with self._lock:
            ctx = torch.cuda.stream(self._stream) if self._stream is not None else _NoStream()
            with ctx:
                if self._stream is not None and plain.ready is not None:
                    self._stream.wait_event(plain.ready)
                # [nbytes // 4] int32 on the device: not in place, a failed put may seal the run again
                ct = torch.empty(nbytes // 4, dtype=torch.int32, device=self.device)
                launched = gpu_aead.launch_seal(key, nonce, data.view(-1).view(torch.int32), 0, nbytes, aad, ct, 0)
                blob[DEVICE_HEADER_BYTES:DEVICE_HEADER_BYTES + nbytes].copy_(ct.view(torch.uint8), non_blocking=self._pin)
                sums.copy_(launched.sums, non_blocking=self._pin)
                # blocking: the worker sleeps in the wait below instead of spinning a core through the
                # seal (the step loop's time did not change either way: docs/gpu.md, session 6 run 2)
                done = torch.cuda.Event(blocking=True) if self._stream is not None else None
                if done is not None:
                    done.record(self._stream)
        if done is not None:
            done.synchronize()  # this worker thread waits; the step loop does not
        host[:DEVICE_HEADER_BYTES] = memoryview(bytes([DEVICE_BLOB_VERSION, 0, 0, 0]) + nonce)
        host[DEVICE_HEADER_BYTES + nbytes:] = memoryview(gpu_aead.seal_tag(launched, sums.tolist()))
        return PinnedBlob.adopt(host)


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
