"""One engine process of ``benchmarks/pd.py --nodes engine``: a ``DisaggEngine`` with a random-weight
model, driven over a local ``multiprocessing.connection`` instead of HTTP.

Why not ``prefixgate serve``: the 8B-shaped model has no checkpoint on disk (its random bf16
weights are built on the GPU in a second, as in benchmarks/engine_gpu.py; writing and loading
16 GB twice would cost minutes of device time), and the GPU machines carry the engine's packages
but not the gateway's. Everything under the connection is the real split: the engine thread,
``prefill_and_send``, the transport ``choose_transport`` picks (CUDA IPC between GPU engines of
one host), the receiver's checks and ``import_chain``.

    python benchmarks/pd_node.py --role prefill|decode --device cuda[:N] --shape 8b|small
                                 --kv-blocks N --max-model-len N --authkey-env VAR

Prints ``READY <port>`` once listening on 127.0.0.1. Messages (pickled, authenticated by the key):
    driver -> node  (op, call_id, *args)   op: generate | prefill | lookup | address | integrity | compiles | stop
    node -> driver  ("item", call_id, RequestOutput) ... ("done", call_id, result) | ("error", call_id, text)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from engine_gpu import SMALL_SHAPE, IdTokenizer, arch_for  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.disagg.api import DisaggConfig, Role  # noqa: E402
from engine.disagg.metrics import TransferMetrics  # noqa: E402
from engine.disagg.node import DisaggEngine  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.metrics import EngineMetrics  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.models.random_init import LLAMA31_8B_SHAPE, build_random_model  # noqa: E402

SHAPES = {"8b": LLAMA31_8B_SHAPE, "small": SMALL_SHAPE}
MODEL_IDS = {"8b": "random-llama-3.1-8b-shape", "small": "random-small"}


class VocabFreeEngine(LLMEngine):
    """A random-weight model has no vocabulary (``IdTokenizer``): nothing to warm up for guided
    decoding or logprobs, which the benchmark does not ask for."""

    def warm_up(self) -> None:
        pass


def build_node(args: argparse.Namespace, node_token: str) -> DisaggEngine:
    """The same seeded weights in both processes (a split must give the colocated tokens)."""
    on_gpu = args.device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(torch.device(args.device))
    _cfg, arch = arch_for(SHAPES[args.shape], args.max_model_len)
    model = build_random_model(arch, args.device, torch.bfloat16 if on_gpu else torch.float32, seed=0)
    config = EngineConfig(model_dir=Path(MODEL_IDS[args.shape]), device=args.device, num_kv_blocks=args.kv_blocks,
                          max_num_seqs=64, max_num_batched_tokens=args.max_batched_tokens,
                          max_model_len=args.max_model_len, use_cuda_graphs=on_gpu)
    runner = ModelRunner(config, arch=arch, tokenizer=IdTokenizer(), model=model)
    metrics = EngineMetrics(None, model=config.resolved_model_id)
    llm = VocabFreeEngine(config, runner, metrics, lower_tier=None)
    return DisaggEngine(AsyncEngine(llm), runner, DisaggConfig(Role(args.role), node_token),
                        TransferMetrics(metrics.registry))


class CompileLog(Protocol):
    """What the ``compiles`` op reads (``prefixgate_kernels.jit_watch.CompileRecorder`` on a GPU)."""

    def drain(self) -> list[tuple[str, str]]: ...

    def stop(self) -> None: ...


class NoCompiles:
    """Where Triton's interpreter runs (the CPU) nothing is compiled: the ``compiles`` op answers []."""

    def drain(self) -> list[tuple[str, str]]:
        return []

    def stop(self) -> None:
        pass


async def serve(conn: Connection, node: DisaggEngine, compiles: CompileLog) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    def reader() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg is None:
                return

    async def handle(op: str, cid: int, *args: Any) -> None:
        try:
            if op == "generate":
                async for out in node.generate(args[0]):
                    send(("item", cid, out))
                result: Any = None
            elif op == "prefill":
                result = await node.prefill_and_send(*args)
            elif op == "lookup":
                result = await node.lookup(args[0])
            elif op == "address":
                result = node.receiver_address()
            elif op == "integrity":
                result = await node.check_integrity()
            elif op == "compiles":
                # the Triton launches compiled since the last ask (a compile on the engine thread stalls
                # every request of this node: benchmarks/pd.py records them per round)
                result = [{"kernel": k, "specialization": sp} for k, sp in compiles.drain()]
            else:
                raise ValueError(f"unknown op {op!r}")
            send(("done", cid, result))
        except Exception as exc:  # noqa: BLE001 - the driver prints it; the node keeps serving
            send(("error", cid, f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=reader, daemon=True).start()
    tasks: set[asyncio.Task[None]] = set()
    while (msg := await inbox.get()) is not None and msg[0] != "stop":
        task = asyncio.create_task(handle(*msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in tasks:
        task.cancel()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--authkey-env", default="PD_NODE_AUTHKEY")
    p.add_argument("--node-token-env", default="PD_BENCH_TOKEN")
    args = p.parse_args()
    authkey = os.environ[args.authkey_env].encode()
    # from before the build, so that the first compile of each kernel (graph capture) is on record
    # beside any later one of the same kernel: their specializations say what made the second
    recorder: CompileLog = NoCompiles()
    if args.device.startswith("cuda"):
        from prefixgate_kernels.jit_watch import CompileRecorder

        compile_recorder = CompileRecorder()
        compile_recorder.start()
        recorder = compile_recorder
    node = build_node(args, os.environ[args.node_token_env])
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        print(f"READY {listener.address[1]}", flush=True)
        with listener.accept() as conn:
            try:
                asyncio.run(serve(conn, node, recorder))
            finally:
                recorder.stop()
                node.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
