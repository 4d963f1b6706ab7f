# Two commands on a fresh machine: `make run` and `make test`. Each creates .venv and
# installs what it needs (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# A .venv whose python is missing, broken or older than 3.11 (made by another Python) is rebuilt.
VENV_OK := $(shell $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && echo yes)
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: run test lint test-deps test-faults compliance test-vllm bench soak clean venv-rebuild

# Progress lines while it installs (scripts/pip_progress.py: one line per package), nothing silent.
$(STAMP): pyproject.toml $(if $(VENV_OK),,venv-rebuild)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "responses-proxy needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1). Use: make PYTHON=python3.11 ..." >&2; exit 1; }
	@test -x $(BIN)/python || { echo "==> creating $(VENV) with $$($(PYTHON) -V 2>&1)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> upgrading pip in $(VENV)"
	@$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	@$(BIN)/python scripts/pip_progress.py -e '.[test,fast]'
	@rm -f $(VENV)/.installed-* && touch $@

venv-rebuild:
	@if [ -e $(VENV) ]; then echo "$(VENV) is broken or not Python >= 3.11: rebuilding it" >&2; rm -rf $(VENV); fi

run: $(STAMP)
	$(BIN)/responses-proxy serve --host $(HOST) --port $(PORT) --demo-key

# What the suite starts beside .venv (PostgreSQL, redis-server, Chromium, npm): from Debian's
# packages as root, else one line naming the command to run (scripts/test_deps.sh). .ci/run runs it too.
test-deps:
	@bash scripts/test_deps.sh

test: test-deps $(STAMP) lint
	$(BIN)/python -m pytest -q

# ruff (style, imports, likely bugs) and mypy (types), as pyproject.toml configures them, over
# proxy/ and middlewares/. `make test` runs it before the suite: an error of either fails it.
lint: $(STAMP)
	$(BIN)/ruff check proxy middlewares
	$(BIN)/mypy

# Faults injected into real PostgreSQL and Redis under load, then the audit (~5 minutes).
test-faults: test-deps $(STAMP)
	$(BIN)/python -m pytest -q -m faults tests/faults

# The Open Responses compliance suite against `make run`'s setup (also in `make test`): the
# vendored copy (tests/openresponses/), or OPENRESPONSES_DIR=<a checkout of openresponses/openresponses>
# (Bun and zod from npm, into .cache/compliance).
compliance: test-deps $(STAMP)
	$(BIN)/python -m pytest -q -rs tests/clients/test_compliance.py

test-vllm: $(STAMP)
	bash scripts/vllm_tier/run.sh

# wrk is the JSON load generator, valgrind counts instructions (bench.instructions); taken from Debian's packages when missing (root only).
bench: $(STAMP)
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -q wrk >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q wrk >/dev/null)); } || true
	$(BIN)/python -m bench
	@command -v valgrind >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -q valgrind >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q valgrind >/dev/null)); } || true
	$(BIN)/python -m bench.instructions --out bench/results.md
	$(BIN)/python -m bench.ledger_backends --out bench/results.md
	$(BIN)/python -m bench.backends_p99 --out bench/results.md

soak: $(STAMP)
	$(BIN)/python -m soak --minutes $${SOAK_MINUTES:-3}

# Never deletes data/: the ledger (every key and balance) lives there.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
