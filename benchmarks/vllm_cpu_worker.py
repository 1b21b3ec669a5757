"""The vLLM side of benchmarks/vllm_cpu.py, run by the vLLM venv's Python (it imports nothing of
this project: that venv holds vLLM and its own torch, not PrefixGate).

    <vllm venv>/bin/python benchmarks/vllm_cpu_worker.py SPEC.json RESULT.json

SPEC holds the checkpoint directory, whether prefix caching is on, and the token ids: a warm-up
prompt, the batch (all submitted at once, timed until the last finishes) and the single requests
(one at a time, each timed from submission to its first and last token). vLLM runs with its
defaults except prefix caching and ``skip_tokenizer_init`` (token-id prompts need no tokenizer).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

# This directory holds benchmarks/kernels.py, which would shadow Hugging Face's ``kernels`` package
# that transformers probes for on import: take the script's own directory off the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    t_start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # kv_cache_memory_bytes: vLLM's CPU default reserves 92% of the machine's memory and refuses
    # to start when other processes hold more than 8% of it (a shared machine always does).
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, enable_prefix_caching=spec["prefix_caching"],
              kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=0)
    startup_s = time.perf_counter() - t_start
    max_tokens = spec["max_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": spec["warmup"]}], params, use_tqdm=False)

    batch_tokens = batch_cached = 0
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["batch"]], params, use_tqdm=False)
    batch_wall = time.perf_counter() - start
    batch_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    batch_cached = sum(o.num_cached_tokens or 0 for o in outs)
    batch_prompt = sum(len(p) for p in spec["batch"])

    # One at a time through the engine's own step loop, so that the first token is seen when it
    # is produced (LLM.generate only returns finished requests).
    engine = llm.llm_engine
    stream = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    singles = []
    for i, prompt in enumerate(spec["singles"]):
        rid = f"single-{i}"
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, stream)
        first = last = None
        n = 0
        cached = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                got = len(out.outputs[0].token_ids)
                if got and first is None:
                    first = now
                n += got
                last = now
                cached = out.num_cached_tokens or cached
        assert first is not None and last is not None and n == max_tokens, (rid, n)
        singles.append({"ttft_s": first - t0, "total_s": last - t0, "decode_s_per_token": (last - first) / (n - 1),
                        "cached_tokens": cached})
    cfg = engine.vllm_config
    result = {
        "vllm_version": __import__("vllm").__version__,
        "torch_version": __import__("torch").__version__,
        "startup_s": startup_s,
        "dtype": str(cfg.model_config.dtype),
        "enforce_eager": cfg.model_config.enforce_eager,
        "block_size": cfg.cache_config.block_size,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "batch": {"wall_s": batch_wall, "output_tokens": batch_tokens, "prompt_tokens": batch_prompt,
                  "cached_tokens": batch_cached, "hit_rate": batch_cached / batch_prompt,
                  "first_tokens": [list(o.outputs[0].token_ids) for o in outs]},
        "singles": singles,
        "ttft_p50_s": statistics.median(s["ttft_s"] for s in singles) if singles else None,
        "decode_s_per_token_p50": statistics.median(s["decode_s_per_token"] for s in singles) if singles else None,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
