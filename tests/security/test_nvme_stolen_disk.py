"""A stolen disk cannot confirm a guessed prompt from the NVMe index (issue 16 item 6), end to end:
tenancy's real namespace and AES-256-GCM cipher, the real TierManager writing files and SQLite.

The thief holds the NVMe directory and all of ``--home`` except the KEK (kept elsewhere, as
SECURITY.md advises): the server secret, the database with tenant ids. It knows the prompt to test
and the public tokenizer, so it can compute every block hash of the guess from any namespace it
can derive. The owner of the keys, with the same computation, finds the guess: the check has power.
"""

from __future__ import annotations

import hashlib
import random
import sqlite3
from pathlib import Path

from engine.tiers import TierManager
from engine.tiers.index_seal import IndexSealer
from tenancy.keys import ServerSecret
from tenancy.namespace import namespace_for
from tenancy.service import TenancyService

BLOCK_SIZE, BLOCK_BYTES = 16, 512


def _chain(namespace: bytes, tokens: list[int]) -> list[bytes]:
    h, out = namespace, []
    for i in range(0, len(tokens) - len(tokens) % BLOCK_SIZE, BLOCK_SIZE):
        h = hashlib.sha256(h + b"".join(t.to_bytes(4, "little") for t in tokens[i:i + BLOCK_SIZE])).digest()
        out.append(h)
    return out


def _index_tags(nvme_dir: Path) -> set[bytes]:
    (index,) = nvme_dir.rglob("index.sqlite")
    conn = sqlite3.connect(index)
    tags = {bytes(r[0]) for r in conn.execute("SELECT ns_tag FROM segments")}
    conn.close()
    return tags


def test_without_the_kek_a_stolen_home_and_nvme_dir_confirm_no_guess(tmp_path: Path) -> None:
    home, nvme = tmp_path / "home", tmp_path / "nvme"
    guess = [random.Random(7).randrange(50_000) for _ in range(BLOCK_SIZE * 8)]
    with TenancyService.open(home) as svc:
        victim = svc.authenticate(svc.create_tenant("victim").api_key)
        m = TierManager(model_id="m", block_size=BLOCK_SIZE, block_bytes=BLOCK_BYTES, nvme_dir=nvme,
                        nvme_bytes=1 << 20, pin_memory=False)
        hashes = _chain(victim.namespace, guess)
        m.demote(victim, hashes, random.Random(1).randbytes(len(hashes) * BLOCK_BYTES)).result(timeout=30)
        m.drain(timeout=30)
        m.close()
    tags = _index_tags(nvme)
    assert tags
    # the thief: every namespace it can derive from what it stole, tested against the index
    secret = ServerSecret.load(home)
    tried = [namespace_for(secret.namespace_key, tenant_id=victim.tenant_id, share_scope="tenant",
                           key_id=victim.key_id, user=None),
             secret.namespace_key, hashlib.sha256(secret.raw).digest()]
    for ns in tried:
        assert IndexSealer().tag(ns) not in tags
    disk = b"".join(p.read_bytes() for p in nvme.rglob("*") if p.is_file())
    for ns in tried:
        for h in _chain(ns, guess):
            assert h not in disk
    assert victim.namespace not in disk
    # the owner, with the KEK: the same guess is found (so the thief's miss is not an accident)
    assert IndexSealer().tag(victim.namespace) in tags
    with TenancyService.open(home) as svc:
        again = svc.authenticate(svc.create_key("victim").api_key)
        assert again.namespace == victim.namespace  # namespaces are stable across restarts


def test_namespaces_need_the_kek_and_survive_its_rotation(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with TenancyService.open(home) as svc:
        created = svc.create_tenant("a")
        before = svc.authenticate(created.api_key).namespace
        svc.rotate_kek()
    with TenancyService.open(home) as svc:
        assert svc.authenticate(created.api_key).namespace == before
    # same server secret and tenant, another KEK-wrapped root key: another namespace
    other = tmp_path / "other"
    other.mkdir()
    (other / "server.secret").write_bytes((home / "server.secret").read_bytes())
    (other / "server.secret").chmod(0o600)
    with TenancyService.open(other) as svc:
        ctx = svc.authenticate(svc.create_tenant("a").api_key)
        same_id = namespace_for(ServerSecret.load(other).namespace_key, tenant_id=ctx.tenant_id,
                                share_scope="tenant", key_id=ctx.key_id, user=None)
        assert ctx.namespace != same_id and ctx.namespace != before
