"""The one schema of config.yaml: every key, its type, bounds, default and a one-line doc.

Three things come from it, so they cannot disagree:
  * `DEFAULTS` (proxy/config/load.py), the embedded configuration: every `F(...)` default;
  * the start-up check of the merged file (`validate`): an unknown key at any depth names
    its path and the nearest known key, a wrong type names its path and the expected type;
  * the commented reference (`reference()`), which is config.yaml itself
    (`responses-proxy config reference`; tests/config/test_schema.py keeps them equal).

`F(type, default, doc)` is a key with an embedded default. `Opt(type, default, doc)` is a
key shown commented out in the reference and left out of DEFAULTS; its default is in force
all the same. Adding a key is one line in its section below, then `responses-proxy config
sections > proxy/config/sections.py` writes the typed settings classes the modules read
(proxy/config/settings.py builds them; a test fails until they are regenerated), and
`responses-proxy config reference > config.yaml` the reference. The rules that span keys
are in proxy/config/cross_checks.py.

Sections of custom middlewares ("package.module:factory", named under `middlewares`) are
free-form: their factory gets them as written and checks them.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from proxy.config.types import (
    OMIT,
    REQUIRED,
    AnyValue,
    Bool,
    Either,
    F,
    Int,
    Key,
    ListOf,
    MapOf,
    Nullable,
    Num,
    Opt,
    SchemaError,
    Section,
    Str,
    Type,
    Url,
    plain_data,
    unknown_key,
)

# The one list of the pass-through extensions is the protocol's table (a module of data alone,
# importing nothing): config.yaml's allowed_extensions is checked against it.
from proxy.protocol.passthrough_fields import EXTENSION_NAMES

# ----------------------------------------------------------------------------- the schema

POS_INT = Int(lo=1)
POS_NUM = Num(gt=0)
SECONDS = Num(gt=0)

TIMEOUTS = Section({
    "connect": F(SECONDS, 5.0, "TCP connect; past it the next eligible worker is tried (504 if none is left)"),
    "first_byte": F(SECONDS, 120.0, "request sent -> first upstream chunk; past it the client gets 504"),
    "idle": F(SECONDS, 120.0, "between two upstream chunks; past it, response.failed"),
    "total": F(SECONDS, 1800.0, "the whole upstream exchange"),
})

WORKER = Section({
    "name": F(Str(nonempty=True), REQUIRED, "unique; shown in logs and metrics"),
    "url": F(Url(also=("embedded",)), REQUIRED, "http(s)://host:port of a vLLM / SGLang server, or embedded (the simulator)"),
    "dialect": F(Str(choices=("vllm", "sglang", "detect")), "vllm",
                 "detect: from /v1/models owned_by at start-up"),
    "models": F(Nullable(ListOf(Str(nonempty=True))), None, "null: discovered from its /v1/models"),
    "api_key": F(Nullable(Str()), None, "the worker's own key (e.g. ${GPU_A_KEY}); printable ASCII only "
                  "(a CR/LF stops start-up); the client's never travels upstream"),
    "labels": F(MapOf(AnyValue()), {}, "matched by provider.labels, e.g. {region: eu, zdr: true, price_prompt: 0.2}"),
    "capacity": F(POS_INT, 256, "concurrent requests; over it -> next worker, or 429"),
    "thinking_switch": F(Str(choices=("enable_thinking", "thinking", "none")), "enable_thinking",
                         "the chat-template kwarg of reasoning.effort: Qwen3/GLM enable_thinking, DeepSeek V3.1 thinking"),
    "timeouts": F(TIMEOUTS, None, "seconds"),
})

ADMIN_KEY = Section({
    "name": F(Str(nonempty=True), REQUIRED, "unique; the audit log names it (admin:<name>)"),
    "sha256": Opt(Str(), OMIT, "hex sha256 of the admin key (one of sha256 or key)"),
    "key": Opt(Str(), OMIT, "the admin key itself, e.g. ${ADMIN_KEY}"),
})

STATIC_KEY = Section({
    "name": F(Str(nonempty=True), REQUIRED, "unique"),
    "sha256": Opt(Str(), OMIT, "hex sha256 of the key (one of sha256 or key)"),
    "key": Opt(Str(), OMIT, "the key itself, e.g. ${OPS_KEY}"),
    "allowed_models": Opt(ListOf(Str(nonempty=True)), OMIT, "default: every model"),
    "concurrency": Opt(POS_INT, OMIT, "requests in flight (per process unless limits.backend is redis)"),
    "rate_per_min": Opt(POS_INT, OMIT, "requests per minute (per process unless limits.backend is redis)"),
})

SAMPLING = Section({
    "temperature": Opt(Num(0, 2), OMIT),
    "top_p": Opt(Num(0, 1), OMIT),
    "presence_penalty": Opt(Num(-2, 2), OMIT),
    "frequency_penalty": Opt(Num(-2, 2), OMIT),
})

PRICE = Section({
    "input": F(Num(lo=0), REQUIRED, "uncached input tokens"),
    "cached_input": Opt(Num(lo=0), OMIT, "cached input tokens (default: input)"),
    "output": F(Num(lo=0), REQUIRED, "output tokens, reasoning included"),
})

class CustomEntry(Type):
    """"package.module:factory", or {"package.module:factory": section}."""

    plural = "\"package.module:factory\" names or one-key mappings {name: section}"

    def what(self) -> str:
        return "a \"package.module:factory\" name or a one-key mapping {name: section}"

    def check(self, value: Any, path: str) -> Any:
        name = value if isinstance(value, str) else (
            next(iter(value)) if isinstance(value, dict) and len(value) == 1 else None)
        if not isinstance(name, str) or not name:
            raise self.fail(value, path)
        if ":" not in name:
            raise SchemaError(f"{path}: {name[:64]!r} is not \"package.module:factory\" (built-in policies are "
                              f"switched by their section's `enabled`: {', '.join(POLICIES)})")
        return str(value) if isinstance(value, str) else dict(value)


CUSTOM_ENTRY = CustomEntry()

# The built-in policies (middlewares/<name>.py), each switched by its section's `enabled`.
POLICIES = ("stateless", "auth", "limits", "tools", "balance", "notices")
# Where custom middlewares go, and what each point promises them (middlewares/__init__.py).
POINTS = {
    "after_auth": "the key is known (context .key), the body not read yet (every keyed route)",
    "after_prepare": "body read and translated once (context .body, .translation), nothing held yet (routes that "
                     "translate)",
    "before_handler": "the balance is held (context .hold) and the output cap final (context .to_answer()); the "
                      "handler is next (billed routes)",
}
ENABLED_DOC = "false: this policy does not run"

SCHEMA = Section({
    "server": F(Section({
        "host": F(Str(nonempty=True), "127.0.0.1", "also: serve --host, RESPONSES_PROXY_HOST"),
        "port": F(Int(1, 65535), 8080, "also: serve --port, RESPONSES_PROXY_PORT"),
        "workers": F(Either((Int(lo=0), Str(choices=("auto",)))), 1,
                     "processes sharing the port (SO_REUSEPORT); auto (or 0) = one per core (also: serve --workers N)"),
        "log_format": F(Str(choices=("json", "console", "auto")), "auto", "auto: console on a terminal, JSON otherwise"),
        "log_level": F(Str(choices=("debug", "info", "warning", "error", "critical")), "info"),
        "max_body_bytes": F(POS_INT, 8 * 1024 * 1024, "413 above this (gzip/deflate/zstd decoding stops here too)"),
        "max_json_depth": F(POS_INT, 64, "400 above this nesting depth"),
        "max_input_items": F(POS_INT, 4096, "400 above this many input items"),
        "max_tools": F(POS_INT, 512, "400 above this many tools"),
        "max_unbilled_body_bytes": F(POS_INT, 1024 * 1024, "413 above this for work nobody pays for: input_tokens "
                                                           "counts and WebSocket warm-ups"),
        "body_read_timeout": F(SECONDS, 30.0, "seconds; a client that trickles its body gets 408"),
        "max_line_size": Opt(POS_INT, 8190, "bytes of the request line; 400 above"),
        "max_field_size": Opt(POS_INT, 8190, "bytes of one header line; 400 above"),
        "max_headers": Opt(POS_INT, 128, "header lines of one request; 400 above"),
        "max_header_bytes": F(POS_INT, 32 * 1024,
                              "request line + headers of one request, in bytes; 431, close"),
        "header_read_timeout_s": F(SECONDS, 10.0, "for a request's line + headers (from the connection's "
                                   "start, then its first byte); 408, close"),
    }), None),
    "simulator": F(Section({
        "host": F(Str(nonempty=True), "127.0.0.1"),
        "port": F(Int(0, 65535), 0, "0: any free port"),
        "dialect": F(Str(choices=("vllm", "sglang")), "vllm"),
        "model": F(Str(nonempty=True), "tiny-org/tiny-model", "served when no embedded worker lists models"),
        "max_model_len": F(POS_INT, 32768),
    }), None, "the embedded upstream for workers whose url is embedded (also: python -m proxy.simulator.server)"),
    "workers": F(ListOf(WORKER, min_len=1), [{
        "name": "local", "url": "embedded", "dialect": "vllm", "models": ["tiny-org/tiny-model"], "api_key": None,
        "labels": {}, "capacity": 256, "timeouts": {"connect": 5.0, "first_byte": 120.0, "idle": 120.0, "total": 1800.0},
    }], note="""\
The model servers. url "embedded" is the built-in simulator, so this file answers out
of the box. To put a real vLLM or SGLang behind the proxy, replace the entry, e.g.:
  - name: gpu-a
    url: http://10.0.0.5:8000        # vLLM: `vllm serve Qwen/Qwen3-8B --enable-auto-tool-choice
    dialect: vllm                    #        --tool-call-parser hermes --reasoning-parser qwen3`
    models: [Qwen/Qwen3-8B]
    api_key: ${GPU_A_KEY}            # an unset variable stops start-up, naming it
  - name: gpu-b
    url: http://10.0.0.6:30000       # SGLang: `python -m sglang.launch_server ...`
    dialect: detect                  # no `models`: discovered from its /v1/models
    labels: {quantization: fp8, region: eu, zdr: true, data_collection: deny,
             supports: [tools, json_schema], price_prompt: 0.2, price_completion: 0.6}
Requests pick among them with the `provider` object (README, "Provider requirements")."""),
    "health": F(Section({
        "enabled": F(Bool(), True, "active checks (vLLM GET /health, SGLang GET /v1/models); "
                                    "no traffic to a worker before one passes"),
        "interval_s": F(SECONDS, 5.0),
        "timeout_s": F(SECONDS, 2.0),
        "unhealthy_threshold": F(POS_INT, 2, "failed checks in a row -> unhealthy"),
        "healthy_threshold": F(POS_INT, 1, "passed checks in a row -> healthy again"),
        "vllm_path": F(Str(nonempty=True), "/health"),
        "sglang_path": F(Str(nonempty=True), "/v1/models", "SGLang's own /health is never used"),
        "outlier": F(Section({
            "consecutive_failures": F(POS_INT, 5),
            "base_ejection_s": F(Num(lo=0), 30.0, "doubled on each repeated ejection, up to max_ejection_s"),
            "max_ejection_s": F(Num(lo=0), 300.0, "re-admitted by the first passing check after that"),
            "max_ejection_percent": Opt(Int(0, 100), 50, "share of a model's workers ejected at once (below 100: never its last)"),
        }), None, "passive ejection (Envoy-style): N connection failures / 5xx in a row"),
    }), None),
    "routing": F(Section({
        "max_attempts": F(POS_INT, 3, "workers tried when one fails before the first byte"),
        "context_check": F(Bool(), True, "400 context_length_exceeded before forwarding"),
        "bytes_per_token_floor": F(Num(lo=0), 16, "\"clearly over\" estimate: prompt bytes / this (0: never)"),
        "affinity": F(Section({
            "enabled": F(Bool(), True, "false: least loaded"),
            "epsilon": F(Num(gt=0, hi=100), 0.25, "a worker takes at most ceil((1 + epsilon) * average in-flight)"),
            "vnodes": F(Int(1, 4096), 160, "points per worker on the consistent-hash ring"),
            "hash_messages": F(Bool(), True, "key on system + first user message without prompt_cache_key"),
        }), None, "prompt-cache affinity (README, \"Prompt-cache affinity\")"),
    }), None),
    "metrics": F(Section({
        "enabled": F(Bool(), True),
        "path": F(Str(nonempty=True), "/metrics", "Prometheus text, unauthenticated: keep it off the public edge"),
        "key_ids": F(ListOf(Str(nonempty=True)), [], "per-key spend and balance for these keys (opt-in)"),
        "top_keys": F(Int(0, 1000), 0, "and for the N keys with the most spend this month (0: none)"),
        "key_refresh_s": Opt(SECONDS, 15, "the per-key figures are read from the ledger this often"),
    }), None),
    "responses": F(Section({
        "ai_markers": F(Bool(), True, "ai_generated / ai_notice on every Response"),
        "ai_notice": F(Str(), "[AI-generated content]"),
        "reasoning_items": F(Bool(), True, "false: leave reasoning items out of output"),
        "reasoning_in_clear": F(Bool(), True, "false: when sealing (reasoning_seal), send only the ciphertext"),
        "default_max_output_tokens": F(Nullable(POS_INT), None, "not read (balance.default_max_output_tokens caps holds)"),
        "sampling_defaults": Opt(MapOf(SAMPLING), OMIT,
                                 "served model -> the sampling values its server applies when a request "
                                 "leaves them out (its generation_config.json); echoed only",
                                 note="e.g. sampling_defaults: {Qwen/Qwen3-8B: {temperature: 0.6, top_p: 0.95}}"),
    }), None),
    "middlewares": F(Section({
        point: F(ListOf(CUSTOM_ENTRY), [], doc) for point, doc in POINTS.items()
    }), None, note="""\
The request runs through fixed phases: envelope -> auth -> limits -> prepare (read the body,
stateless checks, tool policy, translate) -> balance -> handler. Each built-in policy below is
switched by its section's `enabled`; the order is not configurable. Your own middlewares go at
these named points: "package.module:factory", configured by a top-level section of the same
name (or written {"package.module:factory": {...}} in the list); README, "Your own middleware"."""),
    "endpoints": F(Section({
        "chat_completions": F(Bool(), True, "POST /v1/chat/completions, the body passed through"),
        "completions": F(Bool(), True, "POST /v1/completions, the body passed through"),
        "embeddings": F(Bool(), True, "POST /v1/embeddings, the body passed through"),
        "messages": F(Bool(), True, "POST /v1/messages (+ /count_tokens): Anthropic's API, passed through"),
        "max_choices": F(POS_INT, 16, "n, best_of or a beam's width of one request; above it, a 400"),
        "max_batch_inputs": F(POS_INT, 256, "prompts of one completion, inputs of one embedding request; above, a 400"),
        "max_top_logprobs": F(Int(0, 1000), 20, "top_logprobs (chat) and logprobs (completions) at most this"),
        "allowed_extensions": F(ListOf(Str(choices=EXTENSION_NAMES)), [],
                                "server extensions no hold bounds, accepted anyway (else a 400 naming the field)"),
    }), None, note="""\
The model server's other APIs, each through the same keys, limits and ledger as /v1/responses
(README, "Other endpoints"). false: that path answers 404 endpoint_disabled. Each body is
rebuilt from the fields the server reads (proxy/protocol/passthrough_fields.py): n, best_of and
batches are multiplied into the hold; unknown fields are not forwarded, and named in x-token-notice."""),
    "websocket": F(Section({
        "enabled": F(Bool(), True, "GET /v1/responses with an upgrade: the Responses WebSocket transport"),
        "max_connection_minutes": F(POS_NUM, 60, "then websocket_connection_limit_reached and the socket closes"),
        "idle_timeout_s": F(SECONDS, 600, "a socket with no turn in flight and no message this long is closed"),
        "ping_interval_s": F(Nullable(SECONDS), 30, "pings this often; a peer that misses a pong is closed; null: none"),
        "max_queued_turns": F(POS_INT, 4, "response.create messages waiting behind the one in flight; past it, "
                                          "websocket_queue_full and the socket closes"),
        "max_queued_bytes": F(POS_INT, 8 * 1024 * 1024, "bytes of those messages (as inflated); past it, the same"),
        "max_message_bytes": Opt(POS_INT, 8 * 1024 * 1024, "one message, bounded while permessage-deflate inflates it "
                                                           "(default: server.max_body_bytes)",
                                 default_from="server.max_body_bytes"),
        "max_sockets_per_key": F(Nullable(POS_INT), 16, "open sockets of one key in this process; past it the "
                                                        "handshake gets 429 too_many_connections"),
        "max_sockets": F(Nullable(POS_INT), 1024, "open sockets in all in this process; past it, the same"),
        "max_control_frames_per_s": F(POS_NUM, 10, "pings and pongs a peer may send (twice this as a burst); a flood "
                                                   "past it closes the socket"),
        "permessage_deflate": F(Bool(), True, "accept compressed messages (RFC 7692); their inflated size is what "
                                              "every bound counts"),
        "max_refused_turns": F(POS_INT, 3, "turns in a row refused for rate or balance (429, 402); then the socket "
                                           "closes (1008), and the key's sockets are not compressed for refused_for_s"),
        "refused_for_s": F(SECONDS, 60, "how long a key refused so gets no permessage-deflate on a new socket"),
        "refuse_sockets_s": F(SECONDS, 5, "and how long its new sockets' handshakes get that refusal (402, 429) "
                                          "instead, as a plain HTTP answer: a reconnect flood costs what HTTP's does"),
    }), None, note="""\
Continuation (previous_response_id) over a socket keeps the last response's context in the
connection's memory only; every turn runs through the same pipeline as POST /v1/responses."""),
    "compact": F(Section({
        "keep_recent_items": F(POS_INT, 8, "the latest user messages kept as they are, at most this many, before the summary of the whole window"),
        "max_summary_tokens": F(POS_INT, 2048, "output cap of the summary the model writes"),
        "instructions": F(Str(nonempty=True), "Summarize the conversation above for a model that will continue it: "
                          "the goal, decisions, facts learned, files and commands involved, what is done and what "
                          "is left. Be complete and concise; write only the summary.", "the summary's instructions"),
    }), None, note="""\
POST /v1/responses/compact and a compaction_trigger input item: a summary of the window the model
writes (thinking off, its cap fitted to the model's window), sealed with reasoning_seal (a
compaction item), opened when the window comes back in a later request."""),
    "stateless": F(Section({
        "enabled": F(Bool(), True, ENABLED_DOC),
        "previous_response_id": F(Str(choices=("refuse", "ignore")), "refuse", "refuse (004 doc) | ignore (000 doc)"),
    }), None),
    "auth": F(Section({
        "enabled": F(Bool(), True, ENABLED_DOC),
        "demo_key": F(Bool(), False, "true: create a demo key at start and print it (true without a config file; make run passes --demo-key)"),
        "static_keys": F(ListOf(STATIC_KEY), [], "keys without a database"),
        "key_cache_ttl_s": Opt(Num(0, 3600), 5, "revocation takes effect within this; 0: no cache"),
        "key_cache_size": Opt(Int(lo=0), 10000, "cached keys per process (LRU)"),
    }), None),
    "limits": F(Section({
        "enabled": F(Bool(), True, ENABLED_DOC),
        "backend": F(Str(choices=("memory", "redis")), "memory",
                     "memory: counted per process (serve --workers N divides the global limits by N); "
                     "redis: one count shared by every process and replica"),
        "global_concurrency": F(Nullable(POS_INT), 1024, "requests in flight over all keys; null: no limit"),
        "default_key_concurrency": F(Nullable(POS_INT), 64, "per key, unless its own limit is set"),
        "retry_after_s": F(Num(lo=0), 1, "Retry-After of a 429"),
        "redis": F(Section({
            "url": F(Str(nonempty=True), "redis://127.0.0.1:6379/0", "e.g. ${REDIS_URL}; rediss:// for TLS"),
            "key_prefix": F(Str(nonempty=True), "responses-proxy:limits:", "every key the limits write starts with it"),
            "slot_ttl_s": F(Num(lo=0.5, hi=3600), 30, "a replica renews its slots every third of this; "
                            "a dead replica's slots free up after it"),
            "socket_timeout_ms": F(Int(1, 60000), 250, "connect and reply budget of each Redis call"),
            "on_error": F(Str(choices=("open", "closed")), "open", "Redis unreachable: open admits (counted per "
                          "process meanwhile); closed answers 503 limits_unavailable"),
            "retry_after_s": F(Num(lo=0), 1, "Retry-After of that 503"),
        }), None, "backend: redis only"),
    }), None),
    "tools": F(Section({
        "enabled": F(Bool(), True, ENABLED_DOC),
        "drop": F(Nullable(ListOf(Str(nonempty=True))), None, "hosted tool types left out, named in x-token-notice; null: built-in list"),
        "refuse": F(Nullable(ListOf(Str(nonempty=True))), None, "tool types refused with 400; null: built-in list"),
    }), None),
    "balance": F(Section({
        "enabled": F(Bool(), True, ENABLED_DOC),
        "hold_ttl_s": F(SECONDS, 900, "a hold whose request never settles is released after this"),
        "demo_balance_micros": F(Int(lo=0), 100_000_000, "the demo key's balance"),
        "default_max_output_tokens": Opt(POS_INT, 32768, "output cap reserved when nothing else says one"),
        "bytes_per_token": Opt(Num(gt=0, hi=1), 1, "input hold: prompt bytes / this + template; <= 1 (an upper bound)"),
        "lease_max_micros": Opt(Int(lo=0), 10_000_000, "largest lease per key and process (0: no leases)",
                                note="Leases (README \"Keys and balances\"): a busy key's holds come from a reservation in memory."),
        "lease_min_rate": Opt(POS_INT, 4, "requests/s of a key in one process before a lease"),
        "lease_seconds": Opt(POS_NUM, 2, "a lease covers ~this long of the key's spend"),
        "lease_idle_s": Opt(POS_NUM, 2, "an unused lease is given back after this"),
        "lease_ttl_s": Opt(POS_NUM, 30, "a lease row expires this long after its last renewal"),
        "lease_commit_ms": Opt(POS_NUM, 20, "leased usage rows are committed this far apart"),
        "lease_commit_rows": Opt(Int(1, 10_000), 64, "or as soon as this many wait, whichever comes first"),
        "lease_journal": F(Str(choices=("fsync", "write", "off")), "fsync",
                           "a leased row on disk before its answer ends: fsync'd (group-committed), write(2) "
                           "only (survives a crash of the proxy, not of the machine), or off"),
    }), None),
    "notices": F(Section({
        "enabled": F(Bool(), True, ENABLED_DOC),
        "header": F(Str(nonempty=True), "x-token-notice"),
        "max_bytes": Opt(Int(64, 16384), 2048),
    }), None),
    "ledger": F(Section({
        "backend": F(Str(choices=("sqlite", "postgres", "none")), "sqlite",
                     "postgres: shared by every replica (README \"PostgreSQL ledger\"); none: no keys, no balances"),
        "path": F(Str(nonempty=True), "data/ledger.db", "sqlite: the database file, relative to this file"),
        "dsn": Opt(Nullable(Str()), None, "postgres: e.g. ${LEDGER_DSN} (postgresql://user:pass@host:5432/db)"),
        "pool_min": Opt(Int(lo=0), 1, "postgres: connections kept open per process"),
        "pool_max": Opt(POS_INT, 10, "postgres: at most this many connections per process"),
        "statement_timeout_ms": Opt(POS_INT, 5000, "postgres: statement_timeout of every connection"),
        "connect_timeout_s": Opt(SECONDS, 5, "postgres: connecting (and waiting for a pooled connection)"),
        "spool_path": Opt(Str(nonempty=True), "data/ledger-spool.jsonl",
                          "postgres: each settlement is written here first (fsync'd) and applied a moment later"),
        "unavailable_retry_after_s": Opt(POS_INT, 5, "postgres: Retry-After of the 503 while it is unreachable"),
        "synchronous": Opt(Str(nonempty=True), "FULL", "settles, top-ups, revokes: fsync'd at every (group) commit"),
        "hold_synchronous": Opt(Str(nonempty=True), "NORMAL", "holds: no fsync (proxy/ledger/sqlite/ledger.py says why)"),
        "busy_timeout_ms": Opt(POS_INT, 5000),
        "max_batch": Opt(POS_INT, 1024, "operations per group commit"),
        "settle_linger_ms": Opt(Num(lo=0), 5, "a settle waits up to this long to share its commit"),
        "expire_interval_s": Opt(SECONDS, 30, "expired holds are swept this often"),
    }), None),
    "admin": F(Section({
        "keys": F(ListOf(ADMIN_KEY), [], "admin keys (never client keys); none: no admin API, no dashboard"),
        "prefix": F(Str(nonempty=True), "/admin", "the admin API, its OpenAPI and the dashboard live under it"),
        "session_ttl_s": F(Int(60, 604800), 28800, "a dashboard login lasts this long"),
        "session_secret": Opt(Nullable(Str()), None, "signs dashboard sessions, e.g. ${ADMIN_SESSION_SECRET}; "
                              "unset: made at first start beside a SQLite ledger (admin-session.key), "
                              "shared by every process; a PostgreSQL ledger: random per process"),
        "cookie_secure": Opt(Bool(), False, "true: the session cookie is sent over HTTPS only (behind TLS)"),
        "login_failures_per_min": F(POS_INT, 10, "failed admin keys (login, Bearer) per client address; "
                                    "past it 429, even for the right key"),
        "login_failure_burst": F(POS_INT, 10, "failed admin keys an address may make at once"),
    }), None, note="""\
The operator's console (README "Operator's console"): /admin/api/... (keys, usage,
audit), /admin/openapi.json, and the dashboard at /admin/. Admin keys are separate from
client keys: a client key gets 403 there, no key 401."""),
    "prices": F(MapOf(PRICE), {"default": {"input": 500_000, "cached_input": 100_000, "output": 1_500_000}},
                note="""\
Per million tokens, in integer micro-units of the account currency (1 unit = 1,000,000),
by model name ("default": any other), e.g. tiny-org/tiny-model: {input: 100000, output: 300000}."""),
    "images": F(Section({
        "allow_hosts": F(ListOf(Str(nonempty=True)), [], "non-empty: only these hosts (exact, or *.example.com)"),
        "allow_private": F(Bool(), False, "true: skip the address check (a lab behind a firewall)"),
        "resolve_timeout_s": F(SECONDS, 2.0, "DNS budget per request; past it the URL is refused"),
    }), None, note="""\
input_image URLs are fetched by the model server, so by default the proxy refuses any
whose host resolves to loopback, private, link-local or reserved addresses, and any
scheme but http(s); data: URIs are always allowed."""),
    "reasoning_seal": F(Section({
        "keys": F(MapOf(Nullable(Str())), {}, "e.g. {k1: \"${SEAL_KEY_1}\"}"),
        "active": F(Nullable(Str()), None, "the key id that seals; null: the first"),
        "ttl_s": Opt(POS_NUM, 604800, "a ciphertext older than this (7 days) is dropped with a notice"),
    }), None, note="""\
Sealed reasoning across turns (include: ["reasoning.encrypted_content"]). Keys are base64
of 32 random bytes: python -c "import os,base64;print(base64.urlsafe_b64encode(os.urandom(32)).decode())"
Without a key here (or in RESPONSES_PROXY_SEAL_KEY), serve makes one at its first start beside
a SQLite ledger (seal.key, key id "local", mode 0600, reused). With a PostgreSQL ledger it makes
no key, and then the reasoning text travels in the item instead (x-token-notice says that
encrypted_content is ignored) and /v1/responses/compact answers 501. A ciphertext opens only
for the API key it was made for."""),
})

def defaults() -> dict[str, Any]:
    return copy.deepcopy(SCHEMA.defaults())


def _custom_names(middlewares: Any) -> set[str]:
    """The custom middlewares named at the points (their top-level sections are free-form)."""
    names = set()
    for entries in (middlewares or {}).values() if isinstance(middlewares, dict) else ():
        for entry in entries or ():
            names.add(entry if isinstance(entry, str) else next(iter(entry)))
    return names


def validate(data: dict[str, Any]) -> dict[str, Any]:
    """The merged configuration checked against SCHEMA (raises SchemaError)."""
    if not isinstance(data, dict):
        raise SchemaError("the top level must be a mapping")
    if "pipeline" in data:
        raise SchemaError("pipeline is no longer a setting: the phases' order is fixed; switch a built-in policy "
                          "with its section's `enabled` and put your own middlewares under `middlewares` "
                          "(after_auth, after_prepare, before_handler)")
    out: dict[str, Any] = {}
    if "middlewares" in data:
        out["middlewares"] = SCHEMA.keys["middlewares"].type.check(data["middlewares"], "middlewares")
    custom = _custom_names(out.get("middlewares"))
    for name, value in data.items():
        if name == "middlewares":
            continue
        if name in SCHEMA.keys:
            out[name] = SCHEMA.keys[name].type.check(value, name)
        elif name in custom:
            out[name] = plain_data(value)  # its factory checks it
        else:
            raise SchemaError(unknown_key(name, name, SCHEMA.keys))
    return out


# ----------------------------------------------------------------------------- the reference

HEADER = """\
responses-proxy configuration, with every key at its default. Generated from the schema
(proxy/config/schema.py) by `responses-proxy config reference`; a test keeps the two equal.
Every key is optional: what is left out takes its default. A key this file does not know
stops start-up, naming it. A value written "${NAME}" is read from the environment (an
unset NAME stops start-up), so secrets stay out of this file. Commented keys show the
default the code uses when they are left out."""

_COMMENT_COL = 28


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text[:-4].rstrip() if text.endswith("\n...") else text.removesuffix("...").strip()


def _line(indent: str, text: str, doc: str, commented: bool = False) -> list[str]:
    body = f"{indent}{'# ' if commented else ''}{text}"
    if not doc:
        return [body]
    return [f"{body.ljust(_COMMENT_COL - 1)} # {doc}" if len(body) < _COMMENT_COL - 1 else f"{body}  # {doc}"]


def _notes(indent: str, note: str) -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in note.splitlines()] if note else []


def _section_lines(section: Section, indent: str, commented: bool = False) -> list[str]:
    lines: list[str] = []
    for name, key in section.keys.items():
        off = commented or not key.embedded
        lines += _notes(indent, key.note)
        lines += _key_lines(name, key, indent, off)
    return lines


def _key_lines(name: str, key: Key, indent: str, commented: bool) -> list[str]:
    t = key.type
    if isinstance(t, Section) and key.default is None:
        return _line(indent, f"{name}:", key.doc, commented) + _section_lines(t, indent + "  ", commented)
    if isinstance(t, ListOf) and isinstance(t.item, Section):
        if key.default:
            lines = _line(indent, f"{name}:", key.doc, commented)
            for entry in key.default:
                lines += _item_lines(t.item, entry, indent + "  ", commented)
            return lines
        # An empty list: its entries' keys shown as a commented example.
        lines = _line(indent, f"{name}: {_flow(key.default)}", key.doc, commented)
        return lines + _item_lines(t.item, {}, indent + "  ", True)
    if isinstance(t, MapOf) and isinstance(key.default, dict) and key.default:
        lines = _line(indent, f"{name}:", key.doc, commented)
        for k, v in key.default.items():
            lines += _line(indent + "  ", f"{k}: {_flow(v)}", "", commented)
        return lines
    if key.default is REQUIRED:
        return _line(indent, f"{name}: ...", f"required; {key.doc}" if key.doc else "required", commented)
    if key.default is OMIT:
        return _line(indent, f"{name}:", key.doc, True)
    return _line(indent, f"{name}: {_flow(key.default)}", key.doc, commented)


def _item_lines(item: Section, entry: dict[str, Any], indent: str, commented: bool) -> list[str]:
    lines: list[str] = []
    first = True
    for name, key in item.keys.items():
        prefix = "- " if first else "  "
        first = False
        if name in entry:
            value = entry[name]
            lines += _line(indent, prefix + f"{name}: {_flow(value)}", key.doc, commented)
        else:
            shown = "..." if key.default in (REQUIRED, OMIT) else _flow(key.default)
            lines += _line(indent, prefix + f"{name}: {shown}", key.doc, True)
    return lines


def reference() -> str:
    lines = _notes("", HEADER)
    for name, key in SCHEMA.keys.items():
        lines.append("")
        lines += _notes("", key.note)
        lines += _key_lines(name, key, "", not key.embedded)
    return "\n".join(lines) + "\n"
