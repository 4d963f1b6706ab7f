#!/usr/bin/env bash
# `make test-deps` (run by `make test` and by .ci/run): the servers and tools the suite starts
# on loopback, from Debian's packages when missing. Nothing is installed when all are there.
#   chromium      tests/admin/test_dashboard_browser.py (Playwright drives it; no browser download)
#   postgresql    the postgres ledger backend and the scale-out tests (initdb into a temp dir)
#   redis-server  the redis limits backend
#   npm           Codex CLI, Claude Code, the Vercel AI SDK and the Open Responses suite, installed from npm
#                 into .cache/ at test time (Debian's npm brings node)
# Without root it installs nothing: it stops at once, naming the one command to run.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
{ command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || need+=(postgresql)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
{ command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; } || need+=(npm)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "make test needs ${need[*]} (Debian's package names): install them with this system's package manager, then run make test again" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "make test needs ${need[*]}; run: sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi
echo "==> installing ${need[*]} from Debian's packages (the first time: about 133 MB to download)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
echo "==> installed ${need[*]}"
