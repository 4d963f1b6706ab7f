"""`responses-proxy keys ...` opens the ledger the server would open, says which file it
opened, and never makes an empty ledger nobody asked for (run from another directory)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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
