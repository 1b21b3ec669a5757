"""``prefixgate serve`` and the hidden ``prefixgate dev-serve`` (what ``make serve`` runs).

``serve`` builds ``GatewaySettings`` from ``--config FILE`` (TOML/YAML) overlaid with the flags
given on the command line, then runs the app under uvicorn. ``dev-serve`` additionally makes sure
a development tenant exists and prints its API key and an openai-SDK snippet: the key is shown by
tenancy only once, at creation, so it is kept in ``<home>/dev-api-key`` (mode 0600) for reruns.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engine.config import parse_size
from gateway.cli.main import CLIError, resolve_home
from gateway.settings import GatewaySettings, read_config_file

DEV_TENANT = "dev"
DEV_KEY_FILE = "dev-api-key"


def _size_flag(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise CLIError(f"{flag}: {exc}") from None


def _int_flag(flag: str, value: str | None, minimum: int) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise CLIError(f"{flag} must be an integer, got {value!r}") from None
    if number < minimum:
        raise CLIError(f"{flag} must be >= {minimum}, got {number}")
    return number


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", default=None, help="TCP port (default 8000)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory, 'tiny' (built under --home if missing; the default) "
                        "or 'none' for a gateway that only routes")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--config", default=None, help="TOML or YAML file with [server], [engine], [[routes]]")
    p.add_argument("--kv-blocks", default=None, help="KV blocks on the device (default: sized by the engine)")
    p.add_argument("--dram-bytes", default=None, help="CPU DRAM tier size, e.g. 8GiB (default 0: off)")
    p.add_argument("--nvme-dir", default=None, help="directory of the NVMe tier (default <home>/nvme)")
    p.add_argument("--nvme-bytes", default=None, help="NVMe tier size, e.g. 100GiB")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="disable prefix caching in the local engine (a baseline for `prefixgate bench`)")
    p.add_argument("--node-token-env", default=None,
                   help="environment variable holding the shared token that enables the internal node API")
    p.add_argument("--metrics-token-env", default=None,
                   help="environment variable holding the bearer token Prometheus scrapes /metrics with "
                        "(default PREFIXGATE_METRICS_TOKEN when set; admin API keys are always accepted)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without authentication (only on a listener tenants cannot reach)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    serve = subparsers.add_parser("serve", parents=[common], help="run the OpenAI-compatible gateway",
                                  description="Run the OpenAI-compatible gateway (and its local engine).")
    _add_serve_flags(serve)
    serve.set_defaults(func=run_serve)
    dev = subparsers.add_parser("dev-serve", parents=[common], help=argparse.SUPPRESS,
                                description="serve with a development tenant (used by `make serve`)")
    _add_serve_flags(dev)
    dev.set_defaults(func=run_dev_serve)


def ensure_tiny_model(home: Path) -> Path:
    """The tiny default checkpoint under ``home/models/tiny``, built (seeded, offline) if missing."""
    from engine.launch import default_tiny_dir
    from engine.launch import ensure_tiny_model as ensure

    if not (default_tiny_dir(home) / "config.json").exists():
        print(f"building the tiny default model in {default_tiny_dir(home)} ...", flush=True)
    return ensure(home)


def build_settings(args: argparse.Namespace, home: Path) -> GatewaySettings:
    """Config file values, overridden by the flags that were given. Raises CLIError on bad input."""
    values: dict[str, Any] = {}
    if args.config:
        try:
            values.update(read_config_file(Path(args.config)))
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    flags = {"host": args.host, "port": _int_flag("--port", args.port, 0), "model": args.model,
             "device": args.device, "kv_blocks": _int_flag("--kv-blocks", args.kv_blocks, 2),
             "dram_bytes": _size_flag("--dram-bytes", args.dram_bytes), "nvme_dir": args.nvme_dir,
             "nvme_bytes": _size_flag("--nvme-bytes", args.nvme_bytes)}
    values.update({k: v for k, v in flags.items() if v is not None})
    if getattr(args, "no_prefix_cache", False):  # callers may build the Namespace by hand
        values["prefix_caching"] = False
    if args.node_token_env:
        token = os.environ.get(args.node_token_env)
        if not token:
            raise CLIError(f"--node-token-env {args.node_token_env}: that environment variable is empty or unset")
        values["node_token"] = token
    metrics_env = getattr(args, "metrics_token_env", None)
    if metrics_env:
        token = os.environ.get(metrics_env)
        if not token:
            raise CLIError(f"--metrics-token-env {metrics_env}: that environment variable is empty or unset")
        values["metrics_token"] = token
    elif os.environ.get("PREFIXGATE_METRICS_TOKEN") and "metrics_token" not in values:
        values["metrics_token"] = os.environ["PREFIXGATE_METRICS_TOKEN"]
    if getattr(args, "metrics_public", False):
        values["metrics_public"] = True
    device = values.get("device", "cpu")
    if device != "cpu" and not str(device).startswith("cuda"):
        raise CLIError(f"--device must be cpu or cuda[:N], got {device!r}")
    model = values.get("model", "tiny")
    if model == "none":
        values["model"], values["model_dir"] = None, None
    elif model == "tiny":
        values["model"], values["model_dir"] = "tiny", ensure_tiny_model(home)
    else:
        path = Path(model).expanduser()
        if not (path / "config.json").exists():
            raise CLIError(f"--model {model}: not a checkpoint directory (no config.json); use a directory or 'tiny'")
        values["model"], values["model_dir"] = path.name, path
    values["home"] = home
    if values.get("nvme_bytes") and not values.get("nvme_dir"):  # the NVMe tier lives under --home by default
        values["nvme_dir"] = home / "nvme"
    try:
        return GatewaySettings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "config"
        raise CLIError(f"invalid setting {where}: {err.get('msg')}") from None


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _serve(settings: GatewaySettings, log_level: str) -> int:
    import uvicorn

    from gateway.app import create_app

    _check_port_free(settings.host, settings.port)
    app = create_app(settings)
    where = f"http://{settings.host}:{settings.port}"
    print(f"PrefixGate on {where}  model={settings.model or '-'}  device={settings.device}  home={settings.home}",
          flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, timeout_graceful_shutdown=5)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    home = resolve_home(args.home)
    return _serve(build_settings(args, home), args.log_level)


def dev_api_key(home: Path) -> tuple[str, bool]:
    """The dev tenant's key: read from ``home/dev-api-key`` or created (and stored 0600). -> (key, created)."""
    from gateway.ports import open_tenancy

    key_file = home / DEV_KEY_FILE
    if key_file.exists():
        return key_file.read_text().strip(), False
    svc = open_tenancy(home)
    try:
        if svc.get_tenant_by_name(DEV_TENANT) is None:
            created = svc.create_tenant(DEV_TENANT, admin=True)
        else:  # the tenant outlived its key file: issue it a fresh key rather than fail
            created = svc.create_key(DEV_TENANT)
        svc.flush()
    finally:
        svc.close()
    # O_EXCL + 0600: the key is a secret and is never overwritten by a concurrent rerun.
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(created.api_key + "\n")
    return created.api_key, True


def run_dev_serve(args: argparse.Namespace) -> int:
    home = resolve_home(args.home)
    settings = build_settings(args, home)
    key, created = dev_api_key(home)
    where = f"http://{settings.host}:{settings.port}"
    model = settings.model or (settings.routes[0].model if settings.routes else "tiny")
    print(f"{'created' if created else 'reusing'} development tenant {DEV_TENANT!r} (admin); key kept in "
          f"{home / DEV_KEY_FILE}\n"
          f"\n  API key:   {key}\n  base_url:  {where}/v1\n  dashboard: {where}/dashboard#key={key}\n\n"
          "  from openai import OpenAI\n"
          f"  client = OpenAI(base_url=\"{where}/v1\", api_key=\"{key}\")\n"
          f"  r = client.chat.completions.create(model=\"{model}\", max_tokens=16,\n"
          "      messages=[{\"role\": \"user\", \"content\": \"Hello!\"}])\n"
          "  print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)\n", flush=True)
    return _serve(settings, args.log_level)
