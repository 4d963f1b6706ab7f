"""Two checkouts of the proxy, measured side by side against the same pass-through.

    .venv/bin/python -m bench.paired --tree ../before                    # this tree vs ../before, non-stream
    .venv/bin/python -m bench.paired --tree ../before --model bench-coalesced --conc 1,16
    .venv/bin/python -m bench.paired --rounds 9 --seconds 3             # this tree alone, more rounds

`make bench` says how far the proxy is from the floor; on this shared machine that ratio swings
with the minute (the pass-through's own CPU per request has doubled from one run to the next),
so two `make bench` runs an hour apart cannot say whether a change made the proxy slower. This
runs the trees at the same time instead: the pass-through and one proxy per tree are started
together, each round runs a cell of each back to back (the same wrk or bench.sse_client cells
as `make bench`, the same pinning: servers on core 0, load and the C fake upstream on core 1),
and the rounds interleave. Reported per tree and concurrency: the median CPU per request (every
thread) and the median of the per-round ratios to the pass-through and to the first tree, with
their min-max. Loopback only. Each tree's proxy runs from its own directory with this venv, on
its own temp SQLite ledger and key made by that tree's own code, with the default chain.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.__main__ import (LOAD_CORE, PY, ROOT, SERVER_CORE, Server, build_upstream, cpu_per_req, free_port,
                            raise_nofile, run_sse, run_wrk, start, wait_port)
from bench.trees import tree_key, write_tree_config


def start_tree(tree: Path, tmp: Path, upstream_port: int) -> Server:
    """The proxy of `tree` (bench.trees: its config and key), on its own ledger."""
    port = free_port()
    key = tree_key(tree, tmp / "ledger.db")
    config = write_tree_config(tmp, port, upstream_port)
    log = open(tmp / "proxy.log", "ab")
    # `python -m proxy` from the tree's directory imports that tree's proxy and middlewares.
    proc = subprocess.Popen(["taskset", "-c", SERVER_CORE, PY, "-m", "proxy", "--config", str(config), "serve"],
                            cwd=tree, stdout=log, stderr=log, preexec_fn=raise_nofile)
    wait_port(port)
    return Server(str(tree), proc, port, "/v1/responses", "responses", {"Authorization": f"Bearer {key}"})


def paired_ratios(cells: list[dict], base: list[dict]) -> str:
    """Round by round, CPU per request over the base's in the same round: "median (min-max)"."""
    r = [cpu_per_req(a) / cpu_per_req(b) for a, b in zip(cells, base, strict=True)]
    return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="another checkout to run beside this one (repeatable)")
    ap.add_argument("--model", default="bench-json", help="bench-json (non-stream), bench-coalesced or bench-chunked")
    ap.add_argument("--conc", default="1,16", help="concurrencies (default 1,16)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per cell (wrk takes whole seconds)")
    args = ap.parse_args()
    raise_nofile()
    trees = [ROOT] + [Path(t).resolve() for t in args.tree]
    tmp = Path(tempfile.mkdtemp(prefix="rp-paired-"))
    exe = build_upstream()
    up_port = free_port()
    servers: list[Server] = []
    try:
        up = Server("direct", start([str(exe), str(up_port)], LOAD_CORE, env={"FAKE_GAP_US": "1000"}), up_port,
                    "/v1/chat/completions", "chat")
        wait_port(up_port)
        pt_port = free_port()
        pt = Server("pass-through", start([PY, "-m", "bench.passthrough", str(pt_port), f"http://127.0.0.1:{up_port}"],
                                          SERVER_CORE), pt_port, "/v1/chat/completions", "chat")
        wait_port(pt_port)
        servers = [up, pt]
        for i, tree in enumerate(trees):
            (tmp / str(i)).mkdir()
            servers.append(start_tree(tree, tmp / str(i), up_port))
        print(f"{args.model}, {args.rounds} rounds of {args.seconds:g} s cells, servers interleaved per round")
        for conc in (int(c) for c in args.conc.split(",")):
            cells: dict[str, list[dict]] = {s.name: [] for s in servers[1:]}
            for _ in range(args.rounds):
                for srv in servers[1:]:
                    cell = (run_wrk(srv, up, conc, args.seconds, tmp, LOAD_CORE) if args.model == "bench-json"
                            else run_sse(srv, up, args.model, conc, args.seconds, LOAD_CORE))
                    if cell["errors"]:
                        raise RuntimeError(f"{srv.name}: {cell['errors']} errors at c={conc}")
                    cells[srv.name].append(cell)
            first = cells[str(trees[0])]
            for name, got in cells.items():
                median = statistics.median(cpu_per_req(c) for c in got)
                line = f"c={conc:<3} {median:7.3f} ms CPU/request"
                if name != pt.name:
                    line += (f"   x pass-through {paired_ratios(got, cells[pt.name])}"
                             f"   x this tree {paired_ratios(got, first)}")
                print(f"{line}   {name}", flush=True)
    finally:
        for srv in servers:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
