"""`responses-proxy orgs|teams|users` and the keys commands of the organisation (create under a
team or a user, rotate with a grace, block, unblock, delete), run as an operator runs them: the
console script in a subprocess against a real SQLite ledger file, read back through the ledger."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from proxy.ledger import open_ledger
from tests.ledger.test_ledger import subprocess_env


def cli(db: Path, *args: str) -> subprocess.CompletedProcess:
    command, rest = args[0], args[1:]
    return subprocess.run([sys.executable, "-m", "proxy", command, "--db", str(db), *rest], capture_output=True,
                          text=True, timeout=60, env=subprocess_env(), cwd=str(db.parent))


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_a_team_made_from_the_command_line_pays_for_its_keys(tmp_path):
    db = tmp_path / "ledger.db"
    ok(cli(db, "orgs", "create", "acme", "--id", "org_acme", "--balance-usd", "1000"))
    ok(cli(db, "teams", "create", "ml", "--id", "team_ml", "--org", "org_acme", "--balance-usd", "20",
           "--budget-usd", "5", "--period", "weekly", "--reset", "UTC-08:00"))
    user = json.loads(ok(cli(db, "users", "create", "ann", "--team", "team_ml", "--budget-usd", "1",
                             "--period", "daily", "--json")))
    created = ok(cli(db, "keys", "create", "laptop", "--user", user["level_id"]))
    key_id = re.search(r"key_id:\s+(key_[0-9a-f]+)", created).group(1)
    assert "purse of" in created
    ok(cli(db, "teams", "update", "team_ml", "--rate", "600", "--models", "qwen/*,tiny-org/*"))
    assert "balance $70.00" in ok(cli(db, "teams", "topup", "team_ml", "--usd", "50"))
    listed = json.loads(ok(cli(db, "teams", "list", "--json")))
    assert [t["level_id"] for t in listed] == ["team_ml"] and listed[0]["rate_per_min"] == 600
    shown = json.loads(ok(cli(db, "teams", "show", "team_ml", "--json")))
    assert shown["keys"] == [key_id] and shown["available_micros"] == 5_000_000
    refused = cli(db, "teams", "update", "team_ml", "--budget-usd", "1,5")
    assert refused.returncode == 1 and "not an amount of dollars" in refused.stderr
    refused = cli(db, "users", "create", "bob", "--team", "org_acme")
    assert refused.returncode == 1 and "must be a team" in refused.stderr
    # The key's lifecycle.
    rotated = ok(cli(db, "keys", "rotate", key_id, "--grace", "1h"))
    assert "previous secret works until" in rotated
    ok(cli(db, "keys", "block", key_id))
    async with open_ledger({"path": str(db)}) as ledger:
        record = await ledger.get_key(key_id)
        assert record.blocked and record.user_id == user["level_id"] and record.team_id == "team_ml"
        assert record.grace_until is not None
    ok(cli(db, "keys", "unblock", key_id))
    ok(cli(db, "keys", "delete", key_id))
    assert key_id not in ok(cli(db, "keys", "list"))
    actions = [e["action"] for e in json.loads(ok(cli(db, "keys", "audit", "--json")))]
    assert actions == ["key.delete", "key.unblock", "key.block", "key.rotate", "team.topup", "team.update",
                       "key.create", "user.create", "team.create", "org.create"]
