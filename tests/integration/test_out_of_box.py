"""Out of the box (issue 27): `serve --demo-key` on the embedded defaults, as `make run` starts
it, serves every endpoint: /v1/responses/compact with a sealing key made at first start and
kept beside the ledger (mode 0600, reused, never printed), the console with a demo admin key
printed with the dashboard's URL; a configured key always wins; `--workers N` shares one
session secret (or warns) and refuses a fixed simulator port; worker URLs are checked."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import eventually_sync, free_port
from tests.support.paths import REPO

SEAL_KEY = "q0LhY3qRmPBqz9yB7d1bqk0bZbn3oVh0vE4b7bq7Sxw="  # base64 of 32 bytes
ADMIN_KEY = "ops-admin-key-0123456789"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RESPONSES_PROXY_CONFIG", "RESPONSES_PROXY_SEAL_KEY", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **extra)
    return env


class Served:
    """`python -m proxy serve --demo-key` in `cwd` (no config.yaml there: the embedded defaults)."""

    def __init__(self, cwd: Path, *args: str, config: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.err_path = cwd / f"stderr-{self.port}.log"
        self._err = open(self.err_path, "w")
        named = ["--config", str(config)] if config is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", *named, "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--demo-key", *args],
            cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if "listening on" in line:
                    break
            else:
                raise AssertionError(f"serve exited: {self.stderr()[-2000:]}")
            self._wait_ready()
        except BaseException:
            self.proc.kill()  # never leave a server behind
            self.proc.wait()
            raise

    def _wait_ready(self) -> None:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        eventually_sync(ready, 60, what="serve ready")

    def line(self, prefix: str) -> str | None:
        found = [line for line in self.lines if line.startswith(prefix)]
        assert len(found) <= 1, found
        return found[0][len(prefix):] if found else None

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.err_path.read_text()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        self._err.close()
        self.lines += out.splitlines()
        return "\n".join(self.lines)


def call(url: str, body: dict | None = None, headers: dict | None = None,
         method: str | None = None) -> tuple[int, dict, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            status, got, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        status, got, raw = exc.code, dict(exc.headers), exc.read()
    try:
        return status, got, json.loads(raw)
    except ValueError:
        return status, got, raw.decode(errors="replace")


WINDOW = [{"type": "message", "role": "user", "content": "We launch on Tuesday."},
          {"type": "message", "role": "assistant", "content": "Tuesday it is."},
          {"type": "message", "role": "user", "content": "And notify support first."}]


def _compact(url: str, key: str) -> list[dict]:
    status, _, body = call(url + "/v1/responses/compact", {"model": "tiny-org/tiny-model", "input": WINDOW},
                           {"Authorization": f"Bearer {key}"})
    assert status == 200, body
    assert any(item["type"] == "compaction" for item in body["output"]), body
    return body["output"]


def _continue(url: str, key: str, window: list[dict]) -> tuple[int, object]:
    status, _, body = call(url + "/v1/responses", {
        "model": "tiny-org/tiny-model", "max_output_tokens": 16,
        "input": window + [{"type": "message", "role": "user", "content": "So, when?"}]},
        {"Authorization": f"Bearer {key}"})
    return status, body


def _login(url: str, admin_key: str) -> str:
    status, headers, body = call(url + "/admin/login", {"key": admin_key})
    assert status == 200, body
    return headers["Set-Cookie"].split(";", 1)[0]


def test_make_run_serves_compaction_and_the_console_and_keeps_its_secrets(tmp_path):
    served = Served(tmp_path)
    try:
        demo = served.line("demo key: ")
        admin_line = served.line("admin key: ")
        assert demo and admin_line, served.lines
        admin_key, _, shown = admin_line.partition(" ")
        assert shown == f"(dashboard: {served.url}/admin/)"
        window = _compact(served.url, demo)  # was 501 compaction_unavailable
        assert _continue(served.url, demo, window)[0] == 200
        status, _, page = call(served.url + "/admin/")  # was a bare 404
        assert status == 200 and "<html" in str(page).lower()
        cookie = _login(served.url, admin_key)
        status, _, listed = call(served.url + "/admin/api/keys", headers={"Cookie": cookie})
        assert status == 200 and any(k["name"] == "demo" for k in listed["data"])
        # A key that outlives the restart (the demo key is new at every start).
        status, _, made = call(served.url + "/admin/api/keys", {"name": "kept", "balance_micros": 10_000_000},
                               {"Authorization": f"Bearer {admin_key}"})
        assert status in (200, 201), made
        kept_window = _compact(served.url, made["secret"])
    finally:
        out = served.stop()
    err = served.stderr()
    data = tmp_path / "data"
    seal, session = data / "seal.key", data / "admin-session.key"
    assert stat.S_IMODE(seal.stat().st_mode) == 0o600 and stat.S_IMODE(session.stat().st_mode) == 0o600
    secrets_made = (seal.read_text().strip(), session.read_text().strip())
    for secret in secrets_made:  # never printed
        assert secret not in out and secret not in err
    assert "warning" not in err.lower(), err  # no warnings of our own making at start

    again = Served(tmp_path)
    try:
        assert (seal.read_text().strip(), session.read_text().strip()) == secrets_made  # reused, not remade
        assert again.line("admin key: ").split(" ")[0] != admin_key  # a fresh demo admin key
        status, body = _continue(again.url, made["secret"], kept_window)
        assert status == 200, body  # sealed before the restart, opened after it
        status, _, _ = call(again.url + "/admin/api/session", headers={"Cookie": cookie})
        assert status == 401  # the old demo admin key's session ends with it, though the secret is kept
        new_cookie = _login(again.url, again.line("admin key: ").split(" ")[0])
        status, _, _ = call(again.url + "/admin/api/session", headers={"Cookie": new_cookie})
        assert status == 200
    finally:
        again.stop()


def test_a_configured_key_always_wins(tmp_path):
    (tmp_path / "config.yaml").write_text(
        f"reasoning_seal: {{keys: {{k1: '{SEAL_KEY}'}}}}\n"
        f"admin: {{keys: [{{name: ops, key: {ADMIN_KEY}}}], session_secret: '{'s' * 32}'}}\n")
    served = Served(tmp_path, config=tmp_path / "config.yaml")
    try:
        assert served.line("admin key: ") is None  # the config names admin keys: no demo admin key
        window = _compact(served.url, served.line("demo key: "))
        sealed = next(item for item in window if item["type"] == "compaction")["encrypted_content"]
        assert sealed.startswith("rp2.k1.")
        assert call(served.url + "/admin/api/keys", headers={"Authorization": f"Bearer {ADMIN_KEY}"})[0] == 200
    finally:
        served.stop()
    assert not (tmp_path / "data" / "seal.key").exists() and not (tmp_path / "data" / "admin-session.key").exists()

    other = tmp_path / "env"
    other.mkdir()
    served = Served(other, env=_env(RESPONSES_PROXY_SEAL_KEY=SEAL_KEY))  # the environment's key wins too
    try:
        window = _compact(served.url, served.line("demo key: "))
        assert next(i for i in window if i["type"] == "compaction")["encrypted_content"].startswith("rp2.env.")
    finally:
        served.stop()
    assert not (other / "data" / "seal.key").exists() and (other / "data" / "admin-session.key").exists()


async def test_the_console_when_off_says_why(make_proxy, http):
    proxy = await make_proxy()  # no admin.keys
    for path in ("/admin", "/admin/", "/admin/api/keys"):
        async with http.get(proxy.url + path) as r:
            assert r.status == 404
            message = (await r.json())["error"]["message"]
            assert "The operator's console is off: no admin.keys are configured" in message, message
    async with http.get(proxy.url + "/administrator") as r:
        assert "console" not in (await r.json())["error"]["message"]


@pytest.mark.slow
def test_workers_share_one_session_secret(tmp_path):
    from tests.runtime.test_metrics_multiprocess import _listening_children

    # An operator's admin key and no admin.session_secret: the secret is made in data/ and shared.
    (tmp_path / "config.yaml").write_text(f"admin: {{keys: [{{name: ops, key: {ADMIN_KEY}}}]}}\n")
    served = Served(tmp_path, "--workers", "2", config=tmp_path / "config.yaml")
    try:
        admin_key = ADMIN_KEY
        eventually_sync(lambda: _listening_children(served.proc.pid, served.port) == 2, 60,
                        what="both serving processes listening")
        cookie = _login(served.url, admin_key)
        statuses = [call(served.url + "/admin/api/session", headers={"Cookie": cookie, "Connection": "close"})[0]
                    for _ in range(12)]  # urllib: a new connection each, spread over both processes
        assert statuses == [200] * 12  # was: 8 of 12 logged out
        assert "warning" not in served.stderr().lower()
    finally:
        served.stop()
    assert (tmp_path / "data" / "admin-session.key").exists()


def test_workers_warn_when_no_session_secret_can_be_shared(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "config.yaml").write_text(
        f"ledger: {{backend: none, path: {tmp_path / 'file' / 'ledger.db'}}}\n"
        f"admin: {{keys: [{{name: ops, key: {ADMIN_KEY}}}]}}\n")
    served = Served(tmp_path, "--workers", "2", config=tmp_path / "config.yaml")
    try:
        err = served.stderr()
    finally:
        served.stop()
    assert "responses-proxy: warning: 2 processes and no admin.session_secret they can share" in err, err


def test_workers_refuse_a_fixed_simulator_port_at_once(tmp_path):
    port = free_port()
    (tmp_path / "config.yaml").write_text(f"simulator: {{port: {port}}}\nledger: {{path: {tmp_path / 'l.db'}}}\n")
    proc = subprocess.run([sys.executable, "-m", "proxy", "--config", str(tmp_path / "config.yaml"), "serve",
                           "--port", str(free_port()), "--workers", "2"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""  # no "listening on", no demo key
    assert proc.stderr.strip().splitlines() == [
        f"responses-proxy: configuration error: simulator.port is {port}, but with 2 processes (serve --workers, "
        "server.workers) each starts its own embedded simulator and only one can listen there: set simulator.port: 0 "
        "(any free port) or serve with one process"]


@pytest.mark.parametrize("url", ["htp://10.0.0.5:8000", "not a url", "http://", "http://10.0.0.5:99999"])
def test_a_worker_url_must_be_http_with_a_host(tmp_path, url):
    config = tmp_path / "config.yaml"
    config.write_text(f"workers:\n  - {{name: gpu-a, url: '{url}'}}\nledger: {{path: {tmp_path / 'l.db'}}}\n")
    expected = (f"responses-proxy: configuration error: {config}: workers[0].url must be an http:// or https:// URL "
                f"with a host (e.g. http://10.0.0.5:8000) or embedded, not {url!r}")
    for command in (["config", "check"], ["serve", "--port", str(free_port())]):
        proc = subprocess.run([sys.executable, "-m", "proxy", "--config", str(config), *command], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert (proc.stdout + proc.stderr).strip().splitlines() == [expected]
