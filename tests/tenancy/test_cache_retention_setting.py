"""The tenant setting cache_retention_s (explicit cache control for every prompt of a tenant)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.main import main
from tenancy.errors import InvalidSettingError
from tenancy.service import TenancyService


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_setting_reaches_the_context_and_is_validated(home: Path) -> None:
    with TenancyService.open(home) as svc:
        key = svc.create_tenant("acme", cache_retention_s=3600).api_key
        assert svc.authenticate(key).cache_retention_s == 3600.0
        svc.update_tenant("acme", cache_retention_s=None)
        assert svc.get_tenant_by_name("acme").cache_retention_s is None
        for bad in (0, -5, "1h", True):
            with pytest.raises(InvalidSettingError, match="cache_retention_s"):
                svc.update_tenant("acme", cache_retention_s=bad)


def test_cli_sets_shows_and_clears_it(capsys, home: Path) -> None:
    h = ["--home", str(home)]
    assert run(capsys, *h, "tenant", "create", "acme", "--cache-retention", "1h")[0] == 0
    code, out, _ = run(capsys, *h, "tenant", "show", "acme", "--json")
    assert code == 0 and json.loads(out)["cache_retention_s"] == 3600.0
    assert run(capsys, *h, "tenant", "set", "acme", "--cache-retention", "90")[0] == 0
    assert "retention   90 s" in run(capsys, *h, "tenant", "show", "acme")[1]
    assert run(capsys, *h, "tenant", "set", "acme", "--cache-retention", "none")[0] == 0
    assert json.loads(run(capsys, *h, "tenant", "show", "acme", "--json")[1])["cache_retention_s"] is None
    with pytest.raises(SystemExit) as exit_:  # argparse's own error: usage line, message, status 2
        main([*h, "tenant", "set", "acme", "--cache-retention", "soon"])
    assert exit_.value.code == 2 and "expected a duration" in capsys.readouterr().err
