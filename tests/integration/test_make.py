"""The two commands of a fresh machine (issue 27): `make run` installs with progress lines and
no warnings of our own making (the package metadata builds clean); `make test` sets up what
the suite needs (`make test-deps`, which .ci/run runs too) or stops at once naming the one
command to run, and runs `make lint` before the suite; the README's Quickstart names the
prerequisites."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.support.paths import REPO



def _recipe(target: str) -> str:
    text = (REPO / "Makefile").read_text()
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)*)", text, re.M)
    assert found, target
    return found.group(0)


# A machine's own pip configuration may name index locations that do not exist (pip warns about
# each): those lines are the machine's, not the package's.
_MACHINE_PIP = re.compile(r"^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$")


@pytest.mark.slow
def test_the_package_installs_editable_without_warnings(tmp_path):
    """What make run does, on a copy of the project: pip install -e into a fresh venv. Before:
    setuptools' `project.license` table deprecation (three times) and "Editable installation"."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("proxy", "middlewares"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    # This interpreter's pip installs into the new venv (--python): no pip download needed.
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(tmp_path / "venv" / "bin" / "python"),
                           "install", "--no-deps", "--disable-pip-version-check", "-e", str(src)],
                          capture_output=True, text=True, timeout=600)
    out = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not _MACHINE_PIP.match(line))
    assert proc.returncode == 0, out[-3000:]
    assert "warning" not in out.lower() and "deprecat" not in out.lower(), out[-3000:]
    found = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", "import proxy; print(proxy.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert found.stdout.strip() == str(src / "proxy" / "__init__.py")


def test_make_run_installs_with_progress_lines(tmp_path):
    stamp = _recipe("$(STAMP)")
    assert "scripts/pip_progress.py -e '.[test,fast]'" in stamp
    assert "pip install -q -e" not in stamp  # the long step is never silent
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "pip_progress.py"), "--dry-run", "--no-deps",
                           "--ignore-installed", "pytest"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("==> installing responses-proxy and its dependencies into .venv (the first time: ")
    assert "    [1] pytest" in lines
    assert re.fullmatch(r"==> installed in \d+ s", lines[-1]), lines


def _fake_bin(tmp_path: Path, uid: int) -> tuple[Path, Path]:
    """A PATH with none of the suite's tools: `id` says `uid`, apt-get records its arguments."""
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "apt-calls"
    (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (fake / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    for tool in (fake / "id", fake / "apt-get"):
        tool.chmod(0o755)
    return fake, calls


def _test_deps(fake: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    return subprocess.run(["/bin/bash", str(REPO / "scripts" / "test_deps.sh")], env={**env, "PATH": str(fake)},
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_make_test_without_root_stops_at_once_naming_the_command(tmp_path):
    fake, calls = _fake_bin(tmp_path, 1000)
    started = time.monotonic()
    proc = _test_deps(fake)
    assert time.monotonic() - started < 10
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "make test needs chromium postgresql redis-server npm; "
        "run: sudo apt-get install -y chromium postgresql redis-server npm"]
    assert not calls.exists()  # nothing tried


def test_make_test_as_root_installs_what_is_missing(tmp_path):
    fake, calls = _fake_bin(tmp_path, 0)
    proc = _test_deps(fake)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().splitlines() == ["install -y -q chromium postgresql redis-server npm"]
    assert proc.stdout.splitlines()[0].startswith("==> installing chromium postgresql redis-server npm")


def test_make_test_and_ci_share_the_step():
    assert re.match(r"test: test-deps \$\(STAMP\) lint\n", _recipe("test"))
    assert "bash scripts/test_deps.sh" in _recipe("test-deps")
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test-deps\n" in ci and "apt-get" not in ci
    assert ci.index("make test-deps") < ci.index("make test\n")


def _lint_copy(tmp_path: Path) -> tuple[Path, list[str]]:
    """The project as `make lint` sees it, in a copy (test_deps.sh a no-op), and the make command
    that runs it there with this interpreter's venv (its ruff and mypy) as the installed one."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("Makefile", "pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("proxy", "middlewares", "scripts"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "scripts" / "test_deps.sh").write_text("exit 0\n")
    stamp = tmp_path / "installed"  # newer than the copy's pyproject.toml: nothing to install
    stamp.touch()
    return src, ["make", "-C", str(src), f"BIN={Path(sys.executable).parent}", f"STAMP={stamp}"]


@pytest.mark.slow
def test_a_lint_or_type_error_fails_make_test(tmp_path):
    """`make test` runs `make lint` (ruff, then mypy) before the suite: the product's code is
    clean, and one ruff error or one mypy error stops `make test` before pytest starts."""
    src, make = _lint_copy(tmp_path)
    env = {**os.environ, "MYPY_CACHE_DIR": str(tmp_path / "mypy-cache")}
    order = subprocess.run([*make, "-n", "test"], capture_output=True, text=True, timeout=60, env=env).stdout
    steps = ("/ruff check proxy middlewares", "/mypy", "/python -m pytest")
    ruff, mypy, suite = (order.find(step) for step in steps)
    assert -1 < ruff < mypy < suite, order
    clean = subprocess.run([*make, "lint"], capture_output=True, text=True, timeout=600, env=env)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    module = src / "proxy" / "errors.py"
    original = module.read_text()
    for added, said in (("# " + "x" * 130 + "\n", "E501"),  # ruff alone refuses it
                        ('\n\ndef _answer() -> int:\n    return "42"\n', "[return-value]")):  # mypy alone
        module.write_text(original + added)
        proc = subprocess.run([*make, "test"], capture_output=True, text=True, timeout=600, env=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and said in out, out[-3000:]
        assert "-m pytest" not in out, out[-3000:]


def test_the_quickstart_names_the_prerequisites():
    quickstart = (REPO / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    for needed in ("make test-deps", "PostgreSQL", "redis-server", "Chromium", "npm", "sudo apt-get install -y"):
        assert needed in quickstart, needed
    assert re.search(r"\d+ MB", quickstart) and re.search(r"\d+ (s|seconds|minutes)\b", quickstart)
    assert "admin key: " in quickstart and "/admin/" in quickstart  # the console, out of the box
