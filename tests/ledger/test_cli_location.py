"""`responses-proxy keys ...` opens the ledger the server would open, says which file it
opened, and never makes an empty ledger nobody asked for (run from another directory)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from tests.support.paths import REPO

SECRET_RE = re.compile(r"sk-rp-[A-Za-z0-9_-]+")


def keys(cwd: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RESPONSES_PROXY_CONFIG", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=str(cwd))


def ledger_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ledger: ")]
    assert lines, proc.stderr
    return lines[0][len("ledger: "):]


def server_dir(tmp_path: Path) -> Path:
    """A deployment: config.yaml naming a relative ledger path, beside it."""
    home = tmp_path / "srv"
    home.mkdir()
    (home / "config.yaml").write_text("ledger:\n  path: state/ledger.db\n")
    return home


def test_read_commands_elsewhere_do_not_create_an_empty_ledger(tmp_path):
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    for args in (("keys", "list"), ("keys", "usage"), ("keys", "topup", "key_x", "5"), ("keys", "revoke", "key_x")):
        proc = keys(elsewhere, *args)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert ledger_line(proc) == str((elsewhere / "data" / "ledger.db").resolve())
        assert "no ledger at" in proc.stderr and "--config" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert list(elsewhere.iterdir()) == []  # no data/, no ledger.db


def test_create_elsewhere_without_a_config_refuses(tmp_path):
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    proc = keys(elsewhere, "keys", "create", "alice")
    assert proc.returncode == 1, proc.stdout
    assert not SECRET_RE.search(proc.stdout)
    assert list(elsewhere.iterdir()) == []


def test_the_config_named_by_the_environment_is_the_one_opened(tmp_path):
    home = server_dir(tmp_path)
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    env = {"RESPONSES_PROXY_CONFIG": str(home / "config.yaml")}
    created = keys(elsewhere, "keys", "create", "alice", "--balance", "7", env_extra=env)
    assert created.returncode == 0, created.stderr
    db = (home / "state" / "ledger.db").resolve()
    assert ledger_line(created) == str(db) and db.exists()
    listed = keys(elsewhere, "keys", "list", env_extra=env)
    assert listed.returncode == 0 and "alice" in listed.stdout
    assert ledger_line(listed) == str(db)
    assert list(elsewhere.iterdir()) == []
    # --config after `keys` names it too.
    again = keys(elsewhere, "keys", "--config", str(home / "config.yaml"), "list")
    assert again.returncode == 0 and "alice" in again.stdout and ledger_line(again) == str(db)


def test_config_yaml_in_the_current_directory_is_found(tmp_path):
    home = server_dir(tmp_path)
    created = keys(home, "keys", "create", "bob")
    assert created.returncode == 0, created.stderr
    assert ledger_line(created) == str((home / "state" / "ledger.db").resolve())
    listed = keys(home, "keys", "list")
    assert "bob" in listed.stdout
    # From a subdirectory no config.yaml is found: it says where it looked and stops.
    sub = home / "sub"
    sub.mkdir()
    lost = keys(sub, "keys", "list")
    assert lost.returncode == 1 and ledger_line(lost) == str((sub / "data" / "ledger.db").resolve())


def test_db_names_the_file_and_every_command_prints_it(tmp_path):
    db = tmp_path / "explicit" / "keys.db"
    created = keys(tmp_path, "keys", "--db", str(db), "create", "carol")
    assert created.returncode == 0, created.stderr
    assert ledger_line(created) == str(db.resolve())
    key_id = re.search(r"key_id:\s+(key_[0-9a-f]+)", created.stdout).group(1)
    for args in (("list",), ("usage",), ("topup", key_id, "3"), ("limits", key_id, "--rate", "5"), ("revoke", key_id)):
        proc = keys(tmp_path, "keys", "--db", str(db), *args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert ledger_line(proc) == str(db.resolve())


def test_keys_on_a_postgres_ledger_named_by_the_config(tmp_path, pg_dsn):
    """ledger.backend: postgres with `dsn: ${LEDGER_DSN}`: every command opens that database
    (stderr names host:port/db, never a password), and a key made by the CLI is the server's."""
    import asyncio

    from proxy.ledger import open_ledger

    home = tmp_path / "srv"
    home.mkdir()
    (home / "config.yaml").write_text("ledger:\n  backend: postgres\n  dsn: ${LEDGER_DSN}\n")
    env = {"LEDGER_DSN": pg_dsn}
    created = keys(tmp_path, "keys", "--config", str(home / "config.yaml"), "create", "pg-key", "--balance", "9",
                   env_extra=env)
    assert created.returncode == 0, created.stderr
    assert ledger_line(created).startswith("postgres 127.0.0.1:") and pg_dsn.rsplit("/", 1)[1] in ledger_line(created)
    secret = SECRET_RE.search(created.stdout).group(0)
    key_id = re.search(r"key_id:\s+(key_[0-9a-f]+)", created.stdout).group(1)
    for args in (("list",), ("topup", key_id, "3"), ("limits", key_id, "--rate", "5"), ("show", key_id),
                 ("usage",), ("audit",), ("revoke", key_id)):
        proc = keys(home, "keys", *args, env_extra=env)  # ./config.yaml found
        assert proc.returncode == 0, (args, proc.stderr)
        assert secret not in proc.stdout + proc.stderr
    assert list(home.iterdir()) == [home / "config.yaml"]  # no sqlite file made on the side

    async def check() -> None:
        led = open_ledger({"backend": "postgres", "dsn": pg_dsn, "spool_path": str(tmp_path / "s.jsonl")})
        async with led:
            record = await led.get_key(key_id)
            assert (record.balance_micros, record.rate_per_min, record.revoked) == (12, 5, True)
            assert [e.action for e in await led.list_audit()][:2] == ["key.revoke", "key.update"]

    asyncio.run(check())
    unset = keys(home, "keys", "list", env_extra={"LEDGER_DSN": ""})
    assert unset.returncode != 0 and "Traceback" not in unset.stderr
