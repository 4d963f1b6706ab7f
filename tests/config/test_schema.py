"""config.yaml against its one schema, the settings classes (proxy/config/sections.py): every mistake is a start-up
error naming the key's path; config.yaml is the generated reference; `serve` refuses a bad
or busy port in one line; the config file's folder is on the import path; no demo key with
a config file unless asked for."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import pytest
import yaml

from proxy.config import reference as config_reference, schema as config_schema, sections as config_sections
from proxy.config import settings as config_settings, types as config_types
from proxy.config.load import DEFAULTS, Config, ConfigError
from tests.conftest import eventually_sync
from tests.support.paths import REPO as ROOT

PYTHON = ROOT / ".venv" / "bin" / "python"
if not PYTHON.exists():
    PYTHON = Path(sys.executable)
SCRIPT = PYTHON.parent / "responses-proxy"


def _load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return Config.load(path)


def _error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message
    return message


MISTAKES = [
    ("worker:\n  - {name: a, url: http://10.0.0.5:8000}\n", "unknown key 'worker' (did you mean 'workers'?)"),
    ("metrics: {enable: false}\n", "unknown key 'metrics.enable' (did you mean 'metrics.enabled'?)"),
    ("server: {prot: 9000}\n", "unknown key 'server.prot' (did you mean 'server.port'?)"),
    ("auth: {demo_keyy: true}\n", "unknown key 'auth.demo_keyy' (did you mean 'auth.demo_key'?)"),
    ("workers: [{name: a, url: embedded, modles: [m]}]\n",
     "unknown key 'workers[0].modles' (did you mean 'workers[0].models'?)"),
    ("ledger: {pth: /tmp/x.db}\n", "unknown key 'ledger.pth' (did you mean 'ledger.path'?)"),
    ("health: {outlier: {consecutive_failure: 3}}\n",
     "unknown key 'health.outlier.consecutive_failure' (did you mean 'health.outlier.consecutive_failures'?)"),
    ("routing: {affinity: {vnode: 3}}\n", "unknown key 'routing.affinity.vnode' (did you mean 'routing.affinity.vnodes'?)"),
    ("balance: {lease_ttl: 3}\n", "unknown key 'balance.lease_ttl' (did you mean 'balance.lease_ttl_s'?)"),
    ("auth: {enabeld: false}\n", "unknown key 'auth.enabeld' (did you mean 'auth.enabled'?)"),
    ("middlewares: {after_auht: []}\n", "unknown key 'middlewares.after_auht' (did you mean 'middlewares.after_auth'?)"),
    ("auth: {static_keys: [{name: a, key: x, modles: [m]}]}\n", "unknown key 'auth.static_keys[0].modles'"),
    ("prices: {m: {input: 1, output: 2, cache: 1}}\n", "unknown key 'prices.m.cache'"),
    ("zzz: 1\n", "unknown key 'zzz' (known here: server, simulator, workers"),
    # wrong types and bounds: the path and the expected type
    ("server: {max_body_bytes: 0}\n", "server.max_body_bytes must be an integer >= 1, not 0"),
    ("server: {max_json_depth: 0}\n", "server.max_json_depth must be an integer >= 1, not 0"),
    ("server: {max_input_items: -1}\n", "server.max_input_items must be an integer >= 1, not -1"),
    ("server: {max_tools: 0}\n", "server.max_tools must be an integer >= 1, not 0"),
    ("server: {max_body_bytes: 1.5}\n", "server.max_body_bytes must be an integer >= 1, not 1.5"),
    ("server: {port: http}\n", "server.port must be an integer from 1 to 65535, not 'http'"),
    ("server: {port: 70000}\n", "server.port must be an integer from 1 to 65535, not 70000"),
    ("server: {body_read_timeout: 0}\n", "server.body_read_timeout must be a number > 0, not 0"),
    ("server: {workers: many}\n", "server.workers must be an integer >= 0 or one of auto, not 'many'"),
    ("server: {log_format: xml}\n", "server.log_format must be one of json, console, auto, not 'xml'"),
    ("metrics: {enabled: 'no'}\n", "metrics.enabled must be true or false, not 'no'"),
    ("metrics: [enabled]\n", "metrics must be a mapping, not ['enabled']"),
    ("workers: []\n", "workers must be a non-empty list of mappings, not []"),
    ("workers: [{name: a, url: embedded, capacity: 0}]\n", "workers[0].capacity must be an integer >= 1, not 0"),
    ("workers: [{name: a, url: embedded, models: tiny-model}]\n",
     "workers[0].models must be a list of strings or null, not 'tiny-model'"),
    ("workers: [{url: embedded}]\n", "workers[0] needs 'name'"),
    ("workers: [{name: a, url: embedded, timeouts: {total: 0}}]\n",
     "workers[0].timeouts.total must be a number > 0, not 0"),
    ("limits: {global_concurrency: 0}\n", "limits.global_concurrency must be an integer >= 1 or null, not 0"),
    ("balance: {lease_commit_ms: 0}\n", "balance.lease_commit_ms must be a number > 0, not 0"),
    ("notices: {max_bytes: 1}\n", "notices.max_bytes must be an integer from 64 to 16384, not 1"),
    ("health: {outlier: {max_ejection_percent: 101}}\n",
     "health.outlier.max_ejection_percent must be an integer from 0 to 100, not 101"),
    ("reasoning_seal: {ttl_s: 0}\n", "reasoning_seal.ttl_s must be a number > 0, not 0"),
    ("middlewares: {after_prepare: x:y}\n", "middlewares.after_prepare must be a list of"),
    ("pipeline: [auth]\n", "pipeline is no longer a setting"),
    # the rules across keys (proxy/config/cross_checks.py)
    ("workers: [{name: a, url: embedded}, {name: a, url: embedded}]\n", "workers[1]: duplicate worker name 'a'"),
    ("workers: [{name: a, url: embedded, api_key: \"k\\r\\n\"}]\n",
     "workers[0].api_key contains the character '\\r': only printable ASCII"),
    ("health: {outlier: {base_ejection_s: 10, max_ejection_s: 5}}\n", "0 <= base_ejection_s <= max_ejection_s"),
    ("auth: {static_keys: [{name: a, key: k, sha256: x}]}\n", "auth.static_keys[0] (a) needs exactly one of sha256 or key"),
    ("auth: {static_keys: [{name: a, sha256: xyz}]}\n", "auth.static_keys[0] (a): sha256 must be 64 hex digits"),
    ("auth: {static_keys: [{name: a, key: k}, {name: a, key: j}]}\n", "auth.static_keys[1]: duplicate static key name 'a'"),
    ("admin: {keys: [{name: a, key: short}]}\n", "admin.keys[0] (a): key must be at least 16 printable characters"),
    ("admin: {keys: [{name: a, key: xxxxxxxxxxxxxxxxxxxx}], prefix: /v1/x}\n",
     "admin.prefix must be a path of its own (e.g. /admin), not '/v1/x'"),
    ("reasoning_seal: {keys: {k1: abc}}\n", "reasoning_seal.keys.k1 must be 32 bytes"),
    ("tools: {drop: [function]}\n", "tools.drop cannot name function: those tools are translated"),
    ("tools: {refuse: [web_search]}\n", "tools: web_search is both dropped and refused"),
    ("notices: {header: 'bad header'}\n", "notices.header must be a valid HTTP header name, not 'bad header'"),
    ("prices: {m: {input: 1.5, output: 2}}\n", "prices.m.input must be a non-negative integer number of micro-units"),
    # the environment
    ("workers: [{name: a, url: embedded, api_key: '${RP_TEST_UNSET_A}'}]\n",
     "${RP_TEST_UNSET_A} is not set (workers[0].api_key)"),
    ("server: {port: '${RP_TEST_PORT_TEXT}'}\n",
     "server.port must be an integer from 1 to 65535, not 'eighty' (from ${RP_TEST_PORT_TEXT})"),
]


@pytest.mark.parametrize("text, expected", MISTAKES, ids=[m[1][:48] for m in MISTAKES])
def test_each_mistake_names_its_key(tmp_path, monkeypatch, text, expected):
    monkeypatch.delenv("RP_TEST_UNSET_A", raising=False)
    monkeypatch.setenv("RP_TEST_PORT_TEXT", "eighty")
    message = _error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'config.yaml'}: "), message
    assert expected in message, message


def test_a_policy_switched_off_skips_its_rules(tmp_path):
    _load(tmp_path, "auth: {enabled: false, static_keys: [{name: a}]}\ntools: {enabled: false, drop: [function]}\n"
                    "admin: {prefix: /}\n")


def test_environment_values_take_the_keys_type(tmp_path, monkeypatch):
    monkeypatch.setenv("RP_TEST_PORT", "9123")
    monkeypatch.setenv("RP_TEST_FLAG", "false")
    monkeypatch.setenv("RP_TEST_SECRET", "s3cret")
    config = _load(tmp_path, "server: {port: '${RP_TEST_PORT}'}\nmetrics: {enabled: '${RP_TEST_FLAG}'}\n"
                             "workers: [{name: a, url: embedded, api_key: '${RP_TEST_SECRET}'}]\n")
    assert config["server"]["port"] == 9123
    assert config["metrics"]["enabled"] is False
    assert config["workers"][0]["api_key"] == "s3cret" and type(config["workers"][0]["api_key"]) is str


def test_custom_middleware_sections_are_free_form_only_when_named_at_a_point(tmp_path):
    config = _load(tmp_path, 'middlewares: {after_auth: ["mycompany.audit:create"]}\n'
                             '"mycompany.audit:create": {anything: [1, 2], goes: here}\n')
    assert config["mycompany.audit:create"] == {"anything": [1, 2], "goes": "here"}
    assert "unknown key 'mycompany.audit:create'" in _error(tmp_path, '"mycompany.audit:create": {a: 1}\n')


def test_an_empty_section_keeps_its_defaults(tmp_path):
    config = _load(tmp_path, "metrics:\n  # enabled: false\nhealth:\n")
    assert config["metrics"] == DEFAULTS["metrics"] and config["health"] == DEFAULTS["health"]


# ----------------------------------------------------------------------------- the reference


def test_config_yaml_is_the_generated_reference():
    assert (ROOT / "config.yaml").read_text() == config_reference.reference(), (
        "config.yaml differs from the schema: regenerate it with "
        "`.venv/bin/responses-proxy config reference > config.yaml`")


def test_the_reference_loads_as_the_defaults(tmp_path):
    (tmp_path / "config.yaml").write_text(config_reference.reference())
    loaded = Config.load(tmp_path / "config.yaml").data
    assert loaded == DEFAULTS
    assert loaded["auth"]["demo_key"] is False  # an operator's file: no demo key unless written


def test_every_key_the_reference_shows_commented_out_is_known():
    # Uncommenting a shown key (with a value) must load: the doc and the schema agree.
    text = config_reference.reference()
    shown = re.findall(r"^(\s*)# (\w+): (\S[^#]*?)\s*(?:#.*)?$", text, re.M)
    assert len(shown) >= 15
    for indent, key, value in shown:
        if value != "...":
            assert key in _all_keys(config_schema.SCHEMA), key


def _all_keys(section) -> set[str]:
    out = set(section.keys)
    for key in section.keys.values():
        inner = key.type
        while hasattr(inner, "item") or hasattr(inner, "inner") or hasattr(inner, "value"):
            inner = getattr(inner, "item", None) or getattr(inner, "inner", None) or getattr(inner, "value")
        if isinstance(inner, config_schema.Section):
            out |= _all_keys(inner)
    return out


def test_the_schema_knows_every_balance_setting_the_middleware_documents():
    import middlewares.balance as balance

    block = balance.__doc__.split("balance:", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\s+(\w+):", block, re.M))
    assert {"hold_ttl_s", "lease_commit_ms", "lease_max_micros"} <= documented
    assert documented <= set(config_schema.SCHEMA.keys["balance"].type.keys)


def test_cli_prints_the_reference():
    proc = subprocess.run([str(PYTHON), "-m", "proxy", "config", "reference"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ROOT / "config.yaml").read_text()


# ----------------------------------------------------------------------------- the typed settings


def _holds(value, hint) -> bool:
    """`value` is what the annotation `hint` says (a settings class, X | None, tuple[X, ...], dict[str, X])."""
    meta = getattr(hint, "__metadata__", None)
    if meta is not None:
        hint = typing.get_args(hint)[0]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_holds(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        return isinstance(value, tuple) and all(_holds(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _holds(v, args[1]) for k, v in value.items())
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint) and all(
            _holds(getattr(value, f.name), h) for f, h in zip(dataclasses.fields(hint),
                                                              typing.get_type_hints(hint, include_extras=True).values()))
    if hint is float:
        return isinstance(value, float)
    return isinstance(value, hint) and not (hint is int and isinstance(value, bool))


def test_the_settings_built_from_the_defaults_are_what_each_annotation_says():
    # The class is the schema: what the start-up check lets through, built, is of the field's type.
    root = config_settings.build(DEFAULTS)
    assert _holds(root, config_sections.Root)
    full = copy.deepcopy(DEFAULTS)
    full["auth"]["static_keys"] = [{"name": "a", "key": "k" * 20, "allowed_models": ["m"], "concurrency": 2,
                                    "rate_per_min": 3}]
    full["prices"]["m"] = {"input": 1.0, "cached_input": 2, "output": 3}
    full["responses"]["sampling_defaults"] = {"m": {"temperature": 1, "top_p": 0.5}}
    full["workers"][0]["labels"] = {"region": "eu"}
    built = config_settings.build(config_schema.validate(full))
    assert _holds(built, config_sections.Root)
    assert built.prices["m"].input == 1 and isinstance(built.prices["m"].input, int)


def test_every_section_class_is_frozen_slotted_and_keyword_only():
    for path, cls in config_settings.classes().items():
        params = cls.__dataclass_params__
        assert params.frozen and "__slots__" in vars(cls), path
        assert all(f.kw_only for f in dataclasses.fields(cls)), path


def test_a_field_without_a_type_of_its_own_takes_its_annotations():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Probe:
        names: tuple[str, ...] = ()
        cap: int | None = 4
        ratio: typing.Annotated[float, config_types.Num(0, 1), "a share"] = 0.5
        off: typing.Annotated[str, "absent: off", config_types.COMMENTED] = None  # type: ignore[assignment]

    section = config_schema.section_of(Probe)
    assert section.check({"names": ["a"], "cap": None, "ratio": 1}, "probe") == {"names": ["a"], "cap": None,
                                                                                   "ratio": 1}
    for bad, message in (({"names": "a"}, "probe.names must be a list of strings"),
                         ({"cap": 1.5}, "probe.cap must be an integer or null"),
                         ({"ratio": 2}, "probe.ratio must be a number from 0 to 1"),
                         ({"off": None}, "probe.off must be a string"),
                         ({"nmes": []}, "did you mean 'probe.names'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            section.check(bad, "probe")
    assert section.defaults() == {"names": [], "cap": 4, "ratio": 0.5}  # COMMENTED: left out
    assert section.keys["ratio"].doc == "a share" and not section.keys["off"].embedded


def test_an_annotation_the_schema_cannot_read_stops_the_import():
    @dataclasses.dataclass(frozen=True)
    class Broken:
        when: set[int] = dataclasses.field(default_factory=set)

    with pytest.raises(TypeError, match="no config type"):
        config_schema.section_of(Broken)


def test_readme_table_is_the_markdown_reference():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- config table: responses-proxy config reference --markdown -->\n", "<!-- end config table -->"
    assert start in readme and end in readme
    table = readme.split(start, 1)[1].split(end, 1)[0]
    assert table == config_reference.markdown_table(), (
        "README's table differs from the settings classes: regenerate it with "
        "`.venv/bin/responses-proxy config reference --markdown`")
    assert "| `balance.lease_commit_ms` |" in table and "| `workers[].timeouts.idle` |" in table


def test_an_unknown_allowed_extension_is_refused_by_config_check(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"ledger: {{path: {tmp_path / 'l.db'}}}\nendpoints: {{allowed_extensions: [priority, nope]}}\n")
    proc = subprocess.run([str(PYTHON), "-m", "proxy", "config", "check", "--config", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "endpoints.allowed_extensions[1] must be one of" in proc.stderr and "'nope'" in proc.stderr, proc.stderr


def test_cli_config_check(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(f"ledger: {{path: {tmp_path / 'l.db'}}}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {prot: 1}\n")
    ok = subprocess.run([str(PYTHON), "-m", "proxy", "--config", str(good), "config", "check"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stderr
    no = subprocess.run([str(PYTHON), "-m", "proxy", "config", "check", "--config", str(bad)], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert no.returncode == 2
    assert no.stderr.strip().splitlines() == [
        f"responses-proxy: configuration error: {bad}: unknown key 'server.prot' (did you mean 'server.port'?)"]


# ----------------------------------------------------------------------------- serve


def _serve(args: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: float = 60):
    return subprocess.run([str(PYTHON), "-m", "proxy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("text, expected", [
    ("worker:\n  - {name: gpu, url: http://10.0.0.5:8000}\n", "unknown key 'worker' (did you mean 'workers'?)"),
    ("metrics: {enable: false}\n", "unknown key 'metrics.enable' (did you mean 'metrics.enabled'?)"),
    ("workers: [{name: a, url: embedded, api_key: '${RP_TEST_UNSET_B}'}]\n",
     "${RP_TEST_UNSET_B} is not set (workers[0].api_key)"),
])
def test_serve_refuses_a_mistake_in_one_line_before_listening(tmp_path, monkeypatch, text, expected):
    monkeypatch.delenv("RP_TEST_UNSET_B", raising=False)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    proc = _serve(["--config", str(path), "serve", "--port", "1"])
    assert proc.returncode == 2
    assert "listening on" not in proc.stdout
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == [f"responses-proxy: configuration error: {path}: {expected}"]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_a_port_in_use_is_one_line(tmp_path, busy_port, workers):
    path = tmp_path / "config.yaml"
    path.write_text(f"ledger: {{path: {tmp_path / 'l.db'}}}\nauth: {{demo_key: true}}\n")
    proc = _serve(["--config", str(path), "serve", "--port", str(busy_port), "--workers", workers])
    assert proc.returncode == 2
    assert proc.stdout == ""  # no "listening on", no demo key
    assert proc.stderr.strip().splitlines() == [
        f"responses-proxy: cannot listen on 127.0.0.1:{busy_port}: address already in use"]


@pytest.mark.parametrize("args, env, expected", [
    (["--port", "abc"], {}, "--port must be a port number from 1 to 65535, not 'abc'"),
    (["--port", "0"], {}, "--port must be a port number from 1 to 65535, not '0'"),
    ([], {"RESPONSES_PROXY_PORT": "80x"}, "RESPONSES_PROXY_PORT must be a port number from 1 to 65535, not '80x'"),
])
def test_serve_bad_port_is_one_line(tmp_path, args, env, expected):
    path = tmp_path / "config.yaml"
    path.write_text(f"ledger: {{path: {tmp_path / 'l.db'}}}\n")
    proc = _serve(["--config", str(path), "serve", *args], env=env)
    assert proc.returncode == 2
    assert (proc.stdout + proc.stderr).strip().splitlines() == [f"responses-proxy: configuration error: {expected}"]


def test_serve_that_cannot_open_its_ledger_is_one_line_without_listening(tmp_path):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "config.yaml"
    path.write_text(f"ledger: {{path: {tmp_path / 'file' / 'l.db'}}}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _serve(["--config", str(path), "serve", "--port", str(port)])
    assert proc.returncode == 1
    assert "listening on" not in proc.stdout
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("responses-proxy: cannot start: cannot open the ledger")


class Server:
    """`responses-proxy serve` (the console script, as an operator runs it) in a subprocess."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(SCRIPT)] if SCRIPT.exists() else [str(PYTHON), "-c", "from proxy.cli import main; main()"]
        self.proc = subprocess.Popen([*command, *args, "--port", str(self.port)], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        import urllib.request

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        eventually_sync(ready, 60, what="serve ready")

    def stop(self) -> tuple[str, str]:
        self.proc.terminate()
        out, err = self.proc.communicate(timeout=30)
        return out, err


def _readme_middleware() -> tuple[str, str]:
    section = (ROOT / "README.md").read_text().split("### Your own middleware", 1)[1].split("\n## ", 1)[0]
    yaml_block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    python_block = re.search(r"```python\n(# mycompany/audit.py\n.*?)```", section, re.S).group(1)
    return yaml_block, python_block


def _post(url: str, body: dict, headers: dict) -> tuple[int, dict, str]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/v1/responses", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode()


def test_readme_middleware_next_to_config_runs_as_written(tmp_path):
    yaml_block, python_block = _readme_middleware()
    site = tmp_path / "site"
    (site / "mycompany").mkdir(parents=True)
    (site / "mycompany" / "audit.py").write_text(python_block)
    (site / "config.yaml").write_text(yaml_block)  # as written: the embedded simulator, ./data/ledger.db
    assert yaml.safe_load(yaml_block)["middlewares"]["after_auth"] == ["mycompany.audit:create"]
    # Run from another folder: the module is found through the config file's folder alone.
    server = Server(["--config", str(site / "config.yaml"), "serve", "--demo-key"], cwd=tmp_path)
    try:
        server.wait_ready()
        key = ""
        deadline = time.monotonic() + 30
        while not key and time.monotonic() < deadline:
            line = server.proc.stdout.readline()
            if line.startswith("demo key: "):
                key = line.split(": ", 1)[1].strip()
        assert key
        body = {"model": "tiny-org/tiny-model", "input": "hi", "max_output_tokens": 16}
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": "abc-1"}
        status, got, text = _post(server.url, body, headers)
        assert status == 200, text
        assert got["x-audited"] == "abc-1"
        status, got, text = _post(server.url, {**body, "stream": True}, headers)
        assert status == 200 and got["content-type"].startswith("text/event-stream")
        assert got["x-audited"] == "abc-1"  # sent with the stream's headers, before its body
        assert re.search(r"event: response\.(completed|incomplete)\n", text), text[-600:]  # the whole stream
        status, got, _ = _post(server.url, body, {})  # auth (before audit) refuses: still marked
        assert status == 401 and got["x-audited"] == "-"
    finally:
        server.stop()
    assert (site / "data" / "ledger.db").exists()  # relative to the config file


def _demo_lines(args: list[str], cwd: Path) -> list[str]:
    server = Server(args, cwd=cwd)
    try:
        server.wait_ready()  # start-up is over: a demo key would have been printed by now
    finally:
        out, _ = server.stop()
    return [line for line in out.splitlines() if line.startswith("demo key: ")]


def test_no_demo_key_with_a_config_file_unless_asked(tmp_path):
    path = tmp_path / "user.yaml"
    path.write_text(f"ledger: {{path: {tmp_path / 'l.db'}}}\n")
    assert _demo_lines(["--config", str(path), "serve"], tmp_path) == []
    assert len(_demo_lines(["--config", str(path), "serve", "--demo-key"], tmp_path)) == 1
    path.write_text(f"ledger: {{path: {tmp_path / 'l.db'}}}\nauth: {{demo_key: true}}\n")
    assert len(_demo_lines(["--config", str(path), "serve"], tmp_path)) == 1


def test_make_run_keeps_the_demo_key():
    run = re.search(r"^run:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "serve" in run and "--demo-key" in run
    assert Config.load(None)["auth"]["demo_key"] is True  # no file at all: the embedded defaults' demo
