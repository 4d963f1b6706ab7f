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
