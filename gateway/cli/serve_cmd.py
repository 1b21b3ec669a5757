"""``prefixgate serve`` and the hidden ``prefixgate dev-serve`` (what ``make serve`` runs).

``serve`` builds ``GatewaySettings`` from ``--config FILE`` (TOML/YAML) overlaid with the flags
given on the command line, then runs the app under uvicorn. ``dev-serve`` additionally makes sure
a development tenant exists and prints its API key and an openai-SDK snippet: the key is shown by
tenancy only once, at creation, so it is kept in ``<home>/dev-api-key`` (mode 0600) for reruns.

Order of a start, so that what is printed is true when it is read:
  1. the port is checked (a busy port is one line and exit 2, before any model is built);
  2. settings and the model are resolved (a checkpoint the engine cannot load fails here, one line);
  3. uvicorn starts; the banner (key, snippet) is printed only once ``/health`` answers 200.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from engine.config import parse_size
from gateway.cli.main import CLIError, resolve_home
from gateway.settings import GatewaySettings, read_config_file

if TYPE_CHECKING:  # uvicorn is imported when the server starts: `prefixgate --help` stays fast
    import uvicorn

DEV_TENANT = "dev"
DEV_KEY_FILE = "dev-api-key"


def _size_flag(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise CLIError(f"{flag}: {exc}") from None


def _int_flag(flag: str, value: str | None, minimum: int, maximum: int | None = None) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise CLIError(f"{flag} must be an integer, got {value!r}") from None
    if number < minimum:
        raise CLIError(f"{flag} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise CLIError(f"{flag} must be <= {maximum}, got {number}")
    return number


def _seconds_flag(flag: str, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise CLIError(f"{flag} must be a number of seconds, got {value!r}") from None
    if not 0 <= seconds < float("inf"):
        raise CLIError(f"{flag} must be >= 0 seconds, got {value}")
    return seconds


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", default=None, help="TCP port (default 8000)")
    p.add_argument("--model", default=None,
                   help="'smol' (SmolLM2-135M-Instruct, converted under --home if missing; the default), "
                        "'tiny' (random weights, for tests), a checkpoint directory, "
                        "or 'none' for a gateway that only routes")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default cpu)")
    add_engine_flags(p)
    p.add_argument("--config", default=None, help="TOML or YAML file with [server], [engine], [[routes]]")
    p.add_argument("--kv-blocks", default=None, help="KV blocks on the device (default: sized by the engine)")
    p.add_argument("--max-model-len", default=None, metavar="TOKENS",
                   help="longest context served, prompt + output (default: the model's, capped by the KV cache)")
    p.add_argument("--dram-bytes", default=None, help="CPU DRAM tier size, e.g. 8GiB (default 0: off)")
    p.add_argument("--nvme-dir", default=None, help="directory of the NVMe tier (default <home>/nvme)")
    p.add_argument("--nvme-bytes", default=None, help="NVMe tier size, e.g. 100GiB")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="disable prefix caching in the local engine (a baseline for `prefixgate bench`)")
    p.add_argument("--role", default=None, choices=["both", "prefill", "decode"],
                   help="prefill/decode split role of the local engine (default both; needs --node-token-env)")
    p.add_argument("--kv-port", default=None, help="a decode engine's KV receiver port (default 0: any free port)")
    p.add_argument("--kv-advertise-host", default=None, metavar="HOST",
                   help="the host prefill nodes connect to for that receiver (default: --host; when that is "
                        "0.0.0.0 or ::, the host the gateway reaches this node at)")
    p.add_argument("--node-token-env", default=None,
                   help="environment variable holding the shared token that enables the internal node API")
    p.add_argument("--metrics-token-env", default=None,
                   help="environment variable holding the bearer token Prometheus scrapes /metrics with "
                        "(default PREFIXGATE_METRICS_TOKEN when set; admin API keys are always accepted)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without authentication (only on a listener tenants cannot reach)")
    p.add_argument("--database-url", default=None, metavar="URL",
                   help="postgresql://USER@HOST:PORT/DB: tenants, keys and the ledger shared by a fleet of gateways "
                        "(default $PREFIXGATE_DATABASE_URL, then `database_url` in [server], "
                        "else the SQLite file under --home)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="redis://HOST:PORT/0: fleet-wide rate limits, budgets and revocation "
                        "(default $PREFIXGATE_REDIS_URL, then `redis_url` in [server], else per process)")
    p.add_argument("--shutdown-grace-s", default=None, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, how long requests in flight may finish before they are stopped "
                        "(default 30; also `shutdown_grace_s` in [server])")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Compute/cache options shared by ``serve`` and ``generate`` (defaults: the config file, then the engine's)."""
    p.add_argument("--threads", default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default=None, help="compute dtype: auto (fp32 on CPU, bf16 on CUDA), bf16, fp16, fp32")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype: auto (= --dtype), bf16, fp16, fp32, fp8, int8")


def engine_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, checked: {"threads", "dtype", "kv_dtype"} subset."""
    from engine.config import COMPUTE_DTYPES, DTYPE_ALIASES, KV_DTYPES

    values: dict[str, Any] = {}
    threads = _int_flag("--threads", args.threads, 1)
    if threads is not None:
        values["threads"] = threads
    for flag, key, given, allowed in (("--dtype", "dtype", args.dtype, COMPUTE_DTYPES),
                                      ("--kv-dtype", "kv_dtype", args.kv_dtype, KV_DTYPES)):
        if given is None:
            continue
        value = DTYPE_ALIASES.get(given, given)
        if value not in allowed:
            raise CLIError(f"{flag} must be one of {', '.join(allowed)} (or bf16, fp16, fp32), got {given!r}")
        values[key] = value
    return values


def resolve_model(model: str, home: Path, flag: str = "--model") -> tuple[str, Path]:
    """'smol' | 'tiny' | a checkpoint directory -> (model id clients send, checkpoint directory)."""
    from engine.launch import SMOL_MODEL_ID

    if model == "smol":
        return SMOL_MODEL_ID, ensure_smol_model(home)
    if model == "tiny":
        return "tiny", ensure_tiny_model(home)
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise CLIError(f"{flag} {model}: not a checkpoint directory (no config.json); use a directory, 'smol' or 'tiny'")
    _check_checkpoint(path)
    return path.name, path


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    serve = subparsers.add_parser("serve", parents=[common], help="run the OpenAI-compatible gateway",
                                  description="Run the OpenAI-compatible gateway (and its local engine).")
    _add_serve_flags(serve)
    serve.set_defaults(func=run_serve)
    # No help=: argparse would print a literal ==SUPPRESS== in `prefixgate --help`; a sub-command
    # without help is simply not listed.
    dev = subparsers.add_parser("dev-serve", parents=[common],
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


def ensure_smol_model(home: Path) -> Path:
    """SmolLM2-135M-Instruct under ``home/models/smol``, converted offline (~6 s) if missing."""
    from engine.launch import default_smol_dir, is_smol_checkpoint
    from engine.launch import ensure_smol_model as ensure

    if not is_smol_checkpoint(default_smol_dir(home)):
        print(f"converting SmolLM2-135M-Instruct into {default_smol_dir(home)} ...", flush=True)
    try:
        return ensure(home)
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot prepare the default model SmolLM2-135M-Instruct: {exc}") from None


def build_settings(args: argparse.Namespace, home: Path, port_hint: str | None = None) -> GatewaySettings:
    """Config file values, overridden by the flags that were given. Raises CLIError on bad input.

    With ``port_hint`` (how the user picks another port), the listen address is checked before the
    model is resolved, so a busy port fails at once rather than after building the tiny model.
    """
    values: dict[str, Any] = {}
    if args.config:
        try:
            values.update(read_config_file(Path(args.config)))
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    flags = {"host": args.host, "port": _int_flag("--port", args.port, 0, 65535), "model": args.model,
             "device": args.device, "kv_blocks": _int_flag("--kv-blocks", args.kv_blocks, 2),
             "dram_bytes": _size_flag("--dram-bytes", args.dram_bytes), "nvme_dir": args.nvme_dir,
             "nvme_bytes": _size_flag("--nvme-bytes", args.nvme_bytes),
             "max_model_len": _int_flag("--max-model-len", args.max_model_len, 1),
             "database_url": args.database_url or _env_url("PREFIXGATE_DATABASE_URL"),
             "redis_url": args.redis_url or _env_url("PREFIXGATE_REDIS_URL"),
             "role": args.role, "kv_port": _int_flag("--kv-port", args.kv_port, 0),
             "kv_advertise_host": args.kv_advertise_host,
             "shutdown_grace_s": _seconds_flag("--shutdown-grace-s", args.shutdown_grace_s)}
    values.update({k: v for k, v in flags.items() if v is not None})
    values.update(engine_flag_values(args))
    if args.no_prefix_cache:
        values["prefix_caching"] = False
    if args.node_token_env:
        token = os.environ.get(args.node_token_env)
        if not token:
            raise CLIError(f"--node-token-env {args.node_token_env}: that environment variable is empty or unset")
        values["node_token"] = token
    metrics_env = args.metrics_token_env
    if metrics_env:
        token = os.environ.get(metrics_env)
        if not token:
            raise CLIError(f"--metrics-token-env {metrics_env}: that environment variable is empty or unset")
        values["metrics_token"] = token
    elif os.environ.get("PREFIXGATE_METRICS_TOKEN") and "metrics_token" not in values:
        values["metrics_token"] = os.environ["PREFIXGATE_METRICS_TOKEN"]
    if args.metrics_public:
        values["metrics_public"] = True
    device = values.get("device", "cpu")
    if device != "cpu" and not str(device).startswith("cuda"):
        raise CLIError(f"--device must be cpu or cuda[:N], got {device!r}")
    if port_hint is not None:
        _check_port_free(str(values.get("host", "127.0.0.1")), int(values.get("port", 8000)), port_hint)
    values["home"] = home
    if values.get("nvme_bytes") and not values.get("nvme_dir"):  # the NVMe tier lives under --home by default
        values["nvme_dir"] = home / "nvme"
    model = values.get("model", "smol")
    # Every setting is checked before anything is opened or loaded: a typo must not wait seconds for
    # SmolLM2's conversion. The checkpoint's name stands in for its directory until it is resolved.
    stand_in = (None, None) if model == "none" else (str(model), Path(str(model)))
    _settings({**values, "model": stand_in[0], "model_dir": stand_in[1]})
    _check_tenancy(home, values.get("database_url"))  # before the model: a bad URL must not wait for a checkpoint
    values["model"], values["model_dir"] = (None, None) if model == "none" else resolve_model(str(model), home)
    return _settings(values)


def _env_url(var: str) -> str | None:
    """$PREFIXGATE_DATABASE_URL / $PREFIXGATE_REDIS_URL, read as the admin commands read them (empty = unset)."""
    return os.environ.get(var) or None


def _settings(values: dict[str, Any]) -> GatewaySettings:
    """``GatewaySettings(**values)``; the first validation error as one CLIError line."""
    try:
        return GatewaySettings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "config"
        message = str(err.get("msg", "")).removeprefix("Value error, ")
        raise CLIError(f"invalid setting {where}: {message}") from None


def _check_checkpoint(path: Path) -> None:
    """Fail now, in one line, on a checkpoint the engine would reject inside the server's start-up."""
    from engine.launch import check_checkpoint

    try:
        check_checkpoint(path)
    except (ValueError, KeyError, OSError) as exc:  # CheckpointError, a broken index, an unreadable file
        raise CLIError(f"--model {path}: {exc}") from None


def _check_port_free(host: str, port: int, hint: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror} (is another server running there?); "
                           f"pick another port with {hint}") from None


def _check_tenancy(home: Path, database_url: str | None) -> None:
    """Open the tenancy state once before anything else, so that a wrong or unreachable database URL,
    or a KEK or server secret that does not match the shared database, fails start-up with one line
    (exit 2) instead of a traceback from inside the server's start-up."""
    from gateway.ports import TenancyError, open_tenancy

    try:
        # No Redis here: an unreachable Redis is not fatal (the gateway serves with local limits).
        open_tenancy(home, database_url=database_url).close()
    except TenancyError as exc:
        raise CLIError(str(exc)) from None


def _serve(settings: GatewaySettings, log_level: str, banner: Callable[[], str] | None = None) -> int:
    """Run uvicorn; print the start line and ``banner()`` once ``/health`` answers 200."""
    import uvicorn

    from gateway.app import create_app
    from gateway.connection_limits import protocol_class
    from gateway.query_credentials import install_access_log_redaction
    from gateway.shutdown import STOP_WINDOW_S, DrainingServer

    app = create_app(settings)
    # uvicorn's own cancel is the last resort, after the drain has stopped what was left.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            # uvicorn annotates int, but hands it to asyncio.timeout, which takes float seconds
                            timeout_graceful_shutdown=settings.shutdown_grace_s + STOP_WINDOW_S,  # type: ignore[arg-type]
                            http=protocol_class(settings.header_timeout_s, settings.max_connections))
    install_access_log_redaction()  # after uvicorn.Config: it sets up the access logger
    server = DrainingServer(config, app.state.inflight, settings.shutdown_grace_s)
    where = f"http://{settings.host}:{settings.port}"
    ready = f"PrefixGate on {where}  model={settings.model or '-'}  device={settings.device}  home={settings.home}"
    announcer = threading.Thread(target=_announce_when_healthy, args=(server, _probe_url(settings), ready, banner),
                                 name="prefixgate-banner", daemon=True)
    announcer.start()
    failure = _StartupFailure(server)
    if log_level != "debug":  # --log-level debug keeps uvicorn's full traceback
        logging.getLogger("uvicorn.error").addFilter(failure)
    try:
        server.run()
    except SystemExit:  # uvicorn exits with status 3 when the app's start-up (engine, tenancy) failed
        if server.started:
            raise
    if server.started:
        return 0
    reason = failure.reason or "see the log above"
    raise CLIError(f"the server could not start: {reason} (--log-level debug shows the traceback)")


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:: .*)?$")


def _exception_line(traceback_text: str) -> str | None:
    """``Type: message`` of a formatted traceback: its last unindented line that looks like one.

    Frame lines are indented; a multi-line message (torch's C++ frames) continues unindented but not
    in ``Name: ...`` shape, so the exception's own line is found, not the message's last line.
    """
    lines = [ln for ln in traceback_text.splitlines() if _EXCEPTION_LINE.match(ln) and not ln.startswith("Traceback")]
    return lines[-1][:300] if lines else None


class _StartupFailure(logging.Filter):
    """Keeps the last line of a start-up traceback and drops the rest: a user sees one line."""

    def __init__(self, server: uvicorn.Server) -> None:
        super().__init__()
        self.server = server
        self.reason: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if self.server.started:
            return True
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            self.reason = f"{type(exc).__name__}: {exc}"
            return False
        if text.startswith("Traceback"):
            self.reason = _exception_line(text)
            return False
        return text != "Application startup failed. Exiting."


def _probe_url(settings: GatewaySettings) -> str:
    """Where this process can reach its own server: a wildcard bind is probed on loopback."""
    host = settings.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"


def _announce_when_healthy(server: uvicorn.Server, probe: str, ready: str, banner: Callable[[], str] | None) -> None:
    """Poll until uvicorn listens and ``/health`` says 200, then print; give up silently if it stops."""
    import httpx

    while not server.should_exit:
        if server.started:
            try:
                if httpx.get(f"{probe}/health", timeout=2.0, trust_env=False).status_code == 200:
                    print(ready + (("\n" + banner()) if banner else ""), flush=True)
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.1)


def run_serve(args: argparse.Namespace) -> int:
    home = resolve_home(args.home)
    return _serve(build_settings(args, home, port_hint="--port N"), args.log_level)


def dev_api_key(home: Path) -> tuple[str, bool]:
    """The dev tenant's key: read from ``home/dev-api-key`` or created (and stored 0600). -> (key, created)."""
    from gateway.ports import open_tenancy

    key_file = home / DEV_KEY_FILE
    if key_file.exists():
        return key_file.read_text().strip(), False
    svc = open_tenancy(home)
    try:
        if svc.get_tenant_by_name(DEV_TENANT) is None:
            key = svc.create_tenant(DEV_TENANT, admin=True).api_key
        else:  # the tenant outlived its key file: issue it a fresh key rather than fail
            key = svc.create_key(DEV_TENANT).api_key
        svc.flush()
    finally:
        svc.close()
    # O_EXCL + 0600: the key is a secret and is never overwritten by a concurrent rerun.
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return key, True


def run_dev_serve(args: argparse.Namespace) -> int:
    home = resolve_home(args.home)
    settings = build_settings(args, home, port_hint="`make serve PORT=N` (or --port N)")
    key, created = dev_api_key(home)
    where = f"http://{settings.host}:{settings.port}"
    model = settings.model or (settings.routes[0].model if settings.routes else "SmolLM2-135M-Instruct")
    status = "created" if created else "reusing"

    def banner() -> str:
        return (f"{status} development tenant {DEV_TENANT!r} (admin); key kept in {home / DEV_KEY_FILE}\n"
                f"\n  API key:   {key}\n  base_url:  {where}/v1\n  dashboard: {where}/dashboard#key={key}\n\n"
                "  from openai import OpenAI\n"
                f"  client = OpenAI(base_url=\"{where}/v1\", api_key=\"{key}\")\n"
                f"  r = client.chat.completions.create(model=\"{model}\", max_tokens=16,\n"
                "      messages=[{\"role\": \"user\", \"content\": \"Hello!\"}])\n"
                "  print(r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)\n\n"
                f"  CLI (same home, from another shell): {_cli_hint()} tenant create acme --json\n"
                "  another port: make serve PORT=8001   stop: Ctrl-C\n")

    return _serve(settings, args.log_level, banner)


def _cli_hint() -> str:
    """How to run ``prefixgate`` from another shell: the venv's script, or the bare name if on PATH."""
    script = Path(sys.executable).parent / "prefixgate"
    if not script.exists():
        return "prefixgate"
    try:
        shown = script.relative_to(Path.cwd())
    except ValueError:
        shown = script
    return f"{shown} (or `source {shown.parent}/activate` once, then `prefixgate`)"
