"""Instructions per request under callgrind: the proxy against the bare pass-through, a count
the shared machine's noise does not move.

    .venv/bin/python -m bench.instructions                  # every row (~8 min on 2 cores)
    .venv/bin/python -m bench.instructions --only proxy,pass-through
    .venv/bin/python -m bench.instructions --out bench/results.md   # also replaces its section there

Wall-clock CPU per request swings by +-20-30% between two runs of the same commit on this
machine (`make bench`), so a ratio near a target could not be decided. valgrind's callgrind
counts every instruction the server process executes (Ir), Python and C alike (aiohttp's
parser, orjson, sqlite3, uvloop, the ledger's writer thread: every thread, one total), and the
count repeats from run to run.

Each server runs under `valgrind --tool=callgrind --dump-instr=no` through a small wrapper
that, on SIGUSR1, asks callgrind for a dump (bench/callgrind_mark.c, a client request through
ctypes): the dump holds the instructions since the previous one, every thread's. One
keep-alive client (aiohttp, outside valgrind) sends, per case, W warm-up requests, then N1,
then N2 requests, one at a time, with a dump after each group (after a pause that lets the
request's tail run: its access line, its usage row's commit). The per-request figure is
(Ir of the N2 group - Ir of the N1 group) / (N2 - N1): start-up, the dump itself and any
fixed cost of a group cancel out. Servers (loopback only): the C fake upstream
(bench/fake_upstream.c), bench/passthrough.py, and the proxy with its full default chain
(bench.trees' config: a real key in a temp SQLite ledger, JSON access log to a file), and the
same proxy with one part off, by config: auth (`auth.enabled: false`; balance needs the key,
so this row is auth + balance), limits, balance, access log (`server.log_level: warning`:
no access line), metrics (`metrics.enabled: false`). Health checks every hour (not every 5 s:
a check is timed, not per request).

Cases: non-stream (bench-json), a coalesced stream (bench-coalesced: 100 deltas in one
upstream write) and a stream paced so that each read holds one delta (bench-chunked, deltas
--gap-us apart: 10 ms by default: under valgrind a delta costs the proxy 1-2 ms, more on a busy machine,
and a read that finds two deltas would halve the reads counted).
And the WebSocket transport: the same streams as one socket turn each (`response.create` on
one socket, no permessage-deflate: the HTTP stream is not compressed either) against the same
request over HTTP SSE, on the full proxy; plus a coalesced turn on a socket that negotiated
permessage-deflate, for scale (every event is then compressed).

The leases run on the wall clock, and under valgrind a request takes ~50x longer: leased
usage rows are committed every `balance.lease_commit_ms` (20 ms), about one commit per 40
requests of a busy client at native speed, but one per request or two here, and as many as
the machine's load makes (a count that moved by +-5% between runs). So the rows are committed
by count instead: `lease_commit_rows` 40, the interval an hour, and every group is a multiple
of 40 requests (non-stream, coalesced; the paced stream's groups are too short to matter: a
commit is ~0.2% of one of its requests), so each group holds exactly its share of commits
whatever the clock says. The lease's other wall-clock settings run on valgrind's clock:
times x --slowdown (50: leases of 100 s, given back after 100 s idle), the rate / 50 (at
least 1/s): the key is leased, as a busy key is, in every case. The WebSocket pings
(`ping_interval_s`, 30 s) are on valgrind's clock too. Nothing else in the chain is changed.

Targets (issue 28), proxy over pass-through with the full chain: non-stream <= 1.3x, coalesced
stream <= 0.95x, one delta per read <= 1.05x, a WebSocket turn <= 1.05x the HTTP stream.

The pass-through endpoints (issue 30; `--no-edge` skips them, `--edge-only` runs only them): the
same request to the same path on the bare pass-through and on the full proxy, one case per
endpoint: /v1/chat/completions non-stream and stream (the client does not ask for the usage:
the proxy adds stream_options.include_usage and keeps the usage chunk to itself),
/v1/completions stream, /v1/embeddings, /v1/messages stream (Anthropic's events, x-api-key);
the streams 100 deltas in one upstream write (bench/fake_upstream.c answers each path in
vLLM's shapes). Their table is a section of its own in bench/results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.__main__ import BENCH, CACHE, PY, QUESTION, ROOT, build_upstream, free_port, wait_port
from bench.trees import _merged, tree_config

HEADING = "### Instructions per request (issue 28)"

# name, model, stream
CASES = [("non-stream", "bench-json", False), ("stream coalesced", "bench-coalesced", True),
         ("stream 1 delta/read", "bench-chunked", True)]
# (warm-up, N1, N2) per case
COUNTS = {"bench-json": (30, 40, 120), "bench-coalesced": (20, 40, 80), "bench-chunked": (3, 4, 16)}
COMMIT_ROWS = 40  # leased usage rows per commit: the groups above are multiples of it
# the proxy's rows: name -> config merged into bench.trees' (the full default chain)
VARIANTS = {
    "proxy": {},
    "auth off (+ balance)": {"auth": {"enabled": False}},
    "limits off": {"limits": {"enabled": False}},
    "balance off": {"balance": {"enabled": False}},
    "access log off": {"server": {"log_level": "warning"}},
    "metrics off": {"metrics": {"enabled": False}},
    # every request traced (sample_ratio 1) and exported to the fake upstream, which answers 200
    # (as a collector would): the spans' making and the exporter's thread counted, not a collector's
    "tracing on": {"tracing": {"endpoint": "fake-upstream"}},
}
PASS = "pass-through"
TARGETS = [("non-stream", 1.3), ("stream coalesced", 0.95), ("stream 1 delta/read", 1.05)]
WS_TARGET = 1.05

# The pass-through endpoints (issue 30): name, model, stream, path; on these two servers only.
EDGE_HEADING = "### Instructions per request: the pass-through endpoints (issue 30)"
EDGE_CASES = [("chat completions", "bench-json", False, "/v1/chat/completions"),
              ("chat completions stream", "bench-coalesced", True, "/v1/chat/completions"),
              ("completions stream", "bench-coalesced", True, "/v1/completions"),
              ("embeddings", "bench-json", False, "/v1/embeddings"),
              ("messages stream", "bench-coalesced", True, "/v1/messages")]
EDGE_SERVERS = (PASS, "proxy")
# the Responses case of the same upstream answer, for scale (when the same run measured it)
EDGE_RESPONSES = {"chat completions": "non-stream", "chat completions stream": "stream coalesced"}


def edge_body(path: str, model: str, stream: bool) -> bytes:
    """What an SDK of that API sends (the openai SDK asks no usage on a stream)."""
    msgs = [{"role": "user", "content": QUESTION}]
    if path == "/v1/embeddings":
        body: dict = {"model": model, "input": QUESTION}
    elif path == "/v1/completions":
        body = {"model": model, "prompt": QUESTION, "max_tokens": 128, "stream": stream}
    else:  # chat completions, Anthropic messages
        body = {"model": model, "messages": msgs, "max_tokens": 128, "stream": stream}
    return json.dumps(body, separators=(",", ":")).encode()

_WRAPPER = r'''
import ctypes, os, runpy, signal, sys
lib = ctypes.CDLL(os.environ["CG_MARK_LIB"])
def dump(*_):
    lib.cg_dump()
    with open(os.environ["CG_MARK_ACK"], "a") as f:
        f.write("d\n")
signal.signal(signal.SIGUSR1, dump)
sys.argv.pop(0)
if sys.argv[0] == "-m":
    sys.argv.pop(0)
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
'''


def build_mark() -> Path:
    src, lib = BENCH / "callgrind_mark.c", CACHE / "libcallgrind_mark.so"
    CACHE.mkdir(parents=True, exist_ok=True)
    if not lib.exists() or lib.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


@dataclass
class Counted:
    """One server under callgrind."""
    name: str
    proc: subprocess.Popen
    port: int
    path: str
    chat: bool
    out: Path
    ack: Path
    headers: dict = field(default_factory=dict)
    dumps: int = 0

    def body(self, model: str, stream: bool) -> bytes:
        if self.chat:
            body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 128,
                    "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        else:
            body = {"model": model, "input": QUESTION, "max_output_tokens": 128, "stream": stream}
        return json.dumps(body, separators=(",", ":")).encode()

    async def dump(self) -> int:
        """Ir since the previous dump (every thread)."""
        self.dumps += 1
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while not (self.ack.exists() and self.ack.read_text().count("\n") >= self.dumps):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: no dump")
            await asyncio.sleep(0.05)
        text = Path(f"{self.out}.{self.dumps}").read_text(errors="replace")
        return int(re.search(r"^summary:\s+(\d+)", text, re.M).group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def variant_config(port: int, up_port: int, db: Path, extra: dict, slowdown: float) -> dict:
    """bench.trees' config (the default chain) with valgrind's timeouts, hourly health checks,
    lease commits `slowdown` times further apart, and `extra` (a VARIANTS entry) merged in."""
    if extra.get("tracing", {}).get("endpoint") == "fake-upstream":
        extra = _merged(extra, {"tracing": {"endpoint": f"http://127.0.0.1:{up_port}/v1/traces"}})
    return tree_config(port, up_port, db, _merged({
        "workers": [{"name": "fake", "url": f"http://127.0.0.1:{up_port}", "dialect": "vllm",
                     "models": ["bench-json", "bench-coalesced", "bench-chunked"], "capacity": 100_000,
                     "timeouts": {"connect": 30, "first_byte": 600, "idle": 600, "total": 1800}}],
        "health": {"interval_s": 3600},
        # Commits by count, the leases' other wall-clock settings on valgrind's clock (see the docstring).
        "balance": {"lease_commit_ms": 3_600_000, "lease_commit_rows": COMMIT_ROWS, "lease_seconds": 2 * slowdown,
                    "lease_idle_s": 2 * slowdown, "lease_min_rate": max(1, round(4 / slowdown))},
        # So are the socket's pings (30 s): a pong the slowed server read late closed a socket mid-run.
        "websocket": {"ping_interval_s": 30 * slowdown},
    }, extra))


def start_counted(name: str, tmp: Path, up_port: int, key: str | None, extra: dict | None, slowdown: float,
                  mark: Path) -> Counted:
    port = free_port()
    d = tmp / re.sub(r"\W+", "-", name)
    d.mkdir()
    (d / "wrap.py").write_text(_WRAPPER)
    if extra is None:  # the pass-through
        cmd = [str(BENCH / "passthrough.py"), str(port), f"http://127.0.0.1:{up_port}"]
        path, chat, headers = "/v1/chat/completions", True, {}
    else:
        for suffix in ("", "-wal", "-shm"):  # a ledger of its own: the key, no other server's writes
            if (tmp / f"ledger.db{suffix}").exists():
                shutil.copy(tmp / f"ledger.db{suffix}", d / f"ledger.db{suffix}")
        cfg = variant_config(port, up_port, d / "ledger.db", extra, slowdown)
        (d / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
        cmd = ["-m", "proxy", "--config", str(d / "config.yaml"), "serve"]
        path, chat, headers = "/v1/responses", False, {"Authorization": f"Bearer {key}"}
    out = d / "callgrind.out"
    log = open(d / "server.log", "ab")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no", "--dump-line=no",
         "--collect-atstart=yes", PY, str(d / "wrap.py"), *cmd],
        cwd=ROOT, stdout=log, stderr=log,
        env={**os.environ, "CG_MARK_LIB": str(mark), "CG_MARK_ACK": str(d / "ack"), "PYTHONPATH": str(ROOT)})
    return Counted(name, proc, port, path, chat, out, d / "ack", headers)


async def _one(http, srv: Counted, body: bytes, path: str | None = None) -> None:
    import aiohttp

    try:
        await _post(http, srv, body, path)
    except aiohttp.ClientConnectionError:  # a pooled connection the server closed meanwhile: once more
        print(f"  {srv.name}: a pooled connection was closed; request sent again", file=sys.stderr, flush=True)
        await _post(http, srv, body, path)


async def _post(http, srv: Counted, body: bytes, path: str | None = None) -> None:
    headers = srv.headers
    if path == "/v1/messages" and headers:  # as Anthropic's clients send the key
        headers = {"x-api-key": headers["Authorization"].removeprefix("Bearer "), "anthropic-version": "2023-06-01"}
    async with http.post(f"http://127.0.0.1:{srv.port}{path or srv.path}", data=body,
                         headers={"Content-Type": "application/json", **headers}) as r:
        data = await r.read()
        if r.status != 200 or (b"[DONE]" not in data and b"response.completed" not in data and b'"usage"' not in data):
            raise RuntimeError(f"{srv.name}: HTTP {r.status}: {data[:300]!r}")


async def _one_ws(ws, model: str) -> None:
    await ws.send_str(json.dumps({"type": "response.create", "model": model, "input": QUESTION,
                                  "max_output_tokens": 128}))
    while True:
        msg = await ws.receive()
        if msg.type.name != "TEXT":
            raise RuntimeError(f"websocket: {msg.type.name} {msg.data!r}")
        if '"response.completed"' in msg.data[:64]:
            return
        if '"error"' in msg.data[:64] or '"response.failed"' in msg.data[:64]:
            raise RuntimeError(f"websocket: {msg.data[:300]}")


async def measure(srv: Counted, cases: list[tuple[str, str, bool]], ws: bool, pause: float,
                  http_cases: bool = True, deflate: bool = True,
                  edge_cases: list[tuple[str, str, bool, str]] = ()) -> dict[str, dict]:
    """case name -> {"n1", "n2", "ir1", "ir2", "per"}: the per-request Ir of each case."""
    import aiohttp

    deadline = time.monotonic() + 600
    while True:  # the server under valgrind takes a while to listen
        try:
            wait_port(srv.port, timeout=1)
            break
        except RuntimeError:
            if srv.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{srv.name} did not start") from None
    found: dict[str, dict] = {}
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def group(send, n: int) -> int:
            for _ in range(n):
                await send()
            await asyncio.sleep(pause)
            return await srv.dump()

        async def run(name: str, send, model: str) -> None:
            warm, n1, n2 = COUNTS[model]
            await group(send, warm)
            ir1 = await group(send, n1)
            ir2 = await group(send, n2)
            found[name] = {"n1": n1, "n2": n2, "ir1": ir1, "ir2": ir2, "per": (ir2 - ir1) / (n2 - n1)}
            print(f"  {srv.name:22s} {name:28s} {found[name]['per']:12,.0f} Ir/request", file=sys.stderr, flush=True)

        for name, model, stream in cases if http_cases else ():
            body = srv.body(model, stream)
            await run(name, lambda body=body: _one(http, srv, body), model)
        for name, model, stream, path in edge_cases:
            body = edge_body(path, model, stream)
            await run(f"edge {name}", lambda body=body, path=path: _one(http, srv, body, path), model)
        if ws:
            url = f"ws://127.0.0.1:{srv.port}/v1/responses"
            # Like for like with the HTTP stream (not compressed): no permessage-deflate; then
            # one socket that negotiates it (as aiohttp's and the websockets library's clients
            # do by default), the coalesced stream only, for scale.
            async with http.ws_connect(url, headers=srv.headers, autoping=True, compress=0) as sock:
                for name, model, stream in cases:
                    if stream:
                        await run(f"websocket {name}", lambda model=model: _one_ws(sock, model), model)
            coalesced = [c for c in cases if c[1] == "bench-coalesced"]
            if coalesced and deflate:
                async with http.ws_connect(url, headers=srv.headers, autoping=True, compress=15) as sock:
                    name, model, _ = coalesced[0]
                    await run(f"websocket+deflate {name}", lambda model=model: _one_ws(sock, model), model)
    return found


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.3f}"


def report(results: dict[str, dict], args: argparse.Namespace, seconds: float) -> list[str]:
    pt = results.get(PASS, {})
    full = results.get("proxy", {})
    lines = [
        HEADING, "",
        f"`python -m bench.instructions` ({time.strftime('%Y-%m-%d %H:%M')}, {args.parallel} servers at a time, "
        f"{seconds:.0f} s in all; valgrind {_valgrind_version()}; paced deltas {args.gap_us / 1000:g} ms apart; "
        f"usage rows committed {COMMIT_ROWS} at a time, the leases on valgrind's clock x{args.slowdown:g}). Ir per request = (Ir of N2 requests - Ir of N1) / (N2 - N1), "
        "every thread of the server; `x pass-through` = over the pass-through's Ir for the same case; "
        "`part` = what turning that part off saves, in Ir per request (the full proxy's minus that row's).",
        "",
        "| server | " + " | ".join(f"{name} Ir/req | x pass-through | part" for name, _, _ in CASES) + " |",
        "|---|" + "--:|--:|--:|" * len(CASES),
    ]
    for server, got in results.items():
        cells = []
        for name, _, _ in CASES:
            per = got.get(name, {}).get("per")
            base = pt.get(name, {}).get("per")
            part = full.get(name, {}).get("per")
            cells.append(f"{per:,.0f}" if per else "-")
            cells.append("-" if server == PASS else _ratio(per, base))
            cells.append(f"{part - per:,.0f}" if server not in (PASS, "proxy") and per and part else "-")
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    if any(k.startswith("websocket") for k in full):
        lines += ["", "| WebSocket turn, full proxy | Ir/turn | HTTP stream Ir/req | x HTTP | target | met |",
                  "|---|--:|--:|--:|--:|---|"]
        for name, _, stream in CASES:
            ws, http = full.get(f"websocket {name}", {}).get("per"), full.get(name, {}).get("per")
            if stream and ws and http:
                lines.append(f"| {name} | {ws:,.0f} | {http:,.0f} | {ws / http:.3f} | <= {WS_TARGET} "
                             f"| {'yes' if ws / http <= WS_TARGET else '**no**'} |")
        name = CASES[1][0]
        ws, http = full.get(f"websocket+deflate {name}", {}).get("per"), full.get(name, {}).get("per")
        if ws and http:
            lines.append(f"| {name}, permessage-deflate (not a target) | {ws:,.0f} | {http:,.0f} "
                         f"| {ws / http:.3f} | - | - |")
    lines += ["", "| target (full chain) | proxy / pass-through | met |", "|---|--:|---|"]
    for name, target in TARGETS:
        per, base = full.get(name, {}).get("per"), pt.get(name, {}).get("per")
        if per and base:
            lines.append(f"| {name} <= {target}x | {per / base:.3f} | {'yes' if per / base <= target else '**no**'} |")
    return lines


def edge_report(results: dict[str, dict], args: argparse.Namespace, seconds: float) -> list[str]:
    pt, full = results.get(PASS, {}), results.get("proxy", {})
    lines = [
        EDGE_HEADING, "",
        f"`python -m bench.instructions` ({time.strftime('%Y-%m-%d %H:%M')}, {seconds:.0f} s in all; valgrind "
        f"{_valgrind_version()}; lease_commit_ms x{args.slowdown:g}; counted as the table above). The same request "
        "to the same path on the bare aiohttp pass-through and on the proxy with its full default chain (auth, "
        "limits, the balance's hold and settlement, the usage row, access line, metrics); the streams are 100 "
        "deltas in one upstream write. `/v1/responses` = the proxy's Responses request answered from the same "
        "upstream chat answer (translated and rewritten), for scale, when this run measured it.",
        "",
        "| endpoint | case | pass-through Ir/req | proxy Ir/req | x pass-through | proxy over pass-through, Ir/req "
        "| /v1/responses Ir/req |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for name, _, _, path in EDGE_CASES:
        base, per = pt.get(f"edge {name}", {}).get("per"), full.get(f"edge {name}", {}).get("per")
        if not base and not per:
            continue
        responses = full.get(EDGE_RESPONSES.get(name, ""), {}).get("per")
        cells = [f"{base:,.0f}" if base else "-", f"{per:,.0f}" if per else "-", _ratio(per, base),
                 f"{per - base:,.0f}" if base and per else "-", f"{responses:,.0f}" if responses else "-"]
        lines.append(f"| {path} | {name} | " + " | ".join(cells) + " |")
    return lines


def _valgrind_version() -> str:
    return subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()


def write(out: Path, lines: list[str]) -> None:
    """Replace the section of results.md that starts with lines[0] (its heading), or append it."""
    heading = lines[0]
    block = "\n".join(lines)
    text = out.read_text() if out.exists() else ""
    pattern = re.compile(re.escape(heading) + r".*?(?=\n### |\n## |\Z)", re.S)
    text = pattern.sub(lambda _: block.rstrip("\n"), text) if heading in text else text.rstrip("\n") + "\n\n" + block
    out.write_text(text if text.endswith("\n") else text + "\n")


async def run_all(args: argparse.Namespace, tmp: Path, up_port: int, key: str, mark: Path) -> dict[str, dict]:
    names = list(EDGE_SERVERS) if args.edge_only else [PASS, *VARIANTS]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    results: dict[str, dict] = {}
    gate = asyncio.Semaphore(args.parallel)

    async def one(name: str) -> None:
        async with gate:
            srv = start_counted(name, tmp, up_port, key, None if name == PASS else VARIANTS[name], args.slowdown,
                                mark)
            try:
                cases = CASES
                if args.edge_only:  # the proxy's Responses cases of the same answers, for the edge table's scale
                    cases = [c for c in CASES if c[0] in EDGE_RESPONSES.values()] if name == "proxy" else []
                if args.cases:
                    cases = [c for c in cases if c[1].removeprefix("bench-") in args.cases.split(",")]
                edge = EDGE_CASES if name in EDGE_SERVERS and not args.no_edge else []
                results[name] = await measure(srv, cases, ws=name == "proxy" and not (args.no_ws or args.edge_only),
                                              pause=args.pause, http_cases=not args.ws_only,
                                              deflate=not args.no_deflate, edge_cases=edge)
            finally:
                await asyncio.get_running_loop().run_in_executor(None, srv.stop)

    await asyncio.gather(*(one(n) for n in names))
    return {n: results[n] for n in names}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help=f"comma-separated servers: {PASS}, {', '.join(VARIANTS)}")
    ap.add_argument("--parallel", type=int, default=max(1, min(2, len(os.sched_getaffinity(0)))),
                    help="servers under valgrind at a time (default: 2 on 2 cores)")
    ap.add_argument("--gap-us", type=int, default=10000, help="microseconds between paced deltas (default 10000)")
    ap.add_argument("--slowdown", type=float, default=50.0,
                    help="valgrind's slowdown: the leases' times are scaled by it (default 50)")
    ap.add_argument("--pause", type=float, default=None,
                    help="seconds before each dump, for a group's tail (default 0.5 s)")
    ap.add_argument("--no-ws", action="store_true", help="skip the WebSocket turns")
    ap.add_argument("--cases", help="comma-separated cases to run: json, coalesced, chunked (default: all)")
    ap.add_argument("--ws-only", action="store_true", help="the proxy's WebSocket turns only (no HTTP cases)")
    ap.add_argument("--no-deflate", action="store_true", help="skip the permessage-deflate turn")
    ap.add_argument("--no-edge", action="store_true", help="skip the pass-through endpoints' cases (issue 30)")
    ap.add_argument("--edge-only", action="store_true",
                    help="only the pass-through endpoints' cases, pass-through and proxy (and the proxy's "
                         "/v1/responses cases of the same answers, for scale; ~3 min)")
    ap.add_argument("--keep", action="store_true", help="keep the servers' callgrind dumps (for callgrind_annotate)")
    ap.add_argument("--out", help="also write the table into this file's section (bench/results.md)")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind not found: apt-get install -y valgrind", file=sys.stderr)
        return 2
    if args.pause is None:
        args.pause = 0.5
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="rp-instr-"))
    exe, mark = build_upstream(), build_mark()
    up_port = free_port()
    upstream = subprocess.Popen([str(exe), str(up_port)], env={**os.environ, "FAKE_GAP_US": str(args.gap_us)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(up_port)
        from bench.__main__ import _create_key
        key = asyncio.run(_create_key(str(tmp / "ledger.db")))
        results = asyncio.run(run_all(args, tmp, up_port, key, mark))
    finally:
        upstream.terminate()
        upstream.wait()
    seconds = time.monotonic() - started
    sections = [] if args.edge_only else [report(results, args, seconds)]
    if not args.no_edge:
        sections.append(edge_report(results, args, seconds))
    for lines in sections:
        print("\n".join(lines) + "\n")
        if args.out:
            write(Path(args.out), lines)
    if args.out:
        print(f"written to {args.out}", file=sys.stderr)
    if args.keep:
        print(f"callgrind dumps kept under {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
