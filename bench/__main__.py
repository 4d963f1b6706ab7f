"""`make bench` / `python -m bench`: the proxy's cost against the floor, in one table.

Starts, on loopback only:
  * a C fake upstream (bench/fake_upstream.c, compiled into .cache/bench/ at run time),
    vLLM-shaped answers chosen by the model name: bench-json, bench-coalesced (100 deltas
    in one write), bench-chunked (100 deltas, one per write, FAKE_GAP_US apart), bench-hold;
  * a bare aiohttp pass-through (bench/passthrough.py: bytes forwarded unchanged);
  * the proxy, `python -m proxy --config <tmp> serve`, with its full default chain (stateless,
    auth with a real key in a temp SQLite ledger, limits, tools, balance, notices) and JSON
    access logs to a file.
Pins the server under test to core 0 and the load generator + fake upstream to core 1,
drives each with wrk (JSON POSTs, Lua script) or bench/sse_client.py (streams), reads CPU
from the kernel's per-process CPU clock (every thread, to the ns) and peak RSS from VmHWM,
both over the measured part of a cell only (after its warm-up), prints one table and writes
it to bench/results.md.

The machine is shared and noisy: one cell's CPU per request can be off by +-30%. So every
(workload, concurrency) is run for --rounds rounds, the servers interleaved within a round
(direct, pass-through, proxy, proxy no chain, then again), and the table shows, per server,
the round with the median CPU per request; the ratio to the pass-through is the median of the
per-round ratios (each round's proxy over the same round's pass-through, run back to back),
shown with their min-max and with the ratio of the medians.

Last, the backend rows (issue 16): the same proxy and load (non-stream and coalesced stream,
c=1 and 16, 3 rounds of 1 s cells) with `ledger.backend` sqlite + `limits.backend` memory,
postgres + memory and postgres + redis, against a throwaway PostgreSQL (fsync off) and
redis-server (bench/backing.py) pinned to the load core, whose CPU per request is shown too.

    python -m bench                 # everything, 5 rounds (cells of 2 s JSON, 1.5 s coalesced, 2.5 s chunked), ~9.5 minutes
    python -m bench --quick         # 3 rounds of 1 s cells, ~5 minutes
    python -m bench --hold 1000     # only: 1,000 concurrent open streams through the proxy
    python -m bench --backends-only # only the backend rows (~75 s); they replace their section of --out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# The hand-kept section of results.md (measurements behind design choices): a run keeps it.
KEPT_HEADING = "## Design measurements"


def with_kept_section(new: str, old: str) -> str:
    """The new results followed by the hand-kept section of the old file, if it had one."""
    at = old.find(KEPT_HEADING)
    return new if at < 0 else new + "\n" + old[at:]


CACHE = ROOT / ".cache" / "bench"
PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")
NCPU = len(os.sched_getaffinity(0))
SERVER_CORE = "0"
LOAD_CORE = "1" if NCPU > 1 else "0"
ALL_CORES = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
QUESTION = "What is the capital of France?"
# Pause between a cell's warm-up and its measured part, so that the warm-up's tail (ledger group
# commit, access-log writes) is not read as the measured part's CPU.
SETTLE_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_seconds(pid: int) -> float:
    """The CPU time of a process, all its threads (exited ones too), to the nanosecond.

    /proc/<pid>/stat counts utime and stime in 10 ms clock ticks, each truncated: a cell's CPU
    could be up to 20 ms off, a tenth of what a 1-chunk/write stream cell at c=1 spends. The
    kernel's per-process CPU clock (what clock_getcpuclockid(3) returns) is exact.
    """
    try:
        return time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:  # no such clock here: fall back to the ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def hwm_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def reset_hwm(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    path: str  # the URL path the load goes to
    body_kind: str  # chat | responses
    headers: dict = field(default_factory=dict)
    # name -> CPU seconds of a server behind this one (its PostgreSQL, its redis-server), read
    # around each measured window like the server's own
    backing: dict = field(default_factory=dict)

    def pids(self) -> list[int]:
        kids = children(self.proc.pid)
        return kids or [self.proc.pid]  # --workers N: the children serve, the parent waits

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids())

    def reset_hwm(self) -> None:
        for p in self.pids():
            reset_hwm(p)

    def hwm_mb(self) -> float:
        return sum(hwm_kb(p) for p in self.pids()) / 1024

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def body(self, model: str, stream: bool) -> str:
        if self.body_kind == "responses":
            return json.dumps({"model": model, "input": QUESTION, "max_output_tokens": 128, "stream": stream},
                              separators=(",", ":"))
        return json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 128,
                           "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})},
                          separators=(",", ":"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def build_upstream() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    src, exe = BENCH / "fake_upstream.c", CACHE / "fake_upstream"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)], check=True)
    return exe


def start(cmd: list[str], cores: str, *, env: dict | None = None, stdout=None, stderr=None) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", cores, *cmd], env={**os.environ, **(env or {})}, cwd=ROOT,
                            stdout=stdout or subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL,
                            preexec_fn=raise_nofile)


async def _create_key(db: str | dict) -> str:
    """A key with a bottomless balance in the ledger at this path (SQLite) or of this config section."""
    sys.path.insert(0, str(ROOT))
    from proxy.ledger import KeyLimits, open_ledger

    ledger = open_ledger({"path": db} if isinstance(db, str) else db)
    await ledger.start()
    try:
        if os.environ.get("BENCH_KEY_LEVELS"):  # the key under an organisation, a team and a user (issue 39)
            org = await ledger.create_level("org", {"name": "bench-org", "balance_micros": 10**15})
            team = await ledger.create_level("team", {"name": "bench-team", "parent_id": org.level_id,
                                                      "budget_micros": 10**14, "budget_period": "daily",
                                                      "rate_per_min": 10**9})
            user = await ledger.create_level("user", {"name": "bench-user", "parent_id": team.level_id})
            place = {**await ledger.placement(None, user.level_id), "own_balance": False}
            secret, _ = await ledger.create_key("bench", 0, limits=KeyLimits(concurrency=100_000), placement=place)
        else:
            secret, _ = await ledger.create_key("bench", balance_micros=10**15,
                                                limits=KeyLimits(concurrency=100_000))
    finally:
        await ledger.close()
    return secret


POLICIES = ["stateless", "auth", "limits", "tools", "balance", "notices"]
NO_CHAIN = "proxy no chain"  # the same proxy with every policy off: what the policies cost


def proxy_config(tmp: Path, port: int, upstream_port: int, workers: int, chain: bool = True,
                 ledger: dict | None = None, limits: dict | None = None, tag: str = "") -> Path:
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_format": "json", "workers": workers},
        "workers": [{"name": "fake", "url": f"http://127.0.0.1:{upstream_port}", "dialect": "vllm",
                     "models": ["bench-json", "bench-coalesced", "bench-chunked", "bench-hold"],
                     "capacity": 100_000, "timeouts": {"connect": 5, "first_byte": 60, "idle": 60, "total": 600}}],
        **{name: {"enabled": chain} for name in POLICIES},
        "auth": {"enabled": chain, "demo_key": False},
        "limits": {"enabled": chain, "global_concurrency": 4096, **(limits or {})},
        "ledger": ledger or {"path": str(tmp / "ledger.db")},
    }
    path = tmp / f"config-{workers}{'' if chain else '-nochain'}{tag}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def start_proxy(tmp: Path, upstream_port: int, key: str, workers: int, cores: str, chain: bool = True, *,
                ledger: dict | None = None, limits: dict | None = None, name: str | None = None) -> Server:
    port = free_port()
    tag = "" if name is None else "-" + re.sub(r"\W+", "-", name)
    cfg = proxy_config(tmp, port, upstream_port, workers, chain, ledger, limits, tag)
    log = open(tmp / f"proxy-{workers}{'' if chain else '-nochain'}{tag}.log", "ab")
    proc = start([PY, "-m", "proxy", "--config", str(cfg), "serve"], cores, stdout=log, stderr=log)
    wait_port(port)
    if workers > 1:
        deadline = time.monotonic() + 20
        while len(children(proc.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # every child listening
    name = name or (("proxy" if chain else NO_CHAIN) if workers == 1 else f"proxy x{workers}")
    return Server(name, proc, port, "/v1/responses", "responses", {"Authorization": f"Bearer {key}"})


# ---------------------------------------------------------------------------- load generators

WRK_LUA = """wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
{auth}
"""


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


class Window:
    """The measured part of a cell: CPU of the server under test and of the fake upstream, peak RSS.

    Opened after the warm-up, so that connection set-up and first-request costs are not counted.
    """

    def __init__(self, server: Server, upstream: Server):
        self.server, self.upstream = server, upstream

    def open(self) -> None:
        time.sleep(SETTLE_S)
        self.cpu0, self.up_cpu0 = self.server.cpu(), self.upstream.cpu()
        self.backing0 = {name: cpu() for name, cpu in self.server.backing.items()}
        self.server.reset_hwm()

    def close(self) -> dict:
        return {"cpu": self.server.cpu() - self.cpu0, "upstream_cpu": self.upstream.cpu() - self.up_cpu0,
                "hwm": self.server.hwm_mb(),
                "backing_cpu": {name: cpu() - self.backing0[name] for name, cpu in self.server.backing.items()}}


def run_wrk(server: Server, upstream: Server, conc: int, seconds: float, tmp: Path, cores: str) -> dict:
    auth = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in server.headers.items())
    script = tmp / f"wrk-{server.port}.lua"
    script.write_text(WRK_LUA.format(body=json.dumps(server.body("bench-json", False)), auth=auth))
    # warm-up (connections, caches), not counted
    subprocess.run(["taskset", "-c", cores, "wrk", "-t1", f"-c{conc}", "-d1s", "-s", str(script), server.url],
                   capture_output=True)
    window = Window(server, upstream)
    window.open()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = max(1, round(seconds))  # wrk takes whole seconds
    out = subprocess.run(["taskset", "-c", cores, "wrk", "-t1", f"-c{conc}", f"-d{seconds}s", "--latency",
                          "-s", str(script), server.url], capture_output=True, text=True, check=True).stdout
    # Read at once: the requests wrk leaves in flight when it stops are not counted in its total.
    measured = window.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = int(re.search(r"(\d+) requests in", out).group(1))
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        errors += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        errors += sum(int(x) for x in m.groups())
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    return {"rps": rps, "p50": _ms(lat["50"]), "p99": _ms(lat["99"]), "n": total, "errors": errors,
            "load_cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), **measured}


def run_sse(server: Server, upstream: Server, model: str, conc: int, seconds: float, cores: str,
            hold: int = 0) -> dict:
    cmd = ["taskset", "-c", cores, PY, "-m", "bench.sse_client", server.url, server.body(model, True), str(conc),
           str(seconds), "--wait"]
    for k, v in server.headers.items():
        cmd += ["--header", f"{k}:{v}"]
    if hold:
        cmd += ["--hold", str(hold)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=raise_nofile)
    # The client runs its warm-up streams (one per client: new connections), says `warm` and
    # waits: the server's CPU is read around the measured streams only.
    if proc.stdout.readline().strip() != "warm":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"bench.sse_client failed before its warm-up ended ({server.name}, {model}, c={conc})")
    window = Window(server, upstream)
    window.open()
    out, _ = proc.communicate("go\n")  # it exits once its last stream has ended: that stream's tail is in
    measured = window.close()
    result = json.loads(out.strip().splitlines()[-1])
    return {"rps": result["rps"], "p50": result["full_p50"], "p99": result["full_p99"],
            "ttft50": result["ttft_p50"], "ttft99": result["ttft_p99"], "n": result["streams"],
            "errors": result["errors"], "load_cpu": result["client_cpu_s"], **measured}


# ---------------------------------------------------------------------------- the run

WORKLOADS = [("non-stream", "bench-json"), ("stream coalesced", "bench-coalesced"),
             ("stream 1 chunk/write", "bench-chunked")]


def cell_seconds(args: argparse.Namespace, model: str) -> float:
    if args.seconds:
        return args.seconds
    if args.quick:
        return 1.0
    # A 1-chunk-per-write stream lasts ~110 ms (100 deltas 1 ms apart): c=1 needs ~2.5 s for ~20
    # streams. wrk (JSON) takes whole seconds.
    return {"bench-chunked": 2.5, "bench-json": 2.0}.get(model, 1.5)


def cells_text(args: argparse.Namespace) -> str:
    per_model = {cell_seconds(args, model) for _, model in WORKLOADS}
    if len(per_model) == 1:
        return f"{per_model.pop():g} s per cell"
    return "cells of " + ", ".join(f"{cell_seconds(args, model):g} s ({name})" for name, model in WORKLOADS)


def cpu_per_req(r: dict) -> float:
    """Milliseconds of the server's CPU per request (per stream)."""
    return r["cpu"] / (r["n"] or 1) * 1000


def median_cell(cells: list[dict]) -> dict:
    """The round with the median CPU per request (the lower middle one for an even number of rounds)."""
    return sorted(cells, key=cpu_per_req)[(len(cells) - 1) // 2]


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 1 s cells instead of 5 of 1.5-2.5 s")
    ap.add_argument("--seconds", type=float, help="seconds per cell, every workload")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per (workload, concurrency), servers interleaved; the median round is shown "
                         "(default 5; 3 with --quick). One cell's CPU per request swings by +-30%% on a shared "
                         "machine, two identical proxies included: more rounds, a steadier median")
    ap.add_argument("--conc", default="1,16,64", help="concurrencies (default 1,16,64)")
    ap.add_argument("--hold", type=int, default=None,
                    help="only the held-streams test with this many concurrent streams (default run: 1000 at the end)")
    ap.add_argument("--no-scaling", action="store_true", help="skip the 1 -> 2 workers rows")
    ap.add_argument("--no-backends", action="store_true",
                    help="skip the ledger/limits backend rows (SQLite+memory, PostgreSQL+memory, PostgreSQL+Redis)")
    ap.add_argument("--backends-only", action="store_true",
                    help="only the backend rows (~75 s): they replace their section of --out, the rest of it kept")
    ap.add_argument("--out", default=str(BENCH / "results.md"))
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    concs = [int(c) for c in args.conc.split(",")]
    raise_nofile()
    if shutil.which("wrk") is None:
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2
    started, load0 = time.monotonic(), os.getloadavg()[0]
    exe = build_upstream()
    tmp = Path(tempfile.mkdtemp(prefix="rp-bench-"))
    servers: list[Server] = []
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    try:
        up_port = free_port()
        up_proc = start([str(exe), str(up_port)], LOAD_CORE, env={"FAKE_GAP_US": "1000", "FAKE_HOLD_MS": "50"})
        wait_port(up_port)
        upstream = Server("direct", up_proc, up_port, "/v1/chat/completions", "chat")
        key = asyncio.run(_create_key(str(tmp / "ledger.db")))

        if args.hold:
            proxy = start_proxy(tmp, up_port, key, 1, SERVER_CORE)
            servers.append(proxy)
            say(hold_test(proxy, upstream, args.hold, LOAD_CORE))
            return 0
        if args.backends_only:
            for line in backend_rows(tmp, upstream, started):
                say(line)
            out = Path(args.out)
            out.write_text(with_backends_section(out.read_text() if out.exists() else "", "\n".join(lines)))
            print(f"\nwritten to {args.out}", file=sys.stderr)
            return 0

        pt_port = free_port()
        pt = Server("pass-through", start([PY, "-m", "bench.passthrough", str(pt_port),
                                           f"http://127.0.0.1:{up_port}"], SERVER_CORE), pt_port,
                    "/v1/chat/completions", "chat")
        wait_port(pt_port)
        proxy = start_proxy(tmp, up_port, key, 1, SERVER_CORE)
        bare = start_proxy(tmp, up_port, key, 1, SERVER_CORE, chain=False)
        servers += [pt, proxy, bare]

        # (workload, c, server name) -> its cells, one per round, in round order
        results: dict[tuple, list[dict]] = {}
        total_cells = args.rounds * len(concs) * (4 + 3 + 3)
        done = 0
        for wname, model in WORKLOADS:
            seconds = cell_seconds(args, model)
            line_up = (upstream, pt, proxy) + ((bare,) if model == "bench-json" else ())
            for conc in concs:
                # Interleaved: a round's proxy cell runs right after that round's pass-through cell,
                # so both see about the same machine; the rounds spread the noise for the median.
                for rnd in range(1, args.rounds + 1):
                    for srv in line_up:
                        r = (run_wrk(srv, upstream, conc, seconds, tmp, LOAD_CORE) if model == "bench-json"
                             else run_sse(srv, upstream, model, conc, seconds, LOAD_CORE))
                        results.setdefault((wname, conc, srv.name), []).append(r)
                        done += 1
                        print(f"  [{done}/{total_cells}] {wname:22s} c={conc:<3d} round {rnd} {srv.name:14s} "
                              f"{r['rps']:9.0f}/s p50 {fmt(r['p50'])} ms  CPU/req {cpu_per_req(r):.3f} ms  "
                              f"errors {r['errors']}", file=sys.stderr, flush=True)

        # Scaling: the 1-worker and 2-worker proxies side by side, interleaved over the rounds
        # like the cells above (one run each swung from 1.0x to 2.4x on this shared machine).
        scaling: dict[tuple, list[dict]] = {}
        if not args.no_scaling and NCPU > 1:
            proxy.stop()
            servers.remove(proxy)
            scalers = {workers: start_proxy(tmp, up_port, key, workers, ALL_CORES) for workers in (1, 2)}
            servers.extend(scalers.values())
            conc = max(concs)
            for rnd in range(1, args.rounds + 1):
                for wname, model in WORKLOADS[:2]:
                    for workers, srv in scalers.items():
                        seconds = cell_seconds(args, model)
                        r = (run_wrk(srv, upstream, conc, seconds, tmp, ALL_CORES) if model == "bench-json"
                             else run_sse(srv, upstream, model, conc, seconds, ALL_CORES))
                        scaling.setdefault((wname, conc, workers), []).append(r)
                        print(f"  scaling round {rnd}: {workers} worker(s) {wname} c={conc}: {r['rps']:.0f}/s",
                              file=sys.stderr, flush=True)
            for srv in scalers.values():
                srv.stop()
                servers.remove(srv)
            proxy = start_proxy(tmp, up_port, key, 1, SERVER_CORE)
            servers.append(proxy)

        hold_line = hold_test(proxy, upstream, 1000, LOAD_CORE)
        backend_lines = [] if args.no_backends else backend_rows(tmp, upstream, time.monotonic())
        run = (f"{cells_text(args)}, median of {args.rounds} round{'s' * (args.rounds > 1)}, "
               f"{(time.monotonic() - started) / 60:.1f} min in all, "
               f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
        report(say, results, concs, args.rounds, run, scaling, hold_line)
        if backend_lines:
            say()
            for line in backend_lines:
                say(line)
    finally:
        for srv in servers:
            srv.stop()
        if "up_proc" in locals():
            up_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(args.out)
    out.write_text(with_kept_section("\n".join(lines) + "\n", out.read_text() if out.exists() else ""))
    print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- backend rows (issue 16)

BACKENDS_HEADING = "### Ledger and limits backends over HTTP (issue 16)"
# (ledger.backend, limits.backend): today's single-node default, then the shared backends
BACKEND_SETUPS = [("sqlite", "memory"), ("postgres", "memory"), ("postgres", "redis")]
BACKEND_WORKLOADS = WORKLOADS[:2]  # non-stream, stream coalesced
BACKEND_CONCS = (1, 16)
BACKEND_ROUNDS = 3
BACKEND_SECONDS = 1.0  # per cell, after its warm-up (1 s of wrk, one stream per client)


BACKENDS_NOTE = (
    "Reading it: with `limits.backend: redis` every request makes two round trips to redis-server (the "
    "admission script before the upstream call, the release before the answer's last bytes): most of that "
    "setup's added proxy CPU and latency. The PostgreSQL ledger with leases (the default) goes to the database "
    "for a key's lease, its top-ups and the batched usage rows, not once per request. Its p99 is the widest and "
    "swings most from run to run: each cell starts after its key sat idle through the other setups' cells, its "
    "lease given back (balance.lease_idle_s 2), so a burst's first requests take the exact path, every settle "
    "taking the key's row lock (at c=16 they queue on it; the proxy's access log shows the slow ones in bursts), "
    "and PostgreSQL shares core 1 with the load generator and whatever else runs on the machine.")


def backend_rows(tmp: Path, upstream: Server, started: float) -> list[str]:
    """The same proxy, chain and load against each of BACKEND_SETUPS: its CPU and latency per
    request, and the CPU its PostgreSQL and redis-server spent on those requests.

    The servers are bench/backing.py's (PostgreSQL with fsync off), pinned to the load core with
    the load generator and the fake upstream: the proxy keeps core 0 to itself, as above.
    """
    from bench.backing import Backing

    results: dict[tuple, list[dict]] = {}
    servers: list[Server] = []
    load_cores = {int(c) for c in LOAD_CORE.split(",")}
    with Backing(load_cores) as backing:
        try:
            for i, (ledger_name, limits_name) in enumerate(BACKEND_SETUPS):
                if ledger_name == "sqlite":
                    ledger = {"path": str(tmp / f"ledger-backends-{i}.db")}
                else:
                    ledger = {"backend": "postgres", "dsn": backing.pg_database("bench"),
                              "spool_path": str(tmp / f"ledger-spool-{i}.jsonl")}
                limits = ({"backend": "redis", "redis": {"url": backing.redis.url, "key_prefix": f"bench{i}:"}}
                          if limits_name == "redis" else None)
                key = asyncio.run(_create_key(ledger))
                srv = start_proxy(tmp, upstream.port, key, 1, SERVER_CORE, ledger=ledger, limits=limits,
                                  name=f"{ledger_name}+{limits_name}")
                if ledger_name == "postgres":
                    srv.backing["postgres"] = backing.pg_cpu
                if limits_name == "redis":
                    srv.backing["redis-server"] = backing.redis_cpu
                servers.append(srv)
            total_cells = len(BACKEND_WORKLOADS) * len(BACKEND_CONCS) * BACKEND_ROUNDS * len(servers)
            done = 0
            for wname, model in BACKEND_WORKLOADS:
                for conc in BACKEND_CONCS:
                    for rnd in range(1, BACKEND_ROUNDS + 1):
                        for srv in servers:  # interleaved, like the cells above
                            r = (run_wrk(srv, upstream, conc, BACKEND_SECONDS, tmp, LOAD_CORE) if model == "bench-json"
                                 else run_sse(srv, upstream, model, conc, BACKEND_SECONDS, LOAD_CORE))
                            results.setdefault((wname, conc, srv.name), []).append(r)
                            done += 1
                            side = "".join(f"  {k} {v / (r['n'] or 1) * 1000:.3f} ms"
                                           for k, v in r["backing_cpu"].items())
                            print(f"  backends [{done}/{total_cells}] {wname:16s} c={conc:<3d} round {rnd} "
                                  f"{srv.name:18s} {r['rps']:7.0f}/s p50 {fmt(r['p50'])} ms  "
                                  f"CPU/req {cpu_per_req(r):.3f} ms{side}  errors {r['errors']}",
                                  file=sys.stderr, flush=True)
        finally:
            for srv in servers:
                srv.stop()
    return backend_report(results, time.monotonic() - started)


def backend_report(results: dict[tuple, list[dict]], seconds: float) -> list[str]:
    base_name = "+".join(BACKEND_SETUPS[0])
    lines = [
        f"{BACKENDS_HEADING}",
        "",
        f"`python -m bench --backends-only --out bench/results.md` (also the last part of `make bench`; "
        f"{time.strftime('%Y-%m-%d %H:%M')}, {NCPU} cores, {BACKEND_SECONDS:g} s cells after a warm-up, median of "
        f"{BACKEND_ROUNDS} rounds, the three setups interleaved within a round, {seconds:.0f} s in all, "
        f"load average {os.getloadavg()[0]:.1f}). The same proxy, full default chain (leases on: "
        "balance.lease_max_micros 10,000,000) and load, POST /v1/responses, against `ledger.backend` x "
        "`limits.backend`: sqlite + memory (one node, the default), postgres + memory, postgres + redis. "
        "PostgreSQL 15 and redis-server are throwaway local servers on loopback (tests/support/pg_server.py, "
        "tests/support/redis_server.py; **PostgreSQL runs with fsync, synchronous_commit and full_page_writes off**, so "
        "its figures are CPU and round trips, not disk; redis-server without persistence), pinned with the load "
        "generator and the fake upstream to core 1; the proxy alone on core 0. `PostgreSQL CPU/req` = the "
        "postmaster and all its processes (backends, walwriter...: their CPU clocks, plus reaped children's "
        "cutime/cstime from /proc/<pid>/stat), `redis-server CPU/req` = its process; `total` = proxy + both. "
        f"Each row is the round with the median proxy CPU per request; `x {base_name}` = the median over the "
        f"rounds of that round's proxy (or total) CPU per request over the same round's {base_name} cell's.",
        "",
        f"| workload | c | ledger | limits | req/s | p50 ms | p99 ms | proxy CPU/req ms | proxy x {base_name} "
        f"(min-max) | PostgreSQL CPU/req ms | redis-server CPU/req ms | total CPU/req ms | total x {base_name} "
        "| errors |",
        "|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]

    def total(r: dict) -> float:
        return (r["cpu"] + sum(r["backing_cpu"].values())) / (r["n"] or 1) * 1000

    for wname, _ in BACKEND_WORKLOADS:
        for conc in BACKEND_CONCS:
            base = results[(wname, conc, base_name)]
            for ledger_name, limits_name in BACKEND_SETUPS:
                name = f"{ledger_name}+{limits_name}"
                cells = results[(wname, conc, name)]
                r = median_cell(cells)
                n = r["n"] or 1
                ratios = sorted(cpu_per_req(c) / cpu_per_req(b) for c, b in zip(cells, base) if b["cpu"])
                totals = sorted(total(c) / total(b) for c, b in zip(cells, base) if b["cpu"])
                mid = (len(ratios) - 1) // 2
                ratio = "-" if name == base_name or not ratios else (
                    f"{ratios[mid]:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")
                total_ratio = "-" if name == base_name or not totals else f"{totals[mid]:.2f}"
                pg = r["backing_cpu"].get("postgres")
                rd = r["backing_cpu"].get("redis-server")
                lines.append(
                    f"| {wname} | {conc} | {ledger_name} | {limits_name} | {r['rps']:.0f} | {fmt(r['p50'])} "
                    f"| {fmt(r['p99'])} | {cpu_per_req(r):.3f} | {ratio} "
                    f"| {fmt(None if pg is None else pg / n * 1000, '.3f')} "
                    f"| {fmt(None if rd is None else rd / n * 1000, '.3f')} | {total(r):.3f} | {total_ratio} "
                    f"| {sum(c['errors'] for c in cells)} |")
    lines += ["", BACKENDS_NOTE]
    return lines


def with_backends_section(text: str, block: str) -> str:
    """text with its backend-rows section replaced by block (or block put before the kept section)."""
    block = block.strip("\n")
    if BACKENDS_HEADING in text:
        pattern = re.compile(re.escape(BACKENDS_HEADING) + r".*?(?=\n#{2,3} |\Z)", re.S)
        return pattern.sub(lambda _: block + "\n", text, count=1)
    at = text.find(KEPT_HEADING)
    if at < 0:
        return (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"
    return text[:at] + block + "\n\n" + text[at:]


def hold_test(proxy: Server, upstream: Server, n: int, cores: str) -> str:
    proxy.reset_hwm()
    rss0 = hwm_kb(proxy.pids()[0]) / 1024
    r = run_sse(proxy, upstream, "bench-hold", n, 0, cores, hold=n)
    return (f"{n} concurrent streams held open (100 deltas, 50 ms apart: ~5 s each) through the proxy: "
            f"{r['n']} completed, {r['errors']} errors, proxy peak RSS {r['hwm']:.0f} MB "
            f"(idle {rss0:.0f} MB), full-stream p50 {fmt(r['p50'], '.0f')} ms / p99 {fmt(r['p99'], '.0f')} ms, "
            f"first delta p99 {fmt(r['ttft99'], '.1f')} ms")


def round_ratios(cells: list[dict], pt_cells: list[dict]) -> list[float]:
    """Per round: that round's CPU per request over the same round's pass-through's (the two
    cells ran back to back, so they saw about the same machine)."""
    return sorted(cpu_per_req(c) / cpu_per_req(p) for c, p in zip(cells, pt_cells) if p["cpu"])


def report(say, results, concs, rounds, run, scaling, hold_line) -> None:
    machine = f"{NCPU} cores ({os.uname().machine}), Python {sys.version.split()[0]}"
    say(f"## Benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {machine}, {run})")
    say()
    say("Server under test pinned to core 0; load generator and C fake upstream on core 1. `direct` = the fake "
        "upstream alone; `pass-through` = bench/passthrough.py (bytes forwarded unchanged); `proxy` = "
        "`python -m proxy serve` with the full default chain (auth against a SQLite ledger, limits, tools, "
        "balance hold+settle, notices, JSON access log); `proxy no chain` = the same with every policy off "
        "(non-stream only: what the middleware chain costs). CPU: the process's CPU clock (all threads) over the "
        "measured part of a cell only (not its warm-up: 1 s of wrk, or one stream per client); chunk = one of the "
        "100 upstream content deltas. Streams: latency = full stream; first delta = time to the first text delta.")
    say()
    say(f"The machine is shared and noisy (one cell's CPU per request varies by up to +-30%), so every "
        f"(workload, c) ran {rounds} round{'s' * (rounds > 1)}, the servers interleaved within a round (direct, "
        "pass-through, proxy, proxy no chain). Each row is, per server, the round with the median CPU per "
        "request, and all its columns come from that same round (added latencies: against the median `direct` "
        "round); errors are summed over all rounds. `x pass-through CPU` = the median over the rounds of that "
        "round's CPU per request over the same round's pass-through's (paired: the two cells ran back to back, "
        "so a slow minute of the shared machine weighs on both), `x pass-through min-max` = the lowest and "
        "highest of those; `x of medians` = the median CPU per request over the pass-through's median.")
    say()
    say("| workload | c | server | req/s | p50 ms | p99 ms | added p50 ms | first delta p50 / p99 ms "
        "| added first delta p50 ms | CPU/req ms | CPU/chunk us | x pass-through CPU | x pass-through min-max "
        "| x of medians | peak RSS MB | errors | upstream CPU/req ms | loadgen CPU/req ms |")
    say("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for wname, model in WORKLOADS:
        stream = model != "bench-json"
        for conc in concs:
            d = median_cell(results[(wname, conc, "direct")])
            pt_cells = results[(wname, conc, "pass-through")]
            pt_cpu = cpu_per_req(median_cell(pt_cells))
            for name in ("direct", "pass-through", "proxy", NO_CHAIN):
                cells = results.get((wname, conc, name))
                if cells is None:
                    continue
                r = median_cell(cells)
                n = r["n"] or 1
                cpu_req = cpu_per_req(r)
                is_proxy = name in ("proxy", NO_CHAIN)
                of_medians = cpu_req / pt_cpu if is_proxy and pt_cpu else None
                paired = round_ratios(cells, pt_cells) if is_proxy else []
                ratio = paired[(len(paired) - 1) // 2] if paired else None
                spread = f"{paired[0]:.2f}-{paired[-1]:.2f}" if paired else "-"
                added = r["p50"] - d["p50"] if name != "direct" and r["p50"] is not None else None
                ttft = f"{fmt(r.get('ttft50'))} / {fmt(r.get('ttft99'))}" if stream else "-"
                added_ttft = (r["ttft50"] - d["ttft50"]) if stream and name != "direct" and r.get("ttft50") else None
                per_chunk = cpu_req * 1000 / 100 if stream and name != "direct" else None
                errors = sum(c["errors"] for c in cells)
                say(f"| {wname} | {conc} | {name} | {r['rps']:.0f} | {fmt(r['p50'])} | {fmt(r['p99'])} | {fmt(added)} "
                    f"| {ttft} | {fmt(added_ttft)} | {fmt(cpu_req, '.4f' if name == 'direct' else '.3f')} "
                    f"| {fmt(per_chunk, '.1f')} | {fmt(ratio)} | {spread} | {fmt(of_medians)} | {r['hwm']:.0f} | {errors} "
                    f"| {fmt(r['upstream_cpu'] / n * 1000, '.4f')} | {fmt(r['load_cpu'] / n * 1000, '.3f')} |")
    if scaling:
        say()
        say(f"Scaling (`serve --workers N`; every process, the load generator and the fake upstream on both cores; "
            f"{rounds} round{'s' * (rounds > 1)}, 1 and 2 workers interleaved; req/s and its columns from the "
            f"median round by req/s; `x 1 worker` = median over median, min-max over the rounds):")
        say()
        say("| workload | c | workers | req/s | p50 ms | p99 ms | proxy CPU/req ms | errors | x 1 worker | min-max |")
        say("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for (wname, conc, workers), runs in scaling.items():
            r = sorted(runs, key=lambda x: x["rps"])[(len(runs) - 1) // 2]
            one = scaling.get((wname, conc, 1)) or runs
            base = sorted(x["rps"] for x in one)[(len(one) - 1) // 2]
            per_round = [a["rps"] / b["rps"] for a, b in zip(runs, one) if b["rps"]]
            spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if workers > 1 and per_round else "-"
            say(f"| {wname} | {conc} | {workers} | {r['rps']:.0f} | {fmt(r['p50'])} | {fmt(r['p99'])} "
                f"| {cpu_per_req(r):.3f} | {sum(x['errors'] for x in runs)} "
                f"| {fmt(r['rps'] / base if base else None)} | {spread} |")
    say()
    say(hold_line)


if __name__ == "__main__":
    sys.exit(main())
