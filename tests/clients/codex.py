"""Codex CLI, installed from npm into a git-ignored cache inside the repo, run non-interactively.

    binary = ensure_codex()                 # npm install @openai/codex@CODEX_VERSION once, reused
    home = write_codex_home(tmp, base_url=proxy.base_url, model="tiny-org/tiny-model")
    result = await run_codex(binary, home, workdir, "prompt", api_key=key)

The config keeps Codex from contacting anything but the proxy: a custom model provider
(wire_api = "responses"), update checks, analytics, feedback, OTEL, plugins and apps off,
and an unreachable HTTP(S) proxy for everything that is not loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tests.clients.npm import loopback_only, npm_install, run_cli

REPO = Path(__file__).resolve().parents[2]
CODEX_VERSION = os.environ.get("CODEX_VERSION", "0.171.0")
CACHE = Path(os.environ.get("CODEX_CACHE_DIR", REPO / ".cache" / "codex")) / CODEX_VERSION
KEY_ENV = "RESPONSES_PROXY_KEY"

_TRIPLES = {
    ("Linux", "x86_64"): "x86_64-unknown-linux-musl",
    ("Linux", "aarch64"): "aarch64-unknown-linux-musl",
    ("Darwin", "x86_64"): "x86_64-apple-darwin",
    ("Darwin", "arm64"): "aarch64-apple-darwin",
}


class CodexUnavailable(Exception):
    """npm could not install Codex (no npm, no network): the tests skip with this reason."""


def _find_binary(root: Path) -> Path | None:
    triple = _TRIPLES.get((platform.system(), platform.machine()))
    base = root / "node_modules" / "@openai"
    if not base.exists():
        return None
    candidates = sorted(base.glob(f"codex*/vendor/{triple}/bin/codex")) if triple else []
    candidates += sorted(base.glob("codex*/vendor/*/bin/codex"))  # any platform package npm picked
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    launcher = base / "codex" / "bin" / "codex.js"
    return launcher if launcher.exists() else None


def ensure_codex() -> list[str]:
    """The command that runs Codex (the native binary, or node + the launcher); installs once."""
    found = _find_binary(CACHE)
    if found is None:
        npm_install(CACHE, f"@openai/codex@{CODEX_VERSION}", 600, CodexUnavailable)
        found = _find_binary(CACHE)
        if found is None:
            raise CodexUnavailable(f"npm installed @openai/codex@{CODEX_VERSION} but no binary was found")
    if found.suffix == ".js":
        node = shutil.which("node")
        if node is None:
            raise CodexUnavailable("node is not installed")
        return [node, str(found)]
    return [str(found)]


def write_codex_home(root: Path, *, base_url: str, model: str, extra: str = "", provider_extra: str = "") -> Path:
    """A CODEX_HOME whose config.toml points Codex at the proxy and nowhere else (`provider_extra`:
    more lines of the provider's table, e.g. supports_websockets = true)."""
    home = root / "codex_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "responses_proxy"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
hide_agent_reasoning = false
{extra}

[model_providers.responses_proxy]
name = "responses-proxy"
base_url = "{base_url}"
env_key = "{KEY_ENV}"
wire_api = "responses"
{provider_extra}

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[features]
plugins = false
apps = false
remote_plugin = false
tool_suggest = false
memories = false
""")
    return home


@dataclass
class CodexRun:
    returncode: int
    stdout: str
    stderr: str
    events: list[dict] = field(default_factory=list)

    def items(self, kind: str) -> list[dict]:
        """The `item` of every item.completed event of that item type (command_execution...)."""
        return [e["item"] for e in self.events
                if e.get("type") == "item.completed" and isinstance(e.get("item"), dict)
                and e["item"].get("type") == kind]

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"


class EgressTrap:
    """A local HTTP(S) proxy that answers nothing and records every connection attempt: Codex is
    given it as HTTPS_PROXY / HTTP_PROXY / ALL_PROXY, so anything but loopback lands here."""

    def __init__(self) -> None:
        self.attempts: list[str] = []
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            self.attempts.append(line.decode(errors="replace").strip() or "<no request line>")
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (TimeoutError, ConnectionError):
            self.attempts.append("<connection>")
        finally:
            writer.close()

    async def __aenter__(self) -> "EgressTrap":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def run_codex(command: list[str], home: Path, workdir: Path, prompt: str, *, api_key: str,
                    timeout: float = 120, extra_args: list[str] | None = None,
                    egress_port: int = 9) -> CodexRun:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home.parent),
        "CODEX_HOME": str(home),
        KEY_ENV: api_key,
        "RUST_LOG": os.environ.get("CODEX_RUST_LOG", "warn"),
        **loopback_only(egress_port),  # anything that is not loopback goes to a dead proxy and fails at once
    }
    args = [*command, "exec", "--json", "--skip-git-repo-check", "--ephemeral",
            "--dangerously-bypass-approvals-and-sandbox", "-C", str(workdir), *(extra_args or []), prompt]
    code, stdout, stderr, timed_out = await run_cli(args, workdir, env, timeout)
    if timed_out:
        return CodexRun(code, stdout, stderr)
    events = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return CodexRun(code, stdout, stderr, events)
