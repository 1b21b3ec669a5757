"""The ``promptlint`` command.

    promptlint check PATH... [--format text|json|github|sarif|junit] [--fail-under SCORE]
                             [--model NAME] [--volume REQS_PER_DAY] [--fix] [--config FILE] [--output FILE]
                             [--from-usage REPORT_JSON]
    promptlint rule CODE       print a rule's documentation
    promptlint rules           list every rule

Exit status: 0 clean; 1 findings, or the overall score below ``--fail-under``; 2 usage or config
error (one line on stderr).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from promptlint.errors import UsageError

if TYPE_CHECKING:  # the commands import what they run: `promptlint --help` stays fast
    from promptlint.config import Config
    from promptlint.linter import Report


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``promptlint: error: ...``, exit 2: the
    same as every ``UsageError`` (argparse's own prints the usage block first). The subcommand is
    named after the prefix (``promptlint: error: check: argument --format: ...``); ``--help`` is
    unchanged. The gateway CLI has the same class, but promptlint imports nothing from its siblings
    (.importlinter), so it keeps this one of its own."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        where = f"{command}: " if command else ""
        print(f"promptlint: error: {where}{' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    from promptlint import __version__
    from promptlint.formats import FORMATS

    parser = OneLineParser(  # its subparsers are OneLineParsers too (argparse uses the parent's class)
        prog="promptlint",
        description="Find prompt structures that defeat prefix caching (timestamps in the system prompt, "
        "unsorted tools, user names before instructions, ...).",
    )
    parser.add_argument("--version", action="version", version=f"promptlint {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    check = sub.add_parser("check", help="lint prompt templates and chat request files")
    check.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files or directories")
    check.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    check.add_argument("--fail-under", type=float, default=None, metavar="SCORE",
                       help="exit 1 if the overall score (0-100) is below SCORE")
    check.add_argument("--model", default=None, help="target model: tokenizer, cache minimum, prices")
    check.add_argument("--volume", type=float, default=None, metavar="REQS_PER_DAY",
                       help="requests per day per file: print the monthly money saved / left (litellm prices)")
    check.add_argument("--fix", action="store_true", help="apply safe fixes and list what changed")
    check.add_argument("--config", type=Path, default=None, help="a pyproject.toml to read [tool.promptlint] from")
    check.add_argument("--select", default=None, metavar="CODES",
                       help="comma-separated codes or prefixes to run (replaces the config's select); a selected "
                       "info-level rule such as PC009 also fails the run")
    check.add_argument("--ignore", default=None, metavar="CODES",
                       help="comma-separated codes or prefixes to skip (added to the config's ignore)")
    check.add_argument("--output", "-o", type=Path, default=None, help="write the report to FILE")
    check.add_argument("--skip-non-prompts", action="store_true",
                       help="skip named .json/.yaml files that are not prompts instead of reporting PC000 "
                       "(for pre-commit, which names every staged file)")
    check.add_argument("--from-usage", type=Path, default=None, metavar="FILE",
                       help="also report live cache breaks from FILE (`prefixgate report --format json`, or a "
                       "miss log) against the templates that caused them")
    check.set_defaults(func=_check)
    rule = sub.add_parser("rule", help="print a rule's documentation")
    rule.add_argument("code", metavar="CODE")
    rule.set_defaults(func=_rule)
    rules = sub.add_parser("rules", help="list every rule")
    rules.add_argument("--format", choices=("text", "markdown"), default="text",
                       help="markdown: the table in docs/promptlint.md")
    rules.set_defaults(func=_rules)
    return parser


def _check(args: argparse.Namespace) -> int:
    from promptlint.config import load_config, with_cli_codes
    from promptlint.fix import fix_file
    from promptlint.formats import render
    from promptlint.linter import lint
    from promptlint.pricing import estimate

    if args.fail_under is not None and not 0 <= args.fail_under <= 100:
        raise UsageError("--fail-under must be between 0 and 100")
    # NaN fails every comparison, so `volume < 0` let `--volume nan` (and 1e400, read as inf) through.
    if args.volume is not None and not (math.isfinite(args.volume) and args.volume >= 0):
        raise UsageError(f"--volume must be a finite, non-negative number of requests per day, got {args.volume:g}")
    config = with_cli_codes(load_config(args.config), args.select, args.ignore)
    report = lint(args.paths, config, args.model, args.skip_non_prompts)
    if args.fix:
        fixed_any = False
        for r in report.files:
            what = fix_file(r, args.paths)
            done = [w for w in what if not w.startswith("not fixed")]
            if done:
                fixed_any = True
                print(f"fixed {r.path}: {', '.join(done)}", file=sys.stderr)
            for note in (w for w in what if w.startswith("not fixed")):
                print(f"{r.path}: {note}", file=sys.stderr)
        if not fixed_any:
            print("nothing to fix", file=sys.stderr)
        report = lint(args.paths, config, args.model, args.skip_non_prompts)  # report what is left
    if not report.files:
        print("promptlint: warning: no prompt files found", file=sys.stderr)
    if args.from_usage is not None:
        _add_live_findings(report, args.from_usage, config)
    savings = estimate(report, args.volume) if args.volume is not None else None
    fail_under = args.fail_under if args.fail_under is not None else config.fail_under
    text = render(report, args.format, savings, fail_under)
    if args.output is not None:
        try:
            args.output.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    else:
        sys.stdout.write(text)
    failing = [f for f in report.findings if config.fails(f.code, f.severity)]
    failed = bool(failing) or (fail_under is not None and report.score < fail_under)
    return 1 if failed else 0


def _add_live_findings(report: Report, path: Path, config: Config) -> None:
    """Attach ``--from-usage`` miss records to the files they came from (see ``promptlint.from_usage``)."""
    from promptlint.from_usage import attribute, load_misses
    from promptlint.linter import attach_findings

    misses = load_misses(path)
    got = attribute(report, misses)
    attach_findings(report, got.findings, config)
    if got.unmatched:
        rules = sorted({str(r.get("rule")) for r in got.unmatched})
        print(f"promptlint: {len(got.unmatched)} of {len(misses)} miss record(s) matched no linted file "
              f"(rules {', '.join(rules)})", file=sys.stderr)


def _rule(args: argparse.Namespace) -> int:
    from promptlint.rules import all_rules

    rules = all_rules()
    code = args.code.upper()
    if code not in rules:
        by_name = {r.name: r for r in rules.values()}
        if args.code not in by_name:
            raise UsageError(f"unknown rule {args.code!r}; `promptlint rules` lists them")
        code = by_name[args.code].code
    r = rules[code]
    fix = "sometimes (--fix)" if r.fixable else "no"
    fails = "yes" if r.severity != "info" else "only when selected (--select or [tool.promptlint] select)"
    print(f"{r.doc}\n\nSeverity: {r.severity}. Fails the run by default: {fails}. Fixable: {fix}.")
    return 0


def _rules(args: argparse.Namespace) -> int:
    from promptlint.rules import all_rules

    if args.format == "markdown":
        print("| code | name | severity | fails by default | fix | what it finds |\n|---|---|---|---|---|---|")
        for r in all_rules().values():
            fails = "yes" if r.severity != "info" else "when selected"
            print(f"| {r.code} | `{r.name}` | {r.severity} | {fails} | {'yes' if r.fixable else ''} | {r.summary} |")
        return 0
    for r in all_rules().values():
        print(f"{r.code}  {r.name:<32} {r.severity:<8} {r.summary}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # every command sets func; a missing one is a usage error
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that left shows up here, not at interpreter exit
        return code
    except UsageError as exc:
        print(f"promptlint: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `promptlint rules | head`: the reader left early, which is not an error
        # Point stdout at /dev/null so the interpreter's flush at exit does not raise again (Python docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
