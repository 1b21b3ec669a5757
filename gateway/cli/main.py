"""Entry point of the ``prefixgate`` command.

Subcommands live in sibling modules named ``*_cmd.py``; each defines
``register(subparsers, common)`` where ``common`` is a parent parser carrying ``--home``, and sets
``func`` on its parser. Discovery keeps this file free of a list that every feature must edit.

User errors raise ``CLIError``: one line on stderr and exit status 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from pathlib import Path

import gateway.cli as cli_pkg


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def resolve_home(value: str | None) -> Path:
    """--home, else $PREFIXGATE_HOME, else the user's data directory. Created if missing."""
    if value:
        home = Path(value)
    elif os.environ.get("PREFIXGATE_HOME"):
        home = Path(os.environ["PREFIXGATE_HOME"])
    else:
        base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
        home = Path(base) / "prefixgate"
    home = home.expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"cannot create home directory {home}: {exc.strerror}") from None
    return home


def build_parser() -> argparse.ArgumentParser:
    home_help = (
        "state directory (database, keys, default model, NVMe tier); default $PREFIXGATE_HOME "
        "or the user's data directory"
    )
    # Subcommands inherit --home with a SUPPRESSed default: a nested parser's default would otherwise
    # overwrite the value of `prefixgate --home X serve` with None.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", default=argparse.SUPPRESS, help=home_help)
    parser = argparse.ArgumentParser(
        prog="prefixgate",
        description="PrefixGate: a multi-tenant prompt-cache gateway for LLM serving.",
    )
    parser.add_argument("--home", default=None, help=home_help)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(cli_pkg.__path__), key=lambda m: m.name):
        if mod.name.endswith("_cmd"):
            importlib.import_module(f"gateway.cli.{mod.name}").register(subparsers, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"prefixgate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Under `python -m`, this file runs as __main__ while subcommands raise
    # gateway.cli.main.CLIError, a different class object; dispatch through the package module.
    from gateway.cli.main import main as package_main

    sys.exit(package_main())
