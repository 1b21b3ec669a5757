"""Restores on a CUDA host: ``DeviceAeadOpener`` (decrypt in HBM) and ``PinnedHostOpener`` (its
fallback and oracle: decrypt on CPU threads into pinned memory). Both return the plaintext as a
uint8 device tensor ``[blocks, block_bytes]`` that ``runner.import_blocks`` scatters into the pool.

DeviceAeadOpener, for ChaCha20-Poly1305 blobs (``engine.tiers.device_aead``)::

    copy stream:    H2D blob 0 ─ev0─ H2D blob 1 ─ev1─ H2D blob 2 ─ev2─ ...      (ciphertext over the link)
    opener stream:        wait ev0: Poly1305 + ChaCha20(blob 0) ─ wait ev1: ... (prefixgate_kernels.chacha20_poly1305)
    host:           one read of every blob's 5 limb sums, then each tag is finished and compared

so decryption overlaps the copy of the next segment, and the only host sync is that read. The
wanted blocks are decrypted straight into the output; a blob whose tag fails ends the result there
(its bytes and everything after it are not returned).

PinnedHostOpener: every segment decrypted on a thread pool (``cryptography`` releases the GIL)
straight into one reused pinned staging buffer (``decrypt_into``), each H2D copy queued as soon as
its segment is done, in chain order, so the copies of early segments overlap the decryption of
later ones.
"""

from __future__ import annotations

import secrets
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine.protocol import BlockCipher
from engine.tiers.device_aead import (
    DEVICE_BLOB_VERSION,
    DEVICE_HEADER_BYTES,
    DeviceBlobParts,
    DeviceSealingCipher,
    device_blob_parts,
)
from engine.tiers.opener import DecryptsInto, OpenedRuns, SealedRun
from prefixgate_kernels import chacha20_poly1305 as gpu_aead
from prefixgate_kernels import chacha20_poly1305_ref as ref_aead

# A stored blob reaches this module as a read-only memoryview of the tier's page-locked memory, and
# ``torch.frombuffer`` of it only feeds a host-to-device copy; PyTorch warns once per process that
# the tensor could write to a read-only buffer, which nothing here does. Silenced for this module
# only (set once at import, so no thread changes the warning filters while restores run).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


def _new_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class _StreamCtx:
    """``torch.cuda.stream(s)``, or nothing on the CPU (the interpreter tests run these openers there)."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self._ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


class PinnedHostOpener:
    """``SegmentOpener``: parallel CPU decryption into pinned buffers, H2D copies pipelined behind it.

    The pinned staging buffer is allocated once and grown when a restore needs more, and a cipher
    that ``DecryptsInto`` writes each whole segment's plaintext straight into it: the first run on
    the H200 allocated a fresh pinned buffer and a plaintext copy per segment, and those fresh pages
    (first touch, in a VM) made a 2 GiB restore take ~4.1 s instead of ~0.15 s. Restores through one
    opener take turns on that buffer (a lock); they share one host link anyway.
    """

    def __init__(self, device: torch.device | str, *, threads: int = 8):
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-open")
        self._copy = _new_stream(self.device)
        self._pin = self.device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._lock = threading.Lock()

    def _stage(self, nbytes: int) -> np.ndarray:
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        return self._staging.numpy()

    @staticmethod
    def _decrypt(cipher: BlockCipher, run: SealedRun, block_bytes: int, into: np.ndarray) -> bool:
        """Plaintext of the run's wanted blocks into ``into`` (their length); False on a bad tag."""
        if isinstance(cipher, DecryptsInto) and run.first == 0 and run.count == run.num_blocks:
            # .data is memoryview(into): numpy's stubs give ndarray the buffer protocol for Python 3.12+ only
            return cipher.decrypt_into(run.blob, run.aad, into.data)
        plain = cipher.decrypt(run.blob, run.aad)
        if plain is None or len(plain) != run.num_blocks * block_bytes:
            return False
        into[:] = np.frombuffer(plain, np.uint8, run.count * block_bytes, run.first * block_bytes)
        return True

    def open_runs(self, cipher: BlockCipher, runs: Sequence[SealedRun], block_bytes: int) -> OpenedRuns:
        total = sum(r.count for r in runs)
        with self._lock:
            staging = self._stage(total * block_bytes)
            starts = np.cumsum([0] + [r.count for r in runs]) * block_bytes
            futures: list[Future[bool]] = [
                self._pool.submit(self._decrypt, cipher, r, block_bytes, staging[starts[i]:starts[i + 1]])
                for i, r in enumerate(runs)]
            ok = 0
            with _StreamCtx(self._copy):
                out = torch.empty(total, block_bytes, dtype=torch.uint8, device=self.device)
                flat = out.view(-1)
                for fut in futures:  # in chain order: each copy starts once its segment is decrypted
                    if not fut.result():
                        break
                    a, b = int(starts[ok]), int(starts[ok + 1])
                    flat[a:b].copy_(self._staging[a:b], non_blocking=self._pin)
                    ok += 1
            for fut in futures[ok + 1:]:
                fut.cancel()
            for fut in futures:  # nobody may still be writing into the staging buffer
                if not fut.cancelled():
                    fut.exception()
            if self._copy is not None:
                self._copy.synchronize()
        return OpenedRuns(ok, out[:sum(r.count for r in runs[:ok])])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _reference_blob(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """A device blob (``engine.tiers.device_aead``'s layout) sealed by the pure-Python RFC 8439 reference."""
    nonce = secrets.token_bytes(12)
    return bytes([DEVICE_BLOB_VERSION, 0, 0, 0]) + nonce + ref_aead.seal(key, nonce, plaintext, aad)


# The self-test's segments: (blocks in the segment, first wanted, count), of 64-byte blocks: a whole
# segment and a run from inside a longer one (a plaintext offset, a second blob in the staging buffer
# and a second output row: every offset class an open launches with, ``DeviceAeadOpener.self_test``).
SELF_TEST_RUNS = ((2, 0, 2), (3, 1, 2))
SELF_TEST_BLOCK_BYTES = 64


class DeviceAeadOpener:
    """``SegmentOpener``: ChaCha20-Poly1305 blobs opened in HBM; other blobs, or a cipher without a
    device key, go to ``fallback`` (a ``PinnedHostOpener`` on the same device by default)."""

    def __init__(self, device: torch.device | str, *, fallback: PinnedHostOpener | None = None):
        self.device = torch.device(device)
        self.fallback = fallback or PinnedHostOpener(self.device)
        self._copy = _new_stream(self.device)
        self._work = _new_stream(self.device)
        self.opened_on_device = 0  # segments, for tests and the benchmark
        self.opened_on_host = 0
        if self.device.type == "cuda":
            self.self_test()

    def self_test(self) -> None:
        """Open segments the pure-Python RFC 8439 reference sealed and compare with their plaintext.

        Run once at construction on CUDA: a device whose kernels disagree with the reference is
        refused before it opens anything, and every variant of the kernels a restore launches is
        compiled before the first one. The kernels specialise their word offsets and lengths (each
        equal to 1, divisible by 16 or neither): a ciphertext starts 4 words into its 64-byte-aligned
        blob, a plaintext offset and an output row are whole 64-byte blocks, so ``SELF_TEST_RUNS``
        launches with the one class of each that any restore of whole blocks does. The sealer's
        self-test does not cover these: a seal's offsets are all word 0 (its ciphertext goes to a
        buffer of its own). Not counted in ``opened_on_device``."""
        key, bb = secrets.token_bytes(32), SELF_TEST_BLOCK_BYTES
        runs, parts, wanted = [], [], []
        for i, (blocks, first, count) in enumerate(SELF_TEST_RUNS):
            plain, aad = secrets.token_bytes(blocks * bb), f"prefixgate-device-open-self-test-{i}".encode()
            blob = _reference_blob(key, plain, aad)
            blob_parts = device_blob_parts(blob)
            assert blob_parts is not None  # the layout this module parses
            runs.append(SealedRun(blob, aad, blocks, first, count))
            parts.append(blob_parts)
            wanted.append(plain[first * bb:(first + count) * bb])
        opened = self._open_on_device(key, runs, parts, bb)
        data = opened.data
        got = data.cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
        if opened.ok != len(runs) or got != b"".join(wanted):
            raise RuntimeError(f"ChaCha20-Poly1305 opened on {self.device} disagrees with the RFC 8439 reference: "
                               "device opening refused")

    def open_runs(self, cipher: BlockCipher, runs: Sequence[SealedRun], block_bytes: int) -> OpenedRuns:
        key = cipher.device_key() if isinstance(cipher, DeviceSealingCipher) else None
        parts = [device_blob_parts(r.blob) for r in runs]
        whole = [p for p, r in zip(parts, runs, strict=True) if p is not None and p.ct_len == r.num_blocks * block_bytes]
        if key is None or block_bytes % 64 or not runs or len(whole) != len(runs):
            self.opened_on_host += len(runs)
            return self.fallback.open_runs(cipher, runs, block_bytes)
        opened = self._open_on_device(key, runs, whole, block_bytes)
        self.opened_on_device += len(runs)
        return opened

    def _open_on_device(self, key: bytes, runs: Sequence[SealedRun], parts: Sequence[DeviceBlobParts],
                        block_bytes: int) -> OpenedRuns:
        """``open_runs`` for device blobs under ``key`` (``parts``: each run's), ``block_bytes`` a multiple of 64."""
        # staging: every blob at a 64-byte-aligned offset of one device buffer, viewed as int32 words
        offsets, size = [], 0
        for r in runs:
            offsets.append(size)
            size += -(-len(r.blob) // 64) * 64
        spans, launched, row = [], [], 0
        with _StreamCtx(self._copy):
            staging = torch.empty(size, dtype=torch.uint8, device=self.device)
            out = torch.empty(sum(r.count for r in runs), block_bytes, dtype=torch.uint8, device=self.device)
            events: list[torch.cuda.Event | None] = []
            for r, off in zip(runs, offsets, strict=True):
                staging[off:off + len(r.blob)].copy_(torch.frombuffer(r.blob, dtype=torch.uint8), non_blocking=True)
                ev = None
                if self._copy is not None:
                    ev = torch.cuda.Event()
                    ev.record(self._copy)
                events.append(ev)
        words, out_words = staging.view(torch.int32), out.view(-1).view(torch.int32)
        with _StreamCtx(self._work):
            for r, p, off, ev in zip(runs, parts, offsets, events, strict=True):
                if ev is not None:  # on CUDA, where both streams exist: self._work.wait_event(ev)
                    ev.wait(self._work)
                span = gpu_aead.SealedSpan(p.nonce, (off + DEVICE_HEADER_BYTES) // 4, p.ct_len, p.tag, r.aad,
                                           row * block_bytes // 4, plain_from=r.first * block_bytes,
                                           plain_bytes=r.count * block_bytes)
                spans.append(span)
                launched.append(gpu_aead.launch_span(key, words, span, out_words))
                row += r.count
            good = gpu_aead.check_tags(spans, launched)  # the one sync (waits for this stream)
        if self._work is not None:
            for t in (staging, out):
                t.record_stream(self._work)
        ok = next((i for i, g in enumerate(good) if not g), len(good))
        return OpenedRuns(ok, out[:sum(r.count for r in runs[:ok])])

    def close(self) -> None:
        self.fallback.close()
