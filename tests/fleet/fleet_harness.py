"""Two gateways (`prefixgate serve`, tiny model) with their own --home on one PostgreSQL and one Redis.

The first home's KEK and server secret are copied to the second, as an operator copies them to every
replica; both gateways read `database_url`, `redis_url` and a long auth-cache TTL from a TOML config
file, so a revocation that arrives in a second or two came by pub/sub, not by the cache expiring.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import openai

from tenancy.service import TenancyService
from tests.serverutil import REPO, serve_tiny, stop

AUTH_TTL_S = 30.0


@dataclass
class Fleet:
    homes: list[Path]
    database_url: str
    redis_url: str
    urls: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def admin(self) -> TenancyService:
        """What `prefixgate tenant ...` opens on the first home (the operator's machine)."""
        return TenancyService.open(self.homes[0], database_url=self.database_url, redis_url=self.redis_url)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway.cli.main", *args, "--home", str(self.homes[0]),
             "--database-url", self.database_url, "--redis-url", self.redis_url],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )

    def stop(self) -> None:
        for proc in self.procs:
            stop(proc)


def start_fleet(tmp: Path, database_url: str, redis_url: str, n: int = 2) -> Fleet:
    homes = [tmp / f"gw{i}" for i in range(n)]
    fleet = Fleet(homes, database_url, redis_url)
    TenancyService.open(homes[0], database_url=database_url).close()  # makes the KEK and server secret
    for home in homes[1:]:
        home.mkdir(parents=True)
        for secret in ("kek.key", "server.secret"):
            shutil.copy2(homes[0] / secret, home / secret)
    try:
        for i, home in enumerate(homes):
            config = home / "gateway.toml"
            config.write_text(f'[server]\ndatabase_url = "{database_url}"\nredis_url = "{redis_url}"\n'
                              f"auth_cache_ttl_s = {AUTH_TTL_S}\n")
            flags = ["--config", str(config), "--kv-blocks", "256"]
            if i > 0:  # one tiny checkpoint for all: building it again is slow and changes nothing
                flags += ["--model", str(homes[0] / "models" / "tiny")]
            url, proc = serve_tiny(home, *flags, timeout=300)
            fleet.urls.append(url)
            fleet.procs.append(proc)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(url: str, key: str, text: str = "Hello there") -> int:
    """One chat completion through the openai SDK -> the HTTP status (200, or the error's)."""
    try:
        client(url, key).chat.completions.create(model="tiny", max_tokens=1, temperature=0,
                                                 messages=[{"role": "user", "content": text}])
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200
