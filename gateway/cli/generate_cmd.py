"""``prefixgate generate``: one completion from a local checkpoint, through the real engine.

    prefixgate generate [--model DIR] [--max-tokens N] [--temperature T] [--json] PROMPT

``--model`` defaults to the tiny offline model under ``<home>/models/tiny`` (built if missing).
``--json`` prints ``{"text", "token_ids", "prompt_tokens", "cached_tokens"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path

from gateway.cli.main import CLIError, resolve_home


def register(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "generate", help="generate a completion with the local engine",
        description="Generate a completion for PROMPT with the local paged-KV engine.",
    )
    # SUPPRESS, not None: a subparser default would overwrite `prefixgate --home X generate ...`
    p.add_argument("--home", default=argparse.SUPPRESS, help="state directory (see prefixgate --help)")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: <home>/models/tiny, built if missing)")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), up to 2")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "prompt_tokens", "cached_tokens"}')
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.protocol import EngineError, GenerateRequest, SamplingParams, StaticTenantScope

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        config = EngineConfig(model_dir=_model_dir(args), device=args.device)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    request = GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:12]}", tenant=StaticTenantScope(), sampling=sampling, prompt=prompt
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
    if last.finish_reason == "error":
        raise CLIError(f"generation failed: {last.error}")
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": ids, "prompt_tokens": last.prompt_tokens, "cached_tokens": last.cached_tokens,
        }))
    else:
        print(text)
    return 0


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        path = Path(args.model).expanduser()
        if not (path / "config.json").is_file():
            raise CLIError(f"--model {path} is not a checkpoint directory (no config.json)")
        return path
    from engine.launch import ensure_tiny_model

    try:
        return ensure_tiny_model(resolve_home(getattr(args, "home", None)))
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot build the default tiny model: {exc}") from None


async def _collect(engine, request):
    ids: list[int] = []
    text = ""
    last = None
    async for out in engine.generate(request):
        ids += out.new_token_ids
        text += out.new_text
        last = out
    return ids, text, last
