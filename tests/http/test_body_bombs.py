"""Compressed request bodies are decoded with a bound: every decoder stops at
max_body_bytes + 1 while decoding, so a bomb costs its compressed size plus the limit, not
its expanded size. Measured by the peak RSS of a real proxy process, not only by status."""

from __future__ import annotations

import http.client
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml
import zstandard

from proxy.http.request import DECODERS
from tests.conftest import free_port
from tests.support.paths import REPO as ROOT

MiB = 1 << 20
CHUNK = bytes(MiB)


def _zeros_deflate(total: int) -> bytes:
    """Raw deflate of `total` zeros: one full-flushed 1 MiB block repeated (a full flush
    resets the window, so every block compresses alike): ~1 KiB per MiB, built in a blink."""
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = z.compress(CHUNK) + z.flush(zlib.Z_FULL_FLUSH)
    return block * (total // MiB) + z.flush()


def gzip_bomb(total: int) -> bytes:
    crc = 0
    for _ in range(total // MiB):
        crc = zlib.crc32(CHUNK, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + _zeros_deflate(total) + struct.pack("<II", crc, total % 2**32)


def deflate_bomb(total: int) -> bytes:
    adler = 1
    for _ in range(total // MiB):
        adler = zlib.adler32(CHUNK, adler)
    return b"\x78\xda" + _zeros_deflate(total) + struct.pack(">I", adler)


def zstd_bomb(total: int) -> bytes:
    c = zstandard.ZstdCompressor(level=1).compressobj()  # streamed: the header declares no size
    return b"".join([c.compress(CHUNK) for _ in range(total // MiB)] + [c.flush()])


# One per Content-Encoding the proxy decodes: a decoder added without its bomb fails below.
BOMBS = {"gzip": gzip_bomb, "x-gzip": gzip_bomb, "deflate": deflate_bomb, "zstd": zstd_bomb}


def test_every_decoder_has_a_bomb():
    assert set(DECODERS) <= set(BOMBS), set(DECODERS) - set(BOMBS)


@pytest.mark.parametrize("encoding", sorted(DECODERS))
def test_every_decoder_stops_at_its_cap(encoding):
    """In process: each decoder returns at most `cap` bytes of a 256 MiB bomb, and the Python
    heap (where the decoded bytes live) never holds much more than that."""
    bomb = BOMBS[encoding](256 * MiB)
    cap = MiB + 1
    tracemalloc.start()
    try:
        out = DECODERS[encoding](bomb, cap)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(out) == cap
    assert peak < 4 * MiB, peak


# --------------------------------------------------------------------------- a real process


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


@pytest.fixture(scope="module")
def proxy_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bombs")
    config = tmp / "proxy.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"log_format": "json", "log_level": "warning"},
        "workers": [{"name": "local", "url": "embedded", "models": ["tiny-org/tiny-model"]}],
        "ledger": {"path": str(tmp / "ledger.db")},
        "auth": {"demo_key": True},
    }))
    port = free_port()
    log = open(tmp / "proxy.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "--config", str(config), "serve", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log)
    try:
        key = ""
        while not key:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError((tmp / "proxy.log").read_text()[-2000:])
            if line.startswith(b"demo key: "):
                key = line.decode().split(": ", 1)[1].strip()
        yield proc, port, key
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _post(port: int, key: str, body: bytes, encoding: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/responses", body=body, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json", "Content-Encoding": encoding})
        resp = conn.getresponse()
        return resp.status, orjson.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd"])
def test_a_bomb_costs_the_limit_not_its_expansion(proxy_process, encoding):
    """A body expanding to 1 GiB of zeros: 413, and the proxy's peak RSS grows by far less
    than the expansion (the 8 MiB limit, the compressed body and the decoder's state)."""
    proc, port, key = proxy_process
    small = BOMBS[encoding](2 * MiB)  # warm-up: the same decoder, under the limit (zeros: not JSON)
    status, error = _post(port, key, small, encoding)
    assert status == 400 and error["error"]["code"] == "invalid_json", error
    bomb = BOMBS[encoding](1024 * MiB)
    baseline = _status_kib(proc.pid, "VmRSS")
    try:
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pytest.skip("cannot reset the peak RSS of a process here")
    status, error = _post(port, key, bomb, encoding)
    growth_mib = (_status_kib(proc.pid, "VmHWM") - baseline) / 1024
    assert status == 413 and error["error"]["code"] == "request_too_large", error
    assert growth_mib < 64, f"{encoding}: peak RSS grew by {growth_mib:.0f} MiB"


# --------------------------------------------------------------------------- statuses


async def _send(proxy, body: bytes, encodings: list[str]) -> tuple[int, dict]:
    headers = [("Authorization", f"Bearer {proxy.api_key}"), ("Content-Type", "application/json")]
    headers += [("Content-Encoding", e) for e in encodings]
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/responses", data=body, headers=headers) as resp:
            return resp.status, await resp.json()


BODY = orjson.dumps({"model": "tiny-org/tiny-model", "input": "hello", "max_output_tokens": 5})
SMALL = {"server": {"log_format": "json", "max_body_bytes": 2 * MiB}}


@pytest.mark.parametrize("encodings", [["gzip, gzip"], ["gzip", "gzip"], ["deflate, zstd"], ["zstd", "gzip"]])
async def test_stacked_encodings_are_refused(sim, make_proxy, encodings):
    proxy = await make_proxy()
    status, body = await _send(proxy, zlib.compress(zlib.compress(BODY)), encodings)
    assert status == 415 and body["error"]["code"] == "unsupported_encoding", body
    assert "Stacked" in body["error"]["message"]


async def test_identity_beside_one_encoding_is_that_encoding(sim, make_proxy):
    proxy = await make_proxy()
    status, body = await _send(proxy, zlib.compress(BODY), ["identity, deflate"])
    assert status == 200, body


async def test_multi_member_gzip_is_read_whole(sim, make_proxy):
    proxy = await make_proxy()
    half = len(BODY) // 2
    members = zlib.compress(BODY[:half], wbits=31) + zlib.compress(BODY[half:], wbits=31)
    status, body = await _send(proxy, members, ["gzip"])
    assert status == 200, body


async def test_multi_member_gzip_is_bounded_across_members(sim, make_proxy):
    proxy = await make_proxy(SMALL)
    members = gzip_bomb(MiB) * 3  # each member under the limit, the three over it
    status, body = await _send(proxy, members, ["gzip"])
    assert status == 413 and body["error"]["code"] == "request_too_large", body


async def test_multi_frame_zstd_is_bounded_across_frames(sim, make_proxy):
    proxy = await make_proxy(SMALL)
    frames = zstandard.ZstdCompressor().compress(bytes(MiB)) * 3
    status, body = await _send(proxy, frames, ["zstd"])
    assert status == 413 and body["error"]["code"] == "request_too_large", body


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_truncated_stream_is_a_400(sim, make_proxy, encoding):
    proxy = await make_proxy()
    packed = zlib.compress(BODY, wbits=31 if encoding == "gzip" else 15)
    status, body = await _send(proxy, packed[:-12], [encoding])
    assert status == 400 and body["error"]["code"] == "invalid_body", body


async def test_a_zstd_frame_asking_for_a_huge_window_is_refused(sim, make_proxy):
    """A frame header may ask the decoder for a window far beyond what a body within the limit
    needs (64 MiB here; zstd's own default ceiling is 128 MiB): refused, not allocated."""
    proxy = await make_proxy()
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=26)
    c = zstandard.ZstdCompressor(compression_params=params).compressobj()  # streamed: the window stays
    packed = c.compress(BODY) + c.flush()
    assert zstandard.get_frame_parameters(packed).window_size == 1 << 26
    status, body = await _send(proxy, packed, ["zstd"])
    assert status == 400 and body["error"]["code"] == "invalid_body", body
