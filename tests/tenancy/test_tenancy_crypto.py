"""Envelope encryption: the tenant cipher, crypto-shredding on delete, KEK rotation and KEK loading."""

from __future__ import annotations

import base64
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from tenancy.crypto import KeyEncryptionKey, TenantCipher, new_data_key
from tenancy.errors import KeyMaterialError
from tenancy.service import TenancyService

AAD = b"ns|model|blockhash|v1"


def _all_unwrapped_data_keys(home: Path) -> list[bytes]:
    """What an attacker holding the db file and the KEK can recover: every stored data key."""
    kek = KeyEncryptionKey.load(home)
    conn = sqlite3.connect(home / "prefixgate.db")
    # the namespace root key ("system:namespace") is a data key too, but encrypts no KV
    rows = conn.execute("SELECT owner, wrapped FROM data_keys WHERE owner NOT LIKE 'system:%'").fetchall()
    conn.close()
    return [kek.unwrap(w, owner) for owner, w in rows]


def test_cipher_round_trips_with_a_fresh_nonce_each_time() -> None:
    c = TenantCipher(new_data_key(), owner="tenant:t")
    pt = os.urandom(4096)
    b1, b2 = c.encrypt(pt, AAD), c.encrypt(memoryview(pt), AAD)
    assert b1 != b2 and b1[1:13] != b2[1:13]
    assert len(b1) == 1 + 12 + len(pt) + 16 and b1[0] == 1
    assert c.decrypt(b1, AAD) == pt and c.decrypt(memoryview(b2), AAD) == pt
    assert c.decrypt(c.encrypt(b"", AAD), AAD) == b""


def test_cipher_returns_none_for_every_bad_blob() -> None:
    c = TenantCipher(new_data_key(), owner="tenant:a")
    other = TenantCipher(new_data_key(), owner="tenant:b")
    blob = c.encrypt(b"secret kv bytes" * 10, AAD)
    flipped = bytearray(blob)
    flipped[20] ^= 0x01
    tag_flipped = bytearray(blob)
    tag_flipped[-1] ^= 0x80
    bad_version = b"\x02" + blob[1:]
    for bad in (bytes(flipped), bytes(tag_flipped), blob[:-1], blob[:13], b"", b"\x01", bad_version):
        assert c.decrypt(bad, AAD) is None
    assert c.decrypt(blob, AAD + b"x") is None
    assert c.decrypt(blob, b"") is None
    assert other.decrypt(blob, AAD) is None


def test_a_destroyed_cipher_still_encrypts_but_nothing_can_decrypt_it() -> None:
    key = new_data_key()
    c = TenantCipher(key, owner="tenant:t")
    before = c.encrypt(b"kv", AAD)
    c.destroy()
    after = c.encrypt(b"kv", AAD)  # the engine may still be spilling the deleted tenant's blocks
    assert len(after) == len(before) and after[0] == 1
    assert c.decrypt(before, AAD) is None and c.decrypt(after, AAD) is None
    assert TenantCipher(key, owner="copy").decrypt(after, AAD) is None  # not even with the old key
    assert TenantCipher(key, owner="copy").decrypt(before, AAD) == b"kv"


def test_cipher_is_thread_safe() -> None:
    c = TenantCipher(new_data_key(), owner="tenant:t")
    errors: list[str] = []

    def work(i: int) -> None:
        for j in range(200):
            pt = f"{i}-{j}".encode() * 8
            aad = f"aad{i}".encode()
            if c.decrypt(c.encrypt(pt, aad), aad) != pt:
                errors.append(f"{i}-{j}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_deleting_a_tenant_crypto_shreds_its_spilled_kv(home: Path) -> None:
    svc = TenancyService.open(home)
    doomed = svc.authenticate(svc.create_tenant("doomed").api_key)
    keeper = svc.authenticate(svc.create_tenant("keeper").api_key)
    blob = doomed.cipher.encrypt(b"kv block of doomed", AAD)
    kept_blob = keeper.cipher.encrypt(b"kv block of keeper", AAD)
    # before: someone with db + KEK can read it (this is what the shredding must take away)
    assert any(TenantCipher(k, owner="x").decrypt(blob, AAD) for k in _all_unwrapped_data_keys(home))
    conn = sqlite3.connect(home / "prefixgate.db")
    (wrapped,) = conn.execute("SELECT wrapped FROM data_keys WHERE owner = ?",
                              [f"tenant:{doomed.tenant_id}"]).fetchone()
    conn.close()
    svc.delete_tenant("doomed")
    assert doomed.cipher.decrypt(blob, AAD) is None  # the live cipher forgot its key too
    svc.close()
    # after: with the db file and the KEK, no stored key opens the blob ...
    keys = _all_unwrapped_data_keys(home)
    assert len(keys) == 1
    assert all(TenantCipher(k, owner="x").decrypt(blob, AAD) is None for k in keys)
    assert TenantCipher(keys[0], owner="x").decrypt(kept_blob, AAD) == b"kv block of keeper"
    # ... and the wrapped key bytes are gone from every file under home (no free page, no WAL frame)
    for p in home.iterdir():
        assert wrapped not in p.read_bytes(), p.name
    again = TenancyService.open(home)
    try:
        assert again.authenticate
        assert again.get_tenant_by_name("doomed") is None
    finally:
        again.close()


def test_a_delete_by_another_process_destroys_the_running_gateways_key_within_the_ttl(home: Path) -> None:
    gateway = TenancyService.open(home, auth_cache_ttl_s=0.2)
    admin_cli = TenancyService.open(home)
    try:
        doomed_key = admin_cli.create_tenant("doomed").api_key
        other_key = admin_cli.create_tenant("other").api_key
        doomed = gateway.authenticate(doomed_key)
        blob = doomed.cipher.encrypt(b"kv", AAD)
        admin_cli.delete_tenant("doomed")
        assert doomed.cipher.decrypt(blob, AAD) == b"kv"  # within the TTL the gateway still holds the key
        time.sleep(0.25)
        gateway.authenticate(other_key)  # ordinary traffic: a cache miss runs the sweep
        assert doomed.cipher.decrypt(blob, AAD) is None
        assert gateway.authenticate(other_key).cipher.decrypt(
            gateway.authenticate(other_key).cipher.encrypt(b"ok", AAD), AAD) == b"ok"
    finally:
        gateway.close()
        admin_cli.close()


def test_kek_rotation_rewraps_data_keys_and_old_blobs_still_decrypt(home: Path) -> None:
    svc = TenancyService.open(home)
    created = svc.create_tenant("acme")
    blob = svc.authenticate(created.api_key).cipher.encrypt(b"before rotation", AAD)
    old_kek = (home / "kek.key").read_bytes()
    result = svc.rotate_kek()
    assert result.data_keys == 2 and result.old_fingerprint != result.new_fingerprint and result.new_kek_b64 is None
    svc.close()
    assert (home / "kek.key").read_bytes() != old_kek
    assert (home / "kek.key").stat().st_mode & 0o777 == 0o600
    assert not (home / "kek.key.new").exists()
    reopened = TenancyService.open(home)  # a fresh process: unwraps with the new KEK from disk
    try:
        assert reopened.authenticate(created.api_key).cipher.decrypt(blob, AAD) == b"before rotation"
    finally:
        reopened.close()
    # the old KEK no longer opens the stored keys
    (home / "kek.key").write_bytes(old_kek)
    with pytest.raises(KeyMaterialError, match="not the one this database"):
        TenancyService.open(home)


def test_a_rotation_cut_short_after_the_db_commit_is_finished_on_open(home: Path, monkeypatch) -> None:
    svc = TenancyService.open(home)
    created = svc.create_tenant("acme")
    blob = svc.authenticate(created.api_key).cipher.encrypt(b"x", AAD)

    real_replace = os.replace

    def crash(src, dst):  # the process dies between the db commit and the final file rename
        if Path(dst).name == "kek.key":
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        svc.rotate_kek()
    monkeypatch.undo()
    svc.close()
    assert (home / "kek.key.new").exists()
    reopened = TenancyService.open(home)
    try:
        assert not (home / "kek.key.new").exists()
        assert reopened.authenticate(created.api_key).cipher.decrypt(blob, AAD) == b"x"
    finally:
        reopened.close()


def test_a_second_concurrent_rotation_fails_cleanly_and_nothing_is_lost(home: Path) -> None:
    a, b = TenancyService.open(home), TenancyService.open(home)
    created = a.create_tenant("acme")
    blob = a.authenticate(created.api_key).cipher.encrypt(b"z", AAD)
    a.rotate_kek()
    with pytest.raises(KeyMaterialError, match="rotated by another process"):
        b.rotate_kek()  # b still holds the old KEK
    a.close()
    b.close()
    with TenancyService.open(home) as again:
        assert again.authenticate(created.api_key).cipher.decrypt(blob, AAD) == b"z"
        again.rotate_kek()  # a fresh process rotates fine


def test_a_process_with_a_stale_kek_wraps_new_data_keys_under_the_current_one(home: Path) -> None:
    gateway, cli = TenancyService.open(home), TenancyService.open(home)
    try:
        cli.rotate_kek()
        created = gateway.create_tenant("late")  # the gateway still holds the pre-rotation KEK
        ctx = gateway.authenticate(created.api_key)
        blob = ctx.cipher.encrypt(b"w", AAD)
    finally:
        gateway.close()
        cli.close()
    with TenancyService.open(home) as fresh:  # only the current KEK on disk: the key must unwrap
        assert fresh.authenticate(created.api_key).cipher.decrypt(blob, AAD) == b"w"


def test_processes_starting_together_on_a_fresh_home_agree_on_one_kek(home: Path) -> None:
    services: list[TenancyService] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            services.append(TenancyService.open(home))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert len({s._kek.fingerprint for s in services}) == 1
        assert len({s._secret.raw for s in services}) == 1
        assert sorted(p.name for p in home.iterdir() if ".tmp" in p.name) == []
    finally:
        for s in services:
            s.close()


def test_kek_from_the_environment_hex_or_base64(home: Path, monkeypatch) -> None:
    raw = os.urandom(32)
    monkeypatch.setenv("PREFIXGATE_KEK", raw.hex())
    svc = TenancyService.open(home)
    created = svc.create_tenant("acme")
    blob = svc.authenticate(created.api_key).cipher.encrypt(b"y", AAD)
    svc.close()
    assert not (home / "kek.key").exists()
    monkeypatch.setenv("PREFIXGATE_KEK", base64.b64encode(raw).decode())
    svc = TenancyService.open(home)
    assert svc.authenticate(created.api_key).cipher.decrypt(blob, AAD) == b"y"
    rotated = svc.rotate_kek()
    svc.close()
    assert rotated.kek_file is None and rotated.new_kek_b64
    with pytest.raises(KeyMaterialError):  # the env still holds the old KEK
        TenancyService.open(home)
    monkeypatch.setenv("PREFIXGATE_KEK", rotated.new_kek_b64)
    svc = TenancyService.open(home)
    try:
        assert svc.authenticate(created.api_key).cipher.decrypt(blob, AAD) == b"y"
    finally:
        svc.close()


@pytest.mark.parametrize("value", ["short", "zz" * 32, base64.b64encode(b"x" * 16).decode()])
def test_a_malformed_env_kek_is_a_clear_error(home: Path, monkeypatch, value: str) -> None:
    monkeypatch.setenv("PREFIXGATE_KEK", value)
    with pytest.raises(KeyMaterialError, match="PREFIXGATE_KEK"):
        TenancyService.open(home)


def test_first_run_creates_the_kek_with_a_warning(home: Path, capsys, caplog) -> None:
    """On stderr, or through logging when the host configured it (pytest does)."""
    TenancyService.open(home).close()
    said = capsys.readouterr().err + caplog.text
    assert "key-encryption key" in said and str(home / "kek.key") in said
    caplog.clear()
    TenancyService.open(home).close()
    assert "key-encryption key" not in capsys.readouterr().err + caplog.text


@pytest.mark.parametrize("filename, words", [("kek.key", r"key-encryption key \(KEK\)"), ("server.secret", "server secret")])
def test_a_missing_secret_next_to_encrypted_data_is_refused_and_none_is_created(
        home: Path, open_service, filename: str, words: str) -> None:
    """Audit finding 4 (SQLite and PostgreSQL): the database records the KEK's / secret's
    fingerprint, so a missing file is an error naming it, and no new random file is left in the
    home (restoring the backup must not mean overwriting one); the backup then opens as before."""
    with open_service(home) as svc:
        key = svc.create_tenant("acme").api_key
    backup = home / f"{filename}.orig"
    (home / filename).rename(backup)
    with pytest.raises(KeyMaterialError, match=f"the {words} file .*{filename} is missing") as err:
        open_service(home)
    assert "\n" not in str(err.value) and "fingerprint" in str(err.value)
    assert sorted(p.name for p in home.iterdir() if p.name.startswith(filename)) == [backup.name]
    backup.rename(home / filename)
    with open_service(home) as svc:
        assert svc.authenticate(key).name == "acme"


def test_secret_files_others_may_read_get_one_warning_each(home: Path, capsys, caplog) -> None:
    """Audit finding 5: accepted (a restored backup must start), with one line per file naming it
    and its mode; none once they are 0600."""
    TenancyService.open(home).close()
    for name in ("kek.key", "server.secret"):
        (home / name).chmod(0o644)
    capsys.readouterr()
    caplog.clear()
    TenancyService.open(home).close()
    said = (capsys.readouterr().err + caplog.text).splitlines()
    for name in ("kek.key", "server.secret"):
        lines = [line for line in said if str(home / name) in line]
        assert len(lines) == 1 and "mode 0644" in lines[0] and f"chmod 600 {home / name}" in lines[0], said
    for name in ("kek.key", "server.secret"):
        (home / name).chmod(0o600)
    caplog.clear()
    TenancyService.open(home).close()
    assert "mode 0" not in capsys.readouterr().err + caplog.text


def test_the_home_the_service_creates_is_0700(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        TenancyService.open(tmp_path / "home").close()
    finally:
        os.umask(old_umask)
    assert (tmp_path / "home").stat().st_mode & 0o777 == 0o700
