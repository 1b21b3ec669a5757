"""``prefixgate generate``: one completion from a local checkpoint, through the real engine.

    prefixgate generate [--model smol|tiny|DIR] [--raw] [--max-tokens N] [--temperature T]
                        [--threads N] [--dtype D] [--kv-dtype D] [--json] PROMPT

PROMPT is one user chat message, rendered with the model's chat template (so an instruct model
answers it); ``--raw`` sends it as a raw completion prompt instead (no template). ``--model``
defaults to SmolLM2-135M-Instruct under ``<home>/models/smol`` (converted if missing).
``--json`` prints ``{"text", "token_ids", "prompt_tokens", "cached_tokens"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import TYPE_CHECKING

from gateway.cli.main import CLIError, resolve_home
from gateway.cli.serve_cmd import add_engine_flags, engine_flag_values, resolve_model

if TYPE_CHECKING:  # the engine loads inside the command: the CLI's help stays fast
    from engine.protocol import EngineClient, GenerateRequest, RequestOutput


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    p = subparsers.add_parser(
        "generate", help="generate a completion with the local engine",
        description="Generate a completion for PROMPT with the local paged-KV engine.",
    )
    # SUPPRESS, not None: a subparser default would overwrite `prefixgate --home X generate ...`
    p.add_argument("--home", default=argparse.SUPPRESS, help="state directory (see prefixgate --help)")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--model", default="smol",
                   help="'smol' (SmolLM2-135M-Instruct, the default), 'tiny' (random weights) or a checkpoint directory")
    p.add_argument("--raw", action="store_true",
                   help="send PROMPT as a raw completion (no chat template); default: one user chat message")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), up to 2")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "prompt_tokens", "cached_tokens"}')
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.protocol import EngineError, GenerateRequest, SamplingParams, StaticTenantScope

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    engine_opts = engine_flag_values(args)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    _model_id, model_dir = resolve_model(args.model, resolve_home(getattr(args, "home", None)))
    try:
        config = EngineConfig(
            model_dir=model_dir, device=args.device, dtype=engine_opts.get("dtype", "auto"),
            kv_dtype=engine_opts.get("kv_dtype", "auto"), num_threads=engine_opts.get("threads"),
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    text_input = {"prompt": prompt} if args.raw else {"messages": [{"role": "user", "content": prompt}]}
    request = GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:12]}", tenant=StaticTenantScope(), sampling=sampling, **text_input
    )
    from engine.launch import build_engine

    try:
        engine = build_engine(config)
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot load the model from {config.model_dir}: {exc}") from None
    try:
        ids, text, last = asyncio.run(_collect(engine, request))
    except EngineError as exc:
        raise CLIError(str(exc)) from None
    finally:
        engine.shutdown()
    if last is None:  # the engine's contract is a finished output at the end; say so if it broke it
        raise CLIError("generation ended without an output")
    if last.finish_reason == "error":
        raise CLIError(f"generation failed: {last.error}")
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": ids, "prompt_tokens": last.prompt_tokens, "cached_tokens": last.cached_tokens,
        }))
    else:
        print(text)
    return 0


async def _collect(engine: EngineClient, request: GenerateRequest) -> tuple[list[int], str, RequestOutput | None]:
    ids: list[int] = []
    text = ""
    last: RequestOutput | None = None
    async for out in engine.generate(request):
        ids += out.new_token_ids
        text += out.new_text
        last = out
    return ids, text, last
