# Two commands on a fresh machine: `make run` and `make test`. Each creates .venv and
# installs what it needs (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: run test test-vllm bench soak clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,fast]'
	@rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP)
	$(BIN)/responses-proxy serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-vllm: $(STAMP)
	bash scripts/vllm_tier/run.sh

# wrk is the JSON load generator; taken from Debian's packages when missing (root only).
bench: $(STAMP)
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -q wrk >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q wrk >/dev/null)); } || true
	$(BIN)/python -m bench

soak: $(STAMP)
	$(BIN)/python -m soak --minutes $${SOAK_MINUTES:-3}

clean:
	rm -rf $(VENV) data .pytest_cache
