"""Fixtures of the real-vLLM tier: vLLM servers on the tiny model, the proxy in front of them.

Run by `make test-vllm` (= `bash scripts/vllm_tier/run.sh`), which builds the venv and the model
and sets:
    VLLM_TIER_PYTHON   python of the vLLM venv (.venv-vllm/bin/python)
    VLLM_TIER_MODEL    the tiny model folder (scripts/vllm_tier/build_tiny_model.py)
    VLLM_TIER_WORKDIR  where servers keep caches and logs (a fresh temp folder by default)
    VLLM_TIER_EMBED_MODEL  the tiny embedding model folder (scripts/vllm_tier/build_tiny_embedder.py)

The servers are started here, by session fixtures, only when a test needs them, one after the
other (2 cores): worker "vllm-a" for every test, worker "vllm-b" only for the two-worker tests,
worker "vllm-embed" (the embedding model, `--runner pooling`) only for the embeddings test.
Three proxies: `proxy_single` (vllm-a only: deterministic routing for cached tokens and counts),
`proxy_pair` (vllm-a + vllm-b: affinity and failover) and `proxy_pair_no_affinity` (the same two
workers, prompt-cache affinity off: the baseline the affinity test compares against), and
`proxy_billed` (vllm-a + vllm-embed behind auth and the balance, with prices and one key: the
pass-through endpoints billed from the ledger's rows). Every process started here is
stopped at the end of the session (its whole process group), logs are kept in the workdir.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "vllm_tier"))

import servers  # noqa: E402
from tests.conftest import only

MODEL = servers.SERVED_MODEL
MAX_MODEL_LEN = servers.MAX_MODEL_LEN
# What the tiny model says when nothing constrains it (see build_tiny_model.py).
SCRIPTED_REASONING = "Let me think about it"
SCRIPTED_CONTENT = "Hello! I am a tiny test model."

STARTUP_TIMEOUT = float(os.environ.get("VLLM_TIER_STARTUP_TIMEOUT", "300"))


@dataclass
class Tier:
    python: str
    model_dir: str
    workdir: str
    embed_model_dir: str


@dataclass
class ProxyInfo:
    proc: servers.Proc
    workers: dict[str, servers.Proc]
    config_path: str

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def base_url(self) -> str:
        return self.proc.url + "/v1"

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("timeout", 300.0)
        return openai.OpenAI(base_url=self.base_url, api_key="x", max_retries=0, **kwargs)


def _timings_note(workdir: str, line: str) -> None:
    with open(os.path.join(workdir, "timings.txt"), "a") as f:
        f.write(line + "\n")
    print(line, file=sys.stderr)


@pytest.fixture(scope="session")
def tier() -> Tier:
    python = os.environ.get("VLLM_TIER_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    model_dir = os.environ.get("VLLM_TIER_MODEL") or str(REPO / ".cache" / "vllm-tier" / "tiny-model")
    if not os.path.exists(python):
        pytest.fail(f"no vLLM venv at {python}: run `bash scripts/vllm_tier/run.sh` (make test-vllm)")
    if not os.path.exists(os.path.join(model_dir, ".complete")):
        pytest.fail(f"no tiny model at {model_dir}: run `bash scripts/vllm_tier/run.sh` (make test-vllm)")
    workdir = os.environ.get("VLLM_TIER_WORKDIR") or tempfile.mkdtemp(prefix="vllm-tier-")
    os.makedirs(workdir, exist_ok=True)
    print(f"\nvLLM tier workdir (logs): {workdir}", file=sys.stderr)
    embed = os.environ.get("VLLM_TIER_EMBED_MODEL") or str(REPO / ".cache" / "vllm-tier" / "tiny-embedder")
    return Tier(python=python, model_dir=model_dir, workdir=workdir, embed_model_dir=embed)


def _start_vllm(tier: Tier, name: str, env_port: str, default_port: int, *, model_dir: str | None = None,
                args: list[str] | None = None) -> servers.Proc:
    port = int(os.environ.get(env_port) or 0) or default_port
    if not servers.port_is_free(port):
        port = servers.free_port()
    proc = servers.start_vllm(tier.python, model_dir or tier.model_dir, port, os.path.join(tier.workdir, name),
                              name=name, args=args)
    try:
        took = servers.wait_ready(proc, "/health", timeout=STARTUP_TIMEOUT)
    except BaseException:
        servers.stop(proc)
        raise
    _timings_note(tier.workdir, f"vLLM {name} ready on :{port} after {took:.1f}s")
    return proc


@pytest.fixture(scope="session")
def vllm_a(tier):
    proc = _start_vllm(tier, "vllm-a", "VLLM_TIER_PORT_A", 8101)
    yield proc
    servers.stop(proc)


@pytest.fixture(scope="session")
def vllm_b(tier, vllm_a):  # depends on vllm_a: start-ups run one after the other
    proc = _start_vllm(tier, "vllm-b", "VLLM_TIER_PORT_B", 8102)
    yield proc
    servers.stop(proc)


@pytest.fixture(scope="session")
def vllm_embed(tier, vllm_a):  # after vllm_a: start-ups run one after the other
    if not os.path.exists(os.path.join(tier.embed_model_dir, ".complete")):
        pytest.fail(f"no tiny embedder at {tier.embed_model_dir}: run `bash scripts/vllm_tier/run.sh` (make test-vllm)")
    proc = _start_vllm(tier, "vllm-embed", "VLLM_TIER_PORT_EMBED", 8103, model_dir=tier.embed_model_dir,
                       args=servers.EMBED_ARGS)
    yield proc
    servers.stop(proc)


def _proxy_config(path: str, workers: dict[str, servers.Proc], ledger: str, routing: dict | None = None,
                  extra: dict | None = None) -> None:
    import yaml

    config = {
        **only("stateless"),  # no auth, limits or balance in this tier (but proxy_billed's)
        "server": {"log_format": "json", "log_level": "info"},
        "workers": [
            {"name": name, "url": proc.url, "dialect": "vllm",
             "models": [servers.EMBED_MODEL if name == "vllm-embed" else MODEL],
             "timeouts": {"connect": 5, "first_byte": 120, "idle": 120, "total": 600}}
            for name, proc in workers.items()
        ],
        "health": {"interval_s": 1.0, "timeout_s": 2.0},
        "ledger": {"path": ledger},
    }
    if routing:
        config["routing"] = routing
    config.update(extra or {})
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)


def _start_proxy(tier: Tier, name: str, workers: dict[str, servers.Proc], routing: dict | None = None,
                 extra: dict | None = None) -> ProxyInfo:
    folder = os.path.join(tier.workdir, name)
    os.makedirs(folder, exist_ok=True)
    config_path = os.path.join(folder, "config.yaml")
    _proxy_config(config_path, workers, os.path.join(folder, "ledger.db"), routing, extra)
    return ProxyInfo(proc=_serve(tier, name, config_path, folder), workers=workers, config_path=config_path)


def _serve(tier: Tier, name: str, config_path: str, folder: str) -> servers.Proc:
    """`python -m proxy serve` with that config, ready (its /healthz answers)."""
    port = servers.free_port()
    proc = servers.start_proxy(str(REPO / ".venv" / "bin" / "python"), config_path, port, folder, name=name)
    try:
        took = servers.wait_ready(proc, "/healthz", timeout=60)
    except BaseException:
        servers.stop(proc)
        raise
    _timings_note(tier.workdir, f"proxy {name} ready on :{port} after {took:.1f}s")
    return proc


@pytest.fixture(scope="session")
def proxy_single(tier, vllm_a):
    info = _start_proxy(tier, "proxy-single", {"vllm-a": vllm_a})
    yield info
    servers.stop(info.proc)


@pytest.fixture(scope="session")
def proxy_pair(tier, vllm_a, vllm_b):
    info = _start_proxy(tier, "proxy-pair", {"vllm-a": vllm_a, "vllm-b": vllm_b})
    yield info
    servers.stop(info.proc)


@pytest.fixture(scope="session")
def proxy_pair_no_affinity(tier, vllm_a, vllm_b):
    """A second proxy on the same two workers with prompt-cache affinity off: least loaded, ties
    take turns, so sequential turns of one conversation alternate between the workers."""
    info = _start_proxy(tier, "proxy-pair-no-affinity", {"vllm-a": vllm_a, "vllm-b": vllm_b},
                        routing={"affinity": {"enabled": False}})
    yield info
    servers.stop(info.proc)


@pytest.fixture(scope="session")
def proxy_sealed(tier, vllm_a):
    """vllm-a behind a proxy with a seal key: /v1/responses/compact and a compaction_trigger seal
    their summaries with it. The `compact` section is the shipped one (max_summary_tokens 2048,
    the tiny model's whole window: the cap is fitted to the room the prompt leaves)."""
    import base64

    key = base64.urlsafe_b64encode(os.urandom(32)).decode()
    info = _start_proxy(tier, "proxy-sealed", {"vllm-a": vllm_a}, extra={"reasoning_seal": {"keys": {"k1": key}}})
    yield info
    servers.stop(info.proc)


# proxy_billed's prices, micros per million tokens: 3 / 1 / 7 micros a token (cached input apart).
PRICES = {"input": 3_000_000, "cached_input": 1_000_000, "output": 7_000_000}


@dataclass
class Billed:
    info: ProxyInfo
    key: str
    ledger: str

    def rows(self, request_id: str, timeout: float = 10.0) -> list[dict]:
        """The ledger's usage rows of a request (settled before its last bytes went out; the
        writer thread commits them within a few ms)."""
        import sqlite3

        deadline = time.monotonic() + timeout
        while True:
            with sqlite3.connect(f"file:{self.ledger}?mode=ro", uri=True) as conn:
                conn.row_factory = sqlite3.Row
                rows = [dict(r) for r in conn.execute("SELECT * FROM usage WHERE request_id = ?", (request_id,))]
            if rows or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)


@pytest.fixture(scope="session")
def proxy_billed(tier, vllm_a, vllm_embed):
    """vllm-a (chat, completions, messages) and vllm-embed (embeddings) behind auth and the
    balance with PRICES; one key, created with the CLI before the proxy starts."""
    import json as _json
    import subprocess

    name = "proxy-billed"
    folder = os.path.join(tier.workdir, name)
    os.makedirs(folder, exist_ok=True)
    config_path = os.path.join(folder, "config.yaml")
    ledger = os.path.join(folder, "ledger.db")
    _proxy_config(config_path, {"vllm-a": vllm_a, "vllm-embed": vllm_embed}, ledger,
                  extra={**only("auth", "balance"), "prices": {"default": PRICES}})
    made = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "proxy", "--config", config_path, "keys",
                           "create", "tier", "--json", "--balance", str(10**12)],
                          cwd=REPO, capture_output=True, text=True, check=True)
    key = _json.loads(made.stdout)["secret"]
    proc = _serve(tier, name, config_path, folder)
    yield Billed(ProxyInfo(proc=proc, workers={"vllm-a": vllm_a, "vllm-embed": vllm_embed},
                           config_path=config_path), key, ledger)
    servers.stop(proc)


@pytest.fixture
def client(proxy_single):
    c = proxy_single.client()
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _report_logs_on_failure(request):
    """On failure, point at the logs (the proxy's and the servers' tails are in the workdir)."""
    t0 = time.monotonic()
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        workdir = os.environ.get("VLLM_TIER_WORKDIR", "(see 'vLLM tier workdir' above)")
        print(f"\n[{request.node.name} failed after {time.monotonic() - t0:.1f}s; logs under {workdir}]",
              file=sys.stderr)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
