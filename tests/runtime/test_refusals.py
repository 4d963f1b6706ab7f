"""The refusals the console's Errors view lists (proxy/runtime/refusals.py): every request
answered 4xx (but 499) or 5xx, from its access record; kept in a bounded ring per process, and
with `serve --workers N` in one file per process in the shared directory, which any process
reads. Over HTTP: /admin/api/overview's `errors` and `error_counts`."""

from __future__ import annotations

import os
import time

import aiohttp
import orjson
import pytest

from proxy.runtime import refusals as refusals_module
from proxy.runtime.refusals import Refusals, is_refusal
from tests.support.paths import REPO

ADMIN_KEY = "adm-refusals-0123456789abcdef"


def test_what_is_a_refusal():
    assert [s for s in (200, 101, 302, 400, 401, 402, 404, 429, 499, 500, 502, 503) if is_refusal(s)] == [
        400, 401, 402, 404, 429, 500, 502, 503]


def test_one_process_keeps_a_bounded_ring_newest_first():
    log = Refusals(capacity=3)
    for i in range(5):
        log.record("/v1/responses", request_id=f"r{i}", status=401)
    assert [e["request_id"] for e in log.since(0)] == ["r4", "r3", "r2"]
    assert log.since(time.time() + 1) == [] and log.scope == "this process"


def test_the_consoles_own_paths_are_not_recorded():
    log = Refusals()
    log.ignore_prefix = "/admin"
    for path in ("/admin", "/admin/api/session", "/admin/login"):
        log.record(path, status=401)
    log.record("/administrator", status=404)  # not the console's: a path of its own
    assert [e["path"] for e in log.since(0)] == ["/administrator"]


def test_the_processes_of_one_server_read_each_others_records(tmp_path):
    one, two = Refusals(str(tmp_path), name="refusals-1.jsonl"), Refusals(str(tmp_path), name="refusals-2.jsonl")
    one.record("/v1/responses", request_id="a", status=402)
    two.record("/v1/nothing", request_id="b", status=404)
    one.flush(), two.flush()
    (tmp_path / "refusals-3.jsonl").write_bytes(b'{"time": 1e12, "request_id": "torn"')  # a line being written
    for log in (one, two):
        assert sorted(e["request_id"] for e in log.since(0)) == ["a", "b"]
    assert one.scope == "every process of this server"
    one.close(), two.close()


def test_a_process_keeps_at_most_two_files_of_its_records(tmp_path, monkeypatch):
    monkeypatch.setattr(refusals_module, "FILE_BYTES", 2000)
    log = Refusals(str(tmp_path), name="refusals-9.jsonl")
    for i in range(100):
        log.record("/v1/responses", request_id=f"r{i:03d}", status=429)
        log.flush()
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["refusals-9.jsonl", "refusals-9.jsonl.1"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 2 * 2000
    kept = [e["request_id"] for e in log.since(0)]
    assert kept[0] == "r099" and kept == sorted(kept, reverse=True) and len(kept) < 100


def test_files_of_processes_long_gone_are_removed(tmp_path):
    old = tmp_path / "refusals-1.jsonl"
    old.write_bytes(orjson.dumps({"time": 1.0, "status": 401}) + b"\n")
    os.utime(old, (1.0, 1.0))
    log = Refusals(str(tmp_path), name="refusals-2.jsonl")
    log.record("/v1/responses", status=401)
    log.flush()
    assert not old.exists() and (tmp_path / "refusals-2.jsonl").exists()
    log.close()


async def test_the_overview_lists_refusals_and_failed_answers(make_proxy):
    proxy = await make_proxy({"admin": {"keys": [{"name": "ops", "key": ADMIN_KEY}]}, "auth": {"demo_key": True},
                              "prices": {"default": {"input": 1_000_000, "cached_input": 1_000_000, "output": 1_000_000}}})
    broke, record = await proxy.ledger.create_key("broke", 0)
    body = {"model": "tiny-org/tiny-model", "input": "hi"}
    async with aiohttp.ClientSession() as http:
        async with http.get(proxy.url + "/admin/api/overview") as r:  # the console's own 401: not listed
            assert r.status == 401
        for _ in range(3):
            async with http.get(proxy.url + "/v1/nothing") as r:
                assert r.status == 404
        async with http.post(proxy.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {broke}"}) as r:
            assert r.status == 402
        async with http.post(proxy.url + "/v1/responses", json=body, headers={"Authorization": "Bearer sk-rp-nope"}) as r:
            assert r.status == 401
        async with http.get(proxy.url + "/admin/api/overview", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            data = await r.json()
    assert data["error_counts"] == {"401": 1, "402": 1, "404": 3}
    assert data["errors_scope"] == "this process"
    rows = data["errors"]
    assert [r["status"] for r in rows] == [401, 402, 404, 404, 404]  # newest first
    spent = rows[1]
    assert (spent["error_code"], spent["key_id"], spent["path"], spent["transport"], spent["cost_micros"]) == (
        "insufficient_quota", record.key_id, "/v1/responses", "http", None)
    assert all(not r["path"].startswith("/admin") for r in rows)


@pytest.mark.slow
async def test_every_process_of_serve_workers_2_lists_every_refusal(tmp_path):
    """`serve --workers 2`: refusals answered by either process are listed by the console in
    whichever process answers it (each overview on a connection of its own)."""
    import signal
    import subprocess
    import sys

    from tests.conftest import eventually, free_port
    from tests.runtime.test_metrics_multiprocess import _fresh, _listening_children

    repo = REPO
    port = free_port()
    (tmp_path / "tmp").mkdir()
    (tmp_path / "config.yaml").write_text(f'admin:\n  keys:\n    - {{name: ops, key: "{ADMIN_KEY}"}}\n'
                                          f'  session_secret: "{"s" * 32}"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("RESPONSES_PROXY_CONFIG", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(PYTHONPATH=str(repo), TMPDIR=str(tmp_path / "tmp"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "2"], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for line in proc.stdout:
            if "listening on" in line:
                break
        await eventually(lambda: _listening_children(proc.pid, port) == 2, 60, what="both serving processes listening")
        statuses = [(await _fresh("GET", url + "/v1/nothing"))[0] for _ in range(12)]
        statuses += [(await _fresh("GET", url + "/v1/models", headers={"Authorization": "Bearer sk-rp-no"}))[0]
                     for _ in range(6)]
        assert statuses == [404] * 12 + [401] * 6
        for _ in range(6):
            status, raw = await _fresh("GET", url + "/admin/api/overview", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert status == 200
            data = orjson.loads(raw)
            assert data["error_counts"] == {"401": 6, "404": 12}, data["error_counts"]
            assert data["errors_scope"] == "every process of this server" and len(data["errors"]) == 18
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()
        proc.stdout.close()
