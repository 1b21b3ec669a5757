"""``prefixgate cache``: warm a prefix ahead of traffic, and show what a tenant has cached.

    prefixgate cache warm [--url URL] [--key KEY] [--model M] [--ttl 5m|1h|24h] FILE
    prefixgate cache show [--url URL] [--key KEY] [--json]

Both talk to a running gateway (``POST /v1/cache/warm``, ``GET /v1/cache``) with a tenant key
(``--key`` or ``$PREFIXGATE_API_KEY``). FILE is a JSON request body holding ``messages`` (and
optionally ``tools`` and ``model``); ``-`` reads it from stdin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gateway.cli.http_args import api_key, gateway_url
from gateway.cli.main import CLIError


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    p = subparsers.add_parser("cache", help="warm a prompt prefix or show a tenant's cache on a running gateway",
                              description="Warm a prompt prefix ahead of traffic, or show what a tenant holds.")
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    for name, helptext in (("warm", "compute and retain a prompt's prefix"), ("show", "cached tokens per tier")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default http://127.0.0.1:8000)")
        q.add_argument("--key", default=None, help="tenant API key (default $PREFIXGATE_API_KEY)")
        if name == "warm":
            q.add_argument("file", metavar="FILE", help="JSON body with 'messages' ('-' = stdin)")
            q.add_argument("--model", default=None, help="model to warm (default: the file's 'model')")
            q.add_argument("--ttl", default="1h", choices=("5m", "1h", "24h"), help="how long to keep it (default 1h)")
            q.set_defaults(func=_warm)
        else:
            q.add_argument("--json", action="store_true", help="print the server's JSON answer")
            q.set_defaults(func=_show)


def _key(args: argparse.Namespace) -> str:
    if args.key:
        return api_key(args.key, "--key")
    key = os.environ.get("PREFIXGATE_API_KEY")
    if not key:
        raise CLIError("no API key: pass --key or set PREFIXGATE_API_KEY")
    return api_key(key, "$PREFIXGATE_API_KEY")


def _call(method: str, args: argparse.Namespace, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    import httpx

    url = gateway_url(args.url).rstrip("/") + path
    headers = {"Authorization": f"Bearer {_key(args)}"}
    try:
        r = httpx.request(method, url, json=body, headers=headers, timeout=600, trust_env=False)
    except httpx.HTTPError as exc:
        raise CLIError(f"cannot reach {url}: {exc}") from None
    try:
        answer = r.json()
    except ValueError:
        raise CLIError(f"{url} answered HTTP {r.status_code} without JSON") from None
    if r.status_code >= 400:
        message = (answer.get("error") or {}).get("message") if isinstance(answer, dict) else None
        raise CLIError(f"{url}: HTTP {r.status_code}: {message or answer}")
    if not isinstance(answer, dict):
        raise CLIError(f"{url} answered {answer!r}, not a PrefixGate JSON object")
    return answer


def _warm(args: argparse.Namespace) -> int:
    try:
        raw = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()  # noqa: SIM115
        body = json.loads(raw)
    except OSError as exc:
        raise CLIError(f"cannot read {args.file}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CLIError(f"{args.file} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise CLIError(f"{args.file} is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise CLIError(f"{args.file} must be a JSON object with a 'messages' list")
    model = args.model or body.get("model")
    if not model:
        raise CLIError("no model: pass --model or put 'model' in the file")
    request = {"model": model, "messages": body["messages"], "ttl": args.ttl}
    if body.get("tools"):
        request["tools"] = body["tools"]
    answer = _call("POST", args, "/v1/cache/warm", request)
    print(json.dumps(answer))
    return 0


def _show(args: argparse.Namespace) -> int:
    answer = _call("GET", args, "/v1/cache")
    if args.json:
        print(json.dumps(answer))
        return 0
    if not {"tenant", "total_tokens", "retained_tokens", "tokens"} <= answer.keys():
        raise CLIError(f"{args.url} answered {answer!r}, not a PrefixGate /v1/cache answer")
    print(f"tenant {answer['tenant']}: {answer['total_tokens']} cached tokens "
          f"({answer['retained_tokens']} retained)")
    for tier, tokens in answer["tokens"].items():
        print(f"  {tier:<5} {tokens:>10}")
    return 0
