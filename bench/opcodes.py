"""Python bytecodes executed per request: the interpreter's work, counted, not timed.

    .venv/bin/python -m bench.opcodes                      # the proxy of this tree, non-stream
    .venv/bin/python -m bench.opcodes --model bench-coalesced
    .venv/bin/python -m bench.opcodes --pass-through       # bench/passthrough.py, the floor
    .venv/bin/python -m bench.opcodes --model bench-coalesced --websocket   # a socket turn each
    .venv/bin/python -m bench.opcodes --tree ../old-checkout --top 40
    .venv/bin/python -m bench.opcodes --set '{"balance": {"enabled": false}}'   # what one policy costs

CPU per request on this shared machine swings by +-30% from one minute to the next (make
bench, "Benchmark"), too much to see a change of a few percent. This count does not swing:
the server runs under a trace function that counts every bytecode of every thread (the
ledger's writer included), and N sequential requests go through it after a warm-up. It says
how much Python a request runs, module by module and function by function, and nothing about
C (orjson, httptools, SQLite) or system calls: `make bench` still decides, this one says where
to look and whether a change removed work. The trace makes the server ~50x slower; the count
is the same at any speed. Loopback only: the C fake upstream (bench/fake_upstream.c), one
server, one client.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.__main__ import PY, ROOT, build_upstream, free_port, wait_port
from bench.trees import tree_key, write_tree_config

# Runs the server with the counter installed; SIGUSR1 writes "count<TAB>file:line:function" lines.
_COUNTER = r'''
import collections, os, runpy, signal, sys, threading
counts = collections.Counter()
def local(frame, event, arg):
    if event == "opcode":
        counts[frame.f_code] += 1
    return local
def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    frame.f_trace_lines = False
    return local
def dump(*_):
    snap = dict(counts)  # first: the dump's own bytecodes are not in it
    with open(os.environ["OPCODES_OUT"], "w") as f:
        for code, n in snap.items():
            name = code.co_qualname
            if code.co_filename == "<string>":  # a generated function (a dataclass's __init__): by its fields
                name += "(" + ", ".join(code.co_varnames[1:4]) + ", ...)"
            f.write(f"{n}\t{code.co_filename}:{code.co_firstlineno}:{name}\n")
    os.replace(os.environ["OPCODES_OUT"], os.environ["OPCODES_OUT"] + ".done")
signal.signal(signal.SIGUSR1, dump)
sys.settrace(tracer)
threading.settrace(tracer)
script = sys.argv.pop(1)
if script == "-m":
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
else:
    runpy.run_path(script, run_name="__main__")
'''


def _snapshot(proc: subprocess.Popen, out: Path) -> dict[str, int]:
    done = Path(str(out) + ".done")
    done.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while not done.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the server did not write its counts")
        time.sleep(0.05)
    found: dict[str, int] = {}
    for line in done.read_text().splitlines():
        n, where = line.split("\t", 1)
        found[where] = found.get(where, 0) + int(n)
    return found


async def _drive(url: str, body: bytes, headers: dict[str, str], n: int, websocket: bool = False) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        if websocket:  # one socket, one response.create per turn, read to its terminal event
            event = json.dumps({"type": "response.create", **json.loads(body)}).encode()
            async with http.ws_connect(url, headers=headers, autoping=False) as ws:
                for _ in range(n):
                    await ws.send_bytes(event)
                    while True:
                        kind = json.loads((await ws.receive(timeout=60)).data).get("type")
                        if kind == "error":
                            raise SystemExit("the turn failed")
                        if kind in ("response.completed", "response.incomplete", "response.failed"):
                            break
            return
        for _ in range(n):
            async with http.post(url, data=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {data[:300]!r}")


def _wait_ready(url: str, body: bytes, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + 120  # the traced server starts slowly
    while True:
        try:
            asyncio.run(_drive(url, body, headers, 1))
            return
        except (OSError, SystemExit, Exception):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _short(where: str, tree: Path) -> str:
    path = where.split(":", 1)[0]
    if "site-packages/" in where:
        return where.split("site-packages/", 1)[1]
    if path.startswith(str(tree) + "/"):
        return where[len(str(tree)) + 1:]
    return where.replace(sys.base_prefix + "/lib/", "")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.opcodes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose proxy runs (default: this one)")
    ap.add_argument("--pass-through", action="store_true", help="count bench/passthrough.py instead")
    ap.add_argument("--model", default="bench-json", help="bench-json (non-stream) or bench-coalesced (a stream)")
    ap.add_argument("--websocket", action="store_true",
                    help="the proxy only: each request a socket turn (response.create on one socket)")
    ap.add_argument("--requests", type=int, default=300, help="requests counted, after 100 of warm-up")
    ap.add_argument("--top", type=int, default=25, help="functions listed")
    ap.add_argument("--set", default="{}", metavar="JSON",
                    help='config merged into the proxy\'s, e.g. \'{"balance": {"enabled": false}}\': '
                         'what a policy costs')
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    stream = args.model != "bench-json"
    tmp = Path(tempfile.mkdtemp(prefix="rp-opcodes-"))
    (tmp / "counter.py").write_text(_COUNTER)
    out = tmp / "counts"
    up_port, port = free_port(), free_port()
    upstream = subprocess.Popen([str(build_upstream()), str(up_port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    env = {**os.environ, "OPCODES_OUT": str(out), "PYTHONPATH": str(tree)}
    prompt = "What is the capital of France? Answer briefly."
    if args.pass_through:
        cmd = [str(ROOT / "bench" / "passthrough.py"), str(port), f"http://127.0.0.1:{up_port}"]
        path, headers = "/v1/chat/completions", {"Content-Type": "application/json"}
        body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 128,
                "stream": stream}
    else:
        key = tree_key(tree, tmp / "ledger.db")
        config = write_tree_config(tmp, port, up_port, json.loads(args.set))
        cmd = ["-m", "proxy", "--config", str(config), "serve"]
        path = "/v1/responses"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        body = {"model": args.model, "input": prompt, "max_output_tokens": 128, "stream": stream}
    log = open(tmp / "server.log", "wb")
    server = subprocess.Popen([PY, str(tmp / "counter.py"), *cmd], cwd=tree, env=env, stdout=log, stderr=log)
    try:
        wait_port(up_port)
        url, raw = f"http://127.0.0.1:{port}{path}", json.dumps(body).encode()
        _wait_ready(url, raw, headers)
        ws = args.websocket and not args.pass_through
        asyncio.run(_drive(url, raw, headers, 100, ws))
        time.sleep(0.5)
        before = _snapshot(server, out)
        asyncio.run(_drive(url, raw, headers, args.requests, ws))
        time.sleep(0.5)  # what a request leaves for later (its access line, its usage row's commit)
        after = _snapshot(server, out)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        upstream.terminate()
    per = {k: (v - before.get(k, 0)) / args.requests for k, v in after.items() if v > before.get(k, 0)}
    per = {k: v for k, v in per.items() if "counter.py" not in k}
    by_file: collections.Counter[str] = collections.Counter()
    for where, n in per.items():
        by_file[_short(where, tree).rsplit(":", 2)[0]] += n
    name = "bench/passthrough.py" if args.pass_through else f"the proxy of {tree}"
    if args.websocket and not args.pass_through:
        name += " over WebSocket"
    print(f"{name}, {args.model}: {sum(per.values()):.0f} bytecodes per request ({args.requests} requests)")
    print("\n| bytecodes/request | module |\n|--:|---|")
    for module, n in by_file.most_common(args.top):
        print(f"| {n:.0f} | {module} |")
    print("\n| bytecodes/request | function |\n|--:|---|")
    for where, n in sorted(per.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {n:.0f} | {_short(where, tree)} |")


if __name__ == "__main__":
    main()
