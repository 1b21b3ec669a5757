"""Entry point of the ``prefixgate`` command.

Subcommands live in sibling modules named ``*_cmd.py``; each defines
``register(subparsers, common)`` where ``common`` is a parent parser carrying ``--home``, and sets
``func`` on its parser. Discovery keeps this file free of a list that every feature must edit.

User errors raise ``CLIError``: one line on stderr and exit status 2. Argparse's own errors (a bad
type, a missing argument, an unknown choice) take the same form through ``OneLineParser``, which
every subcommand's parser is (argparse builds subparsers of the parent's class); ``--help`` is unchanged.

One home rule for every command (``make serve`` included, so the README's sequence works from any
shell): ``--home``, else ``$PREFIXGATE_HOME``, else the user's data directory. A command that creates
the home says so on stderr, naming where the choice came from.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from pathlib import Path
from typing import NoReturn

import gateway.cli as cli_pkg


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``prefixgate: error: ...``, exit 2:
    the same as every ``CLIError`` (argparse's own prints the usage block first). The subcommand
    is named after the prefix (``prefixgate: error: tenant quota set: argument --rpm: ...``)."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        where = f"{command}: " if command else ""
        print(f"prefixgate: error: {where}{' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def default_home() -> tuple[Path, str]:
    """The home when no --home is given, and where that choice came from (for messages)."""
    if os.environ.get("PREFIXGATE_HOME"):
        return Path(os.environ["PREFIXGATE_HOME"]), "$PREFIXGATE_HOME"
    if os.environ.get("XDG_DATA_HOME"):
        return Path(os.environ["XDG_DATA_HOME"]) / "prefixgate", "$XDG_DATA_HOME/prefixgate"
    return Path.home() / ".local" / "share" / "prefixgate", "the default, ~/.local/share/prefixgate"


def resolve_home(value: str | None) -> Path:
    """--home, else $PREFIXGATE_HOME, else the user's data directory. Created (and announced) if missing."""
    home, source = (Path(value), "--home") if value else default_home()
    home = home.expanduser()
    if home.is_dir():
        return home
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)  # it will hold the secrets and the database
    except OSError as exc:
        raise CLIError(f"cannot create home directory {home}: {exc.strerror}") from None
    # stderr: stdout may be --json that a script parses.
    print(f"prefixgate: created home directory {home} (from {source}); pass --home or set "
          "$PREFIXGATE_HOME to use another", file=sys.stderr)
    return home


def build_parser() -> argparse.ArgumentParser:
    home_help = (
        "state directory (database, keys, default model, NVMe tier); default $PREFIXGATE_HOME "
        "or the user's data directory"
    )
    # Subcommands inherit --home with a SUPPRESSed default: a nested parser's default would otherwise
    # overwrite the value of `prefixgate --home X serve` with None.
    common = OneLineParser(add_help=False)
    common.add_argument("--home", default=argparse.SUPPRESS, help=home_help)
    parser = OneLineParser(
        prog="prefixgate",
        description="PrefixGate: a multi-tenant prompt-cache gateway for LLM serving.",
    )
    parser.add_argument("--home", default=None, help=home_help)
    # required: no command is a usage error like any other (one line), not help on stdout with exit 2.
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in sorted(pkgutil.iter_modules(cli_pkg.__path__), key=lambda m: m.name):
        if mod.name.endswith("_cmd"):
            importlib.import_module(f"gateway.cli.{mod.name}").register(subparsers, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ModuleNotFoundError as exc:  # the light install (promptlint only) has no gateway dependencies
        print(f"prefixgate: error: this install lacks {exc.name!r}, which the gateway needs; install it with "
              "`pip install 'prefixgate[all]'` (`promptlint` works without it)", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    bad = _not_utf8(args)
    if bad is not None:  # bytes from the shell that are not UTF-8 reach SQLite and files as surrogates
        print(f"prefixgate: error: argument {bad} is not valid UTF-8 text", file=sys.stderr)
        return 2
    try:  # every command's parser sets func (an action a command requires is a usage error before this)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that left shows up here, not at interpreter exit
        return code
    except CLIError as exc:
        print(f"prefixgate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `prefixgate report | head`: the reader left; that is not an error of ours
        return quiet_broken_pipe()


def _not_utf8(args: argparse.Namespace) -> str | None:
    """The name of the first argument holding text that cannot be encoded as UTF-8, or None."""
    for name, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return name  # the dest: a positional's name or a flag's, without dashes
    return None


def quiet_broken_pipe() -> int:
    """Silence the flush at exit that would raise again, as the Python docs advise; exit 141 like SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


if __name__ == "__main__":
    # Under `python -m`, this file runs as __main__ while subcommands raise
    # gateway.cli.main.CLIError, a different class object; dispatch through the package module.
    from gateway.cli.main import main as package_main

    sys.exit(package_main())
