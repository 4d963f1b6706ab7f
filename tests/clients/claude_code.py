"""Claude Code (npm `@anthropic-ai/claude-code`), installed into the git-ignored cache the Codex
tier uses (.cache/claude-code/<version>), run headless (`claude -p`) against the proxy.

    command = ensure_claude_code()            # npm install once, reused
    result = await run_claude(command, home, workdir, "prompt", base_url=proxy.url, api_key=key,
                              model="tiny-org/tiny-model", egress_port=trap.port)

The npm package is a launcher whose postinstall copies a native binary out of a platform package
(an optional dependency); npm 11 does not run unapproved install scripts, so the platform
package's binary is run directly. Only the proxy is reachable: ANTHROPIC_BASE_URL is the proxy,
the key comes from the environment (ANTHROPIC_API_KEY -> x-api-key, or ANTHROPIC_AUTH_TOKEN ->
Authorization: Bearer), every model Claude Code may ask for (its main model, and the small fast
one of background tasks) is the served model, the non-essential traffic (telemetry, error
reports, update checks) is off, and everything that is not loopback goes to a dead proxy
(tests.clients.codex.EgressTrap records any attempt).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from tests.clients.npm import loopback_only, npm_install, run_cli

REPO = Path(__file__).resolve().parents[2]
CLAUDE_CODE_VERSION = os.environ.get("CLAUDE_CODE_VERSION", "2.1.332")
CACHE = Path(os.environ.get("CLAUDE_CODE_CACHE_DIR", REPO / ".cache" / "claude-code")) / CLAUDE_CODE_VERSION
PACKAGE = "@anthropic-ai/claude-code"

_PLATFORMS = {("Linux", "x86_64"): "linux-x64", ("Linux", "aarch64"): "linux-arm64",
              ("Darwin", "x86_64"): "darwin-x64", ("Darwin", "arm64"): "darwin-arm64"}


class ClaudeCodeUnavailable(Exception):
    """npm could not install Claude Code (no npm, no registry): the tests skip with this reason."""


def _find_binary(root: Path) -> Path | None:
    base = root / "node_modules" / "@anthropic-ai"
    if not base.exists():
        return None
    plat = _PLATFORMS.get((platform.system(), platform.machine()))
    candidates = [base / f"claude-code-{plat}" / "claude", base / f"claude-code-{plat}-musl" / "claude"] if plat else []
    candidates += sorted(base.glob("claude-code-*/claude"))
    # after a postinstall that ran, the launcher's placeholder is the native binary itself
    launcher = base / "claude-code" / "bin" / "claude.exe"
    if launcher.is_file() and launcher.stat().st_size > 1_000_000:
        candidates.append(launcher)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def ensure_claude_code() -> list[str]:
    """The command that runs Claude Code; installs it once into CACHE."""
    found = _find_binary(CACHE)
    if found is None:
        npm_install(CACHE, f"{PACKAGE}@{CLAUDE_CODE_VERSION}", 900, ClaudeCodeUnavailable)
        found = _find_binary(CACHE)
        if found is None:
            raise ClaudeCodeUnavailable(f"npm installed {PACKAGE}@{CLAUDE_CODE_VERSION} but no binary for "
                                        f"{platform.system()} {platform.machine()} was found")
    return [str(found)]


@dataclass
class ClaudeRun:
    returncode: int
    stdout: str
    stderr: str
    result: dict | None  # the --output-format json result object

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"


async def run_claude(command: list[str], home: Path, workdir: Path, prompt: str, *, base_url: str, api_key: str,
                     model: str, egress_port: int, bearer: bool = False, tools: str = "Bash,Read,Write",
                     timeout: float = 180) -> ClaudeRun:
    """`claude -p prompt --output-format json` in `workdir`, with a HOME of its own; `bearer`: the key as
    ANTHROPIC_AUTH_TOKEN (Authorization: Bearer) instead of ANTHROPIC_API_KEY (x-api-key)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN" if bearer else "ANTHROPIC_API_KEY": api_key,
        # Whatever model a request names, it is one the proxy serves.
        "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        # Nothing but the model requests: no telemetry, error reports, update checks, feedback.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        **loopback_only(egress_port),
    }
    # --allowedTools: the tools run without asking (--dangerously-skip-permissions is refused as root).
    args = [*command, "-p", prompt, "--output-format", "json", "--allowedTools", tools]
    code, stdout, stderr, timed_out = await run_cli(args, workdir, env, timeout)
    if timed_out:
        return ClaudeRun(code, stdout, stderr, None)
    result = None
    for line in reversed(stdout.strip().splitlines()):
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict) and parsed.get("type") == "result":
            result = parsed
            break
    return ClaudeRun(code, stdout, stderr, result)
