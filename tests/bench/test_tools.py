"""bench/trees.py (the config every compared tree runs, with bench.opcodes' --set merged in) and
bench/paired.py (how it pairs the rounds)."""

from __future__ import annotations

from pathlib import Path

from bench.paired import paired_ratios
from bench.trees import write_tree_config
from proxy.config.load import Config


def test_the_tree_config_is_one_this_tree_accepts(tmp_path: Path):
    # The strict config refuses an unknown or misspelt key: a paired run would die at start-up.
    config = Config.load(write_tree_config(tmp_path, 18080, 18081))
    assert config["auth"]["demo_key"] is False
    assert config["workers"][0]["url"] == "http://127.0.0.1:18081"
    assert config["ledger"]["path"] == str(tmp_path / "ledger.db")


def _cell(cpu_s: float, n: int) -> dict:
    return {"cpu": cpu_s, "n": n}


def test_each_round_is_divided_by_the_same_rounds_base():
    base = [_cell(1.0, 1000), _cell(2.0, 1000), _cell(1.0, 1000)]  # 1, 2, 1 ms per request
    cells = [_cell(2.0, 1000), _cell(3.0, 1000), _cell(1.5, 1000)]  # 2, 3, 1.5 ms per request
    # Per round 2.0, 1.5, 1.5: the median of those, not the ratio of the medians (2 / 1).
    assert paired_ratios(cells, base) == "1.50 (1.50-2.00)"


def test_opcodes_set_merges_into_the_sections_it_names(tmp_path: Path):
    # --set '{"balance": {"enabled": false}}' turns one policy off and leaves the rest of the
    # config as it was, so that two counts differ by that policy alone.
    path = write_tree_config(tmp_path, 18080, 18081, {"balance": {"enabled": False}, "limits": {"enabled": False}})
    config = Config.load(path)
    assert config["balance"]["enabled"] is False and config["limits"]["enabled"] is False
    assert config["limits"]["global_concurrency"] == 4096  # the rest of its section kept
    assert config["auth"]["demo_key"] is False and config["server"]["port"] == 18080


def test_every_instructions_variant_is_a_config_this_tree_accepts(tmp_path: Path):
    # bench.instructions starts one proxy per row: a key this tree refuses would end the run
    # minutes in, under valgrind.
    import json

    from bench.instructions import VARIANTS, variant_config

    for name, extra in VARIANTS.items():
        path = tmp_path / f"{len(name)}.yaml"
        path.write_text(json.dumps(variant_config(18080, 18081, tmp_path / "ledger.db", extra, 50)))
        config = Config.load(path)
        balance = config["balance"]
        assert balance["lease_commit_ms"] == 3_600_000 and balance["lease_commit_rows"] == 40  # commits by count
        assert balance["lease_min_rate"] == 1 and config["health"]["interval_s"] == 3600
        for section, values in extra.items():
            for key, value in values.items():
                if value == "fake-upstream":  # "tracing on" exports to the fake upstream, on its port
                    value = "http://127.0.0.1:18081/v1/traces"
                assert config[section][key] == value, name


def test_the_instructions_table_replaces_only_its_section(tmp_path: Path):
    from bench.instructions import HEADING, write

    out = tmp_path / "results.md"
    out.write_text("## Design measurements\n\nkept\n\n### Backends p99\n\nrows\n")
    write(out, [HEADING, "", "first"])
    write(out, [HEADING, "", "second"])
    text = out.read_text()
    assert "first" not in text and text.count(HEADING) == 1 and "second" in text
    assert text.startswith("## Design measurements\n\nkept\n\n### Backends p99\n\nrows\n")


def test_the_edge_table_replaces_only_its_section(tmp_path: Path):
    from bench.instructions import EDGE_HEADING, HEADING, write

    out = tmp_path / "results.md"
    out.write_text("## Design measurements\n\nkept\n\n" + HEADING + "\n\nissue 28 rows\n")
    write(out, [EDGE_HEADING, "", "first"])
    write(out, [EDGE_HEADING, "", "second"])
    write(out, [HEADING, "", "issue 28 again"])
    text = out.read_text()
    assert text.count(EDGE_HEADING) == 1 and "second" in text and "first" not in text
    assert "issue 28 again" in text and "issue 28 rows" not in text and text.index(HEADING) < text.index(EDGE_HEADING)


async def test_the_edge_cases_answer_through_the_pass_through_and_the_proxy(make_proxy, http):
    """bench.instructions' pass-through cases against the C fake upstream (compiled as `make
    bench` does) through bench/passthrough.py and through the proxy: each answers 200 with the
    upstream's answer (a stream the proxy asked the usage for: less its usage chunk), each is
    billed on its endpoint's row. A case that broke would end a bench run minutes in, under valgrind."""
    import asyncio
    import shutil
    import subprocess
    import sys

    import pytest

    from bench.__main__ import BENCH, build_upstream, free_port, wait_port
    from bench.instructions import EDGE_CASES, edge_body
    from middlewares.balance import wait_for_settlements

    if shutil.which("gcc") is None:
        pytest.skip("no C compiler for bench/fake_upstream.c")
    exe = build_upstream()
    up_port, pt_port = free_port(), free_port()
    procs = [subprocess.Popen([str(exe), str(up_port)], stdout=subprocess.DEVNULL),
             subprocess.Popen([sys.executable, str(BENCH / "passthrough.py"), str(pt_port),
                               f"http://127.0.0.1:{up_port}"])]
    try:
        for port in (up_port, pt_port):
            await asyncio.get_running_loop().run_in_executor(None, wait_port, port)
        proxy = await make_proxy(workers=[{"name": "fake", "url": f"http://127.0.0.1:{up_port}", "dialect": "vllm",
                                           "models": ["bench-json", "bench-coalesced"]}])
        for name, model, stream, path in EDGE_CASES:
            body = edge_body(path, model, stream)
            answers = []
            for url, headers in ((f"http://127.0.0.1:{pt_port}", {}),
                                 (proxy.url, {"x-api-key": proxy.api_key})):
                async with http.post(url + path, data=body, headers={"Content-Type": "application/json", **headers}) as r:
                    assert r.status == 200, (name, url, await r.text())
                    answers.append(await r.read())
            direct, through = answers
            if path in ("/v1/chat/completions", "/v1/completions") and stream:
                usage = [e for e in direct.split(b"\n\n") if b'"usage"' in e]
                assert len(usage) == 1 and through == direct.replace(usage[0] + b"\n\n", b""), name
            else:
                assert through == direct, name
        await wait_for_settlements(proxy.app)
        rows = await proxy.ledger.list_usage()
        assert sorted(r.endpoint for r in rows) == sorted(path for *_, path in EDGE_CASES)
        assert all(r.status == "completed" and r.input_tokens > 0 for r in rows)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
