"""``prefixgate model init-tiny``: build the offline default model under the home directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gateway.cli.main import CLIError, resolve_home


def _add_home(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS, not None: a nested parser's default would overwrite `prefixgate --home X model ...`.
    parser.add_argument("--home", default=argparse.SUPPRESS, help="state directory (see prefixgate --help)")


def register(subparsers, common: argparse.ArgumentParser) -> None:
    model = subparsers.add_parser("model", help="manage local model checkpoints")
    _add_home(model)
    actions = model.add_subparsers(dest="model_command", metavar="ACTION")
    init = actions.add_parser(
        "init-tiny",
        help="build the tiny random-weight default model (real cl100k_base tokenizer; generates random text)",
    )
    _add_home(init)
    init.add_argument("--out", default=None, help="checkpoint directory (default: <home>/models/tiny)")
    init.add_argument("--seed", type=int, default=0, help="weight seed (default 0); same seed, same files")
    init.add_argument("--force", action="store_true", help="rebuild even if a complete checkpoint is there")
    init.add_argument("--json", action="store_true", help='print {"path", "built", "seed"} as JSON')
    init.set_defaults(func=_init_tiny)
    model.set_defaults(func=lambda args: _no_action(model))


def _no_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _init_tiny(args: argparse.Namespace) -> int:
    # Imported here so `prefixgate --help` stays fast (torch, transformers, tiktoken are heavy).
    from engine.launch import build_tiny_checkpoint, is_tiny_checkpoint

    out = Path(args.out).expanduser() if args.out else resolve_home(getattr(args, "home", None)) / "models" / "tiny"
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not is_tiny_checkpoint(out):
        raise CLIError(f"--out {out} is a non-empty directory that is not a tiny checkpoint; choose another")
    if args.seed < 0:
        raise CLIError(f"--seed must be >= 0, got {args.seed}")
    built = args.force or not is_tiny_checkpoint(out, seed=args.seed)
    if built:
        try:
            out = build_tiny_checkpoint(out, seed=args.seed)
        except OSError as exc:
            raise CLIError(f"cannot write the tiny model to {out}: {exc.strerror or exc}") from None
        except ValueError as exc:  # tiktoken: encoding file not found locally
            raise CLIError(f"cannot build the tiny model: {exc}") from None
    out = out.resolve()
    if args.json:
        print(json.dumps({"path": str(out), "built": built, "seed": args.seed}))
    else:
        print(out)
    return 0
