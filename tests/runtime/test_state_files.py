"""The files the proxy trusts are its own: a state folder others can write, or a secret another
user planted, stops the start with one line naming the path; the ledger's files are readable by
their owner alone; a restart's new demo admin key ends the old key's dashboard sessions."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.admin.auth import AdminAuth
from proxy.config.load import Config
from proxy.ledger.sqlite.ledger import SQLiteLedger
from proxy.runtime.local_keys import SESSION_FILE, LocalKeyError, ensure
from tests.support.paths import REPO as ROOT

OTHER_UID = 65534  # nobody


def _config(folder: Path) -> Config:
    return Config.from_dict({"ledger": {"path": str(folder / "ledger.db")}, "auth": {"demo_key": True}})


def _serve_fails(folder: Path, tmp_path: Path) -> str:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"ledger: {{path: {folder / 'ledger.db'}}}\n")
    done = subprocess.run([sys.executable, "-m", "proxy", "--config", str(cfg), "serve", "--demo-key",
                           "--port", "1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-500:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_a_world_writable_state_folder_is_refused_at_start(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)  # what /tmp is
    with pytest.raises(LocalKeyError, match="writable by other users"):
        ensure(_config(folder))
    line = _serve_fails(folder, tmp_path)
    assert str(folder) in line and "writable by other users" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file of another user needs root (CI runs as root)")
def test_a_session_key_planted_by_another_user_is_refused_at_start(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir(mode=0o700)
    planted = folder / SESSION_FILE
    planted.write_text("chosen-by-the-attacker-0123456789\n")
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(LocalKeyError, match="owned by uid"):
        ensure(_config(folder))
    line = _serve_fails(folder, tmp_path)
    assert str(planted) in line and "owned by uid" in line


def test_a_secret_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir(mode=0o700)
    planted = folder / SESSION_FILE
    planted.write_text("x" * 40 + "\n")
    planted.chmod(0o666)
    with pytest.raises(LocalKeyError, match="writable by other users"):
        ensure(_config(folder))


def test_a_new_state_folder_is_private(tmp_path):
    folder = tmp_path / "new" / "data"
    made = ensure(_config(folder))
    assert made.folder == folder and stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in os.listdir(folder):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name


async def test_the_ledger_files_are_readable_by_their_owner_alone(tmp_path):
    old = tmp_path / "old.db"
    old.write_bytes(b"")
    old.chmod(0o644)  # a ledger made by an earlier release
    for path in (tmp_path / "ledger.db", old):
        ledger = SQLiteLedger(str(path))
        await ledger.start()
        await ledger.create_key("k", balance_micros=5)
        files = [p for p in tmp_path.iterdir() if p.name.startswith(path.name)]
        assert {p.name for p in files} >= {path.name, path.name + "-wal", path.name + "-shm"}
        for p in files:
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        await ledger.close()


def test_a_restart_with_a_new_demo_admin_key_ends_the_old_ones_sessions(tmp_path):
    """The session secret is kept in the state folder across restarts; the demo admin key is new
    at every start: a session made with the old key, logged out or not, is refused."""
    folder = tmp_path / "data"
    first = _config(folder)
    ensure(first)
    before = AdminAuth(first.admin)
    token, _ = before.issue("demo")
    assert before.verify(token) is not None
    second = _config(folder)
    ensure(second)
    assert second.admin.session_secret == first.admin.session_secret  # the same kept secret
    after = AdminAuth(second.admin)
    assert after.verify(token) is None
    fresh, _ = after.issue("demo")
    assert after.verify(fresh) is not None
