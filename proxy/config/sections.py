"""The settings of config.yaml: one frozen class per section, and these classes are the schema.

Each field is a key: its annotation is the type the code reads (`config.balance.lease_commit_ms`
is a float to a type checker), its default the embedded default, and its `Annotated` metadata
the rest (proxy/config/types.py): the bounds as a `Type` (left out where the annotation says it
all: `str`, `bool`, a section's class), the one-line doc, `COMMENTED` for a key left out of the
embedded configuration and shown commented out in the reference, `DefaultFrom` and `Note`. A
field without a default is required; a default of None on a type that does not take null means
absent is off.

proxy/config/schema.py reads these classes into the start-up check (an unknown key names its
path and the nearest known one, a wrong type its path and the expected type) and the embedded
defaults; proxy/config/reference.py writes config.yaml's comments and the README's table from
them; proxy/config/settings.py builds the instances `Config` exposes. Adding a key is one line
here (then `responses-proxy config reference > config.yaml`). The rules that span keys are in
proxy/config/cross_checks.py. Lists are tuples, numbers of a float key floats; free-form
mappings (labels, prices, keys by id) stay dicts, read-only by convention.

Sections of custom middlewares ("package.module:factory", named under `middlewares`) are
free-form: their factory gets them as written and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from proxy.config.types import (
    COMMENTED,
    DefaultFrom,
    Either,
    Int,
    ListOf,
    MapOf,
    Micros,
    Note,
    Nullable,
    Num,
    SchemaError,
    Str,
    Type,
    Url,
)
from proxy.protocol.passthrough_fields import EXTENSION_NAMES  # the one list of the pass-through extensions
from proxy.protocol.seal import DEFAULT_TTL_S

POS_INT = Int(lo=1)
POS_NUM = Num(gt=0)

# What an admin key may do (proxy.admin.auth): everything, or read only.
ADMIN_ROLES = ("admin", "viewer", "team_admin")
# The built-in policies (middlewares/<name>.py), each switched by its section's `enabled`.
POLICIES = ("stateless", "auth", "limits", "tools", "balance", "notices")
ENABLED_DOC = "false: this policy does not run"
# Where custom middlewares go, and what each point promises them (middlewares/__init__.py).
POINTS = {
    "after_auth": "the key is known (context .key), the body not read yet (every keyed route)",
    "after_prepare": "body read and translated once (context .body, .translation), nothing held yet (routes that "
                     "translate)",
    "before_handler": "the balance is held (context .hold) and the output cap final (context .to_answer()); the "
                      "handler is next (billed routes)",
}


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Server:
    """The `server` section."""

    host: Annotated[str, Str(nonempty=True), "also: serve --host, RESPONSES_PROXY_HOST"] = "127.0.0.1"
    port: Annotated[int, Int(1, 65535), "also: serve --port, RESPONSES_PROXY_PORT"] = 8080
    workers: Annotated[int | str, Either((Int(lo=0), Str(choices=("auto",)))), "processes sharing the port (SO_REUSEPORT); auto (or 0) = one per core (also: serve --workers N)"] = 1
    log_format: Annotated[str, Str(choices=("json", "console", "auto")), "auto: console on a terminal, JSON otherwise"] = "auto"
    log_level: Annotated[str, Str(choices=("debug", "info", "warning", "error", "critical"))] = "info"
    max_body_bytes: Annotated[int, POS_INT, "413 above this (gzip/deflate/zstd decoding stops here too)"] = 8 * 1024 * 1024
    max_json_depth: Annotated[int, POS_INT, "400 above this nesting depth"] = 64
    max_input_items: Annotated[int, POS_INT, "400 above this many input items"] = 4096
    max_tools: Annotated[int, POS_INT, "400 above this many tools"] = 512
    max_unbilled_body_bytes: Annotated[int, POS_INT, "413 above this for work nobody pays for: input_tokens counts and WebSocket warm-ups"] = 1024 * 1024
    body_read_timeout: Annotated[float, POS_NUM, "seconds; a client that trickles its body gets 408"] = 30.0
    max_line_size: Annotated[int, POS_INT, "bytes of the request line; 400 above", COMMENTED] = 8190
    max_field_size: Annotated[int, POS_INT, "bytes of one header line; 400 above", COMMENTED] = 8190
    max_headers: Annotated[int, POS_INT, "header lines of one request; 400 above", COMMENTED] = 128
    max_header_bytes: Annotated[int, POS_INT, "request line + headers of one request, in bytes; 431, close"] = 32 * 1024
    header_read_timeout_s: Annotated[float, POS_NUM, "for a request's line + headers (from the connection's start, then its first byte); 408, close"] = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Simulator:
    """The `simulator` section."""

    host: Annotated[str, Str(nonempty=True)] = "127.0.0.1"
    port: Annotated[int, Int(0, 65535), "0: any free port"] = 0
    dialect: Annotated[str, Str(choices=("vllm", "sglang"))] = "vllm"
    model: Annotated[str, Str(nonempty=True), "served when no embedded worker lists models"] = "tiny-org/tiny-model"
    max_model_len: Annotated[int, POS_INT] = 32768


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkersTimeouts:
    """The `workers[].timeouts` section."""

    connect: Annotated[float, POS_NUM, "TCP connect; past it the next eligible worker is tried (504 if none is left)"] = 5.0
    first_byte: Annotated[float, POS_NUM, "request sent -> first upstream chunk; past it the client gets 504"] = 120.0
    idle: Annotated[float, POS_NUM, "between two upstream chunks; past it, response.failed"] = 120.0
    total: Annotated[float, POS_NUM, "the whole upstream exchange"] = 1800.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Workers:
    """The `workers[]` section."""

    name: Annotated[str, Str(nonempty=True), "unique; shown in logs and metrics"]
    url: Annotated[str, Url(also=("embedded",)), "http(s)://host:port of a vLLM / SGLang server, or embedded (the simulator)"]
    dialect: Annotated[str, Str(choices=("vllm", "sglang", "detect")), "detect: from /v1/models owned_by at start-up"] = "vllm"
    models: Annotated[tuple[str, ...] | None, Nullable(ListOf(Str(nonempty=True))), "null: discovered from its /v1/models"] = None
    api_key: Annotated[str | None, "the worker's own key (e.g. ${GPU_A_KEY}); printable ASCII only (a CR/LF stops start-up); the client's never travels upstream"] = None
    labels: Annotated[dict[str, Any], "matched by provider.labels, e.g. {region: eu, zdr: true, price_prompt: 0.2}"] = field(default_factory=dict)
    capacity: Annotated[int, POS_INT, "concurrent requests; over it -> next worker, or 429"] = 256
    thinking_switch: Annotated[str, Str(choices=("enable_thinking", "thinking", "none")), "the chat-template kwarg of reasoning.effort: Qwen3/GLM enable_thinking, DeepSeek V3.1 thinking"] = "enable_thinking"
    timeouts: Annotated[WorkersTimeouts, "seconds"] = field(default_factory=WorkersTimeouts)


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthOutlier:
    """The `health.outlier` section."""

    consecutive_failures: Annotated[int, POS_INT] = 5
    base_ejection_s: Annotated[float, Num(lo=0), "doubled on each repeated ejection, up to max_ejection_s"] = 30.0
    max_ejection_s: Annotated[float, Num(lo=0), "re-admitted by the first passing check after that"] = 300.0
    max_ejection_percent: Annotated[int, Int(0, 100), "share of a model's workers ejected at once (below 100: never its last)", COMMENTED] = 50


@dataclass(frozen=True, slots=True, kw_only=True)
class Health:
    """The `health` section."""

    enabled: Annotated[bool, "active checks (vLLM GET /health, SGLang GET /v1/models); no traffic to a worker before one passes"] = True
    interval_s: Annotated[float, POS_NUM] = 5.0
    timeout_s: Annotated[float, POS_NUM] = 2.0
    unhealthy_threshold: Annotated[int, POS_INT, "failed checks in a row -> unhealthy"] = 2
    healthy_threshold: Annotated[int, POS_INT, "passed checks in a row -> healthy again"] = 1
    vllm_path: Annotated[str, Str(nonempty=True)] = "/health"
    sglang_path: Annotated[str, Str(nonempty=True), "SGLang's own /health is never used"] = "/v1/models"
    outlier: Annotated[HealthOutlier, "passive ejection (Envoy-style): N connection failures / 5xx in a row"] = field(default_factory=HealthOutlier)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingAffinity:
    """The `routing.affinity` section."""

    enabled: Annotated[bool, "false: least loaded"] = True
    epsilon: Annotated[float, Num(hi=100, gt=0), "a worker takes at most ceil((1 + epsilon) * average in-flight)"] = 0.25
    vnodes: Annotated[int, Int(1, 4096), "points per worker on the consistent-hash ring"] = 160
    hash_messages: Annotated[bool, "key on system + first user message without prompt_cache_key"] = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing:
    """The `routing` section."""

    max_attempts: Annotated[int, POS_INT, "workers tried when one fails before the first byte"] = 3
    context_check: Annotated[bool, "400 context_length_exceeded before forwarding"] = True
    bytes_per_token_floor: Annotated[float, Num(lo=0), '"clearly over" estimate: prompt bytes / this (0: never)'] = 16
    affinity: Annotated[RoutingAffinity, 'prompt-cache affinity (README, "Prompt-cache affinity")'] = field(default_factory=RoutingAffinity)


@dataclass(frozen=True, slots=True, kw_only=True)
class Metrics:
    """The `metrics` section."""

    enabled: bool = True
    path: Annotated[str, Str(nonempty=True), "Prometheus text, unauthenticated: keep it off the public edge"] = "/metrics"
    key_ids: Annotated[tuple[str, ...], ListOf(Str(nonempty=True)), "per-key spend and balance for these keys (opt-in)"] = ()
    top_keys: Annotated[int, Int(0, 1000), "and for the N keys with the most spend this month (0: none)"] = 0
    key_refresh_s: Annotated[float, POS_NUM, "the per-key figures are read from the ledger this often", COMMENTED] = 15


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesSamplingDefaults:
    """The `responses.sampling_defaults[]` section."""

    temperature: Annotated[float | None, Num(0, 2), COMMENTED] = None
    top_p: Annotated[float | None, Num(0, 1), COMMENTED] = None
    presence_penalty: Annotated[float | None, Num(-2, 2), COMMENTED] = None
    frequency_penalty: Annotated[float | None, Num(-2, 2), COMMENTED] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Responses:
    """The `responses` section."""

    ai_markers: Annotated[bool, "ai_generated / ai_notice on every Response"] = True
    ai_notice: str = "[AI-generated content]"
    reasoning_items: Annotated[bool, "false: leave reasoning items out of output"] = True
    reasoning_in_clear: Annotated[bool, "false: when sealing (reasoning_seal), send only the ciphertext"] = True
    default_max_output_tokens: Annotated[int | None, Nullable(POS_INT), "not read (balance.default_max_output_tokens caps holds)"] = None
    sampling_defaults: Annotated[
        dict[str, ResponsesSamplingDefaults] | None, MapOf(ResponsesSamplingDefaults), "served model -> the sampling values its server applies when a request leaves them out (its generation_config.json); echoed only", COMMENTED, Note("e.g. sampling_defaults: {Qwen/Qwen3-8B: {temperature: 0.6, top_p: 0.95}}")
    ] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Middlewares:
    """The `middlewares` section."""

    after_auth: Annotated[tuple[Any, ...], ListOf(CUSTOM_ENTRY), POINTS["after_auth"]] = ()
    after_prepare: Annotated[tuple[Any, ...], ListOf(CUSTOM_ENTRY), POINTS["after_prepare"]] = ()
    before_handler: Annotated[tuple[Any, ...], ListOf(CUSTOM_ENTRY), POINTS["before_handler"]] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoints:
    """The `endpoints` section."""

    chat_completions: Annotated[bool, "POST /v1/chat/completions, the body passed through"] = True
    completions: Annotated[bool, "POST /v1/completions, the body passed through"] = True
    embeddings: Annotated[bool, "POST /v1/embeddings, the body passed through"] = True
    messages: Annotated[bool, "POST /v1/messages (+ /count_tokens): Anthropic's API, passed through"] = True
    max_choices: Annotated[int, POS_INT, "n, best_of or a beam's width of one request; above it, a 400"] = 16
    max_batch_inputs: Annotated[int, POS_INT, "prompts of one completion, inputs of one embedding request; above, a 400"] = 256
    max_top_logprobs: Annotated[int, Int(0, 1000), "top_logprobs (chat) and logprobs (completions) at most this"] = 20
    allowed_extensions: Annotated[tuple[str, ...], ListOf(Str(choices=EXTENSION_NAMES)), "server extensions no hold bounds, accepted anyway (else a 400 naming the field)"] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Websocket:
    """The `websocket` section."""

    enabled: Annotated[bool, "GET /v1/responses with an upgrade: the Responses WebSocket transport"] = True
    max_connection_minutes: Annotated[float, POS_NUM, "then websocket_connection_limit_reached and the socket closes"] = 60
    idle_timeout_s: Annotated[float, POS_NUM, "a socket with no turn in flight and no message this long is closed"] = 600
    ping_interval_s: Annotated[float | None, Nullable(POS_NUM), "pings this often; a peer that misses a pong is closed; null: none"] = 30
    max_queued_turns: Annotated[int, POS_INT, "response.create messages waiting behind the one in flight; past it, websocket_queue_full and the socket closes"] = 4
    max_queued_bytes: Annotated[int, POS_INT, "bytes of those messages (as inflated); past it, the same"] = 8 * 1024 * 1024
    max_message_bytes: Annotated[int, POS_INT, "one message, bounded while permessage-deflate inflates it (default: server.max_body_bytes)", COMMENTED, DefaultFrom("server.max_body_bytes")] = 8 * 1024 * 1024
    max_sockets_per_key: Annotated[int | None, Nullable(POS_INT), "open sockets of one key in this process; past it the handshake gets 429 too_many_connections"] = 16
    max_sockets: Annotated[int | None, Nullable(POS_INT), "open sockets in all in this process; past it, the same"] = 1024
    max_control_frames_per_s: Annotated[float, POS_NUM, "pings and pongs a peer may send (twice this as a burst); a flood past it closes the socket"] = 10
    permessage_deflate: Annotated[bool, "accept compressed messages (RFC 7692); their inflated size is what every bound counts"] = True
    max_refused_turns: Annotated[int, POS_INT, "turns in a row refused for rate or balance (429, 402); then the socket closes (1008), and the key's sockets are not compressed for refused_for_s"] = 3
    refused_for_s: Annotated[float, POS_NUM, "how long a key refused so gets no permessage-deflate on a new socket"] = 60
    refuse_sockets_s: Annotated[float, POS_NUM, "and how long its new sockets' handshakes get that refusal (402, 429) instead, as a plain HTTP answer: a reconnect flood costs what HTTP's does"] = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Compact:
    """The `compact` section."""

    keep_recent_items: Annotated[int, POS_INT, "the latest user messages kept as they are, at most this many, before the summary of the whole window"] = 8
    max_summary_tokens: Annotated[int, POS_INT, "output cap of the summary the model writes"] = 2048
    instructions: Annotated[str, Str(nonempty=True), "the summary's instructions"] = "Summarize the conversation above for a model that will continue it: the goal, decisions, facts learned, files and commands involved, what is done and what is left. Be complete and concise; write only the summary."


@dataclass(frozen=True, slots=True, kw_only=True)
class Stateless:
    """The `stateless` section."""

    enabled: Annotated[bool, ENABLED_DOC] = True
    previous_response_id: Annotated[str, Str(choices=("refuse", "ignore")), "refuse (004 doc) | ignore (000 doc)"] = "refuse"


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthStaticKeys:
    """The `auth.static_keys[]` section."""

    name: Annotated[str, Str(nonempty=True), "unique"]
    sha256: Annotated[str | None, Str(), "hex sha256 of the key (one of sha256 or key)", COMMENTED] = None
    key: Annotated[str | None, Str(), "the key itself, e.g. ${OPS_KEY}", COMMENTED] = None
    allowed_models: Annotated[tuple[str, ...] | None, ListOf(Str(nonempty=True)), "default: every model", COMMENTED] = None
    concurrency: Annotated[int | None, POS_INT, "requests in flight (per process unless limits.backend is redis)", COMMENTED] = None
    rate_per_min: Annotated[int | None, POS_INT, "requests per minute (per process unless limits.backend is redis)", COMMENTED] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Auth:
    """The `auth` section."""

    enabled: Annotated[bool, ENABLED_DOC] = True
    demo_key: Annotated[bool, "true: create a demo key at start and print it (true without a config file; make run passes --demo-key)"] = False
    static_keys: Annotated[tuple[AuthStaticKeys, ...], "keys without a database"] = ()
    key_cache_ttl_s: Annotated[float, Num(0, 3600), "revocation takes effect within this; 0: no cache", COMMENTED] = 5
    key_cache_size: Annotated[int, Int(lo=0), "cached keys per process (LRU)", COMMENTED] = 10000


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsRedis:
    """The `limits.redis` section."""

    url: Annotated[str, Str(nonempty=True), "e.g. ${REDIS_URL}; rediss:// for TLS"] = "redis://127.0.0.1:6379/0"
    key_prefix: Annotated[str, Str(nonempty=True), "every key the limits write starts with it"] = "responses-proxy:limits:"
    slot_ttl_s: Annotated[float, Num(0.5, 3600), "a replica renews its slots every third of this; a dead replica's slots free up after it"] = 30
    socket_timeout_ms: Annotated[int, Int(1, 60000), "connect and reply budget of each Redis call"] = 250
    on_error: Annotated[str, Str(choices=("open", "closed")), "Redis unreachable: open admits (counted per process meanwhile); closed answers 503 limits_unavailable"] = "open"
    retry_after_s: Annotated[float, Num(lo=0), "Retry-After of that 503"] = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """The `limits` section."""

    enabled: Annotated[bool, ENABLED_DOC] = True
    backend: Annotated[str, Str(choices=("memory", "redis")), "memory: counted per process (serve --workers N divides the global limits by N); redis: one count shared by every process and replica"] = "memory"
    global_concurrency: Annotated[int | None, Nullable(POS_INT), "requests in flight over all keys; null: no limit"] = 1024
    default_key_concurrency: Annotated[int | None, Nullable(POS_INT), "per key, unless its own limit is set"] = 64
    retry_after_s: Annotated[float, Num(lo=0), "Retry-After of a 429"] = 1
    redis: Annotated[LimitsRedis, "backend: redis only"] = field(default_factory=LimitsRedis)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tools:
    """The `tools` section."""

    enabled: Annotated[bool, ENABLED_DOC] = True
    drop: Annotated[tuple[str, ...] | None, Nullable(ListOf(Str(nonempty=True))), "hosted tool types left out, named in x-token-notice; null: built-in list"] = None
    refuse: Annotated[tuple[str, ...] | None, Nullable(ListOf(Str(nonempty=True))), "tool types refused with 400; null: built-in list"] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Balance:
    """The `balance` section."""

    enabled: Annotated[bool, ENABLED_DOC] = True
    hold_ttl_s: Annotated[float, POS_NUM, "a hold whose request never settles is released after this"] = 900
    demo_balance_micros: Annotated[int, Int(lo=0), "the demo key's balance"] = 100_000_000
    default_max_output_tokens: Annotated[int, POS_INT, "output cap reserved when nothing else says one", COMMENTED] = 32768
    bytes_per_token: Annotated[float, Num(hi=1, gt=0), "input hold: prompt bytes / this + template; <= 1 (an upper bound)", COMMENTED] = 1
    lease_max_micros: Annotated[
        int, Int(lo=0), "largest lease per key and process (0: no leases)", COMMENTED, Note('Leases (README "Keys and balances"): a busy key\'s holds come from a reservation in memory.')
    ] = 10_000_000
    lease_min_rate: Annotated[int, POS_INT, "requests/s of a key in one process before a lease", COMMENTED] = 4
    lease_seconds: Annotated[float, POS_NUM, "a lease covers ~this long of the key's spend", COMMENTED] = 2
    lease_idle_s: Annotated[float, POS_NUM, "an unused lease is given back after this", COMMENTED] = 2
    lease_ttl_s: Annotated[float, POS_NUM, "a lease row expires this long after its last renewal", COMMENTED] = 30
    lease_commit_ms: Annotated[float, POS_NUM, "leased usage rows are committed this far apart", COMMENTED] = 20
    lease_commit_rows: Annotated[int, Int(1, 10000), "or as soon as this many wait, whichever comes first", COMMENTED] = 64
    lease_journal: Annotated[str, Str(choices=("fsync", "write", "off")), "a leased row on disk before its answer ends: fsync'd (group-committed), write(2) only (survives a crash of the proxy, not of the machine), or off"] = "fsync"


@dataclass(frozen=True, slots=True, kw_only=True)
class Notices:
    """The `notices` section."""

    enabled: Annotated[bool, ENABLED_DOC] = True
    header: Annotated[str, Str(nonempty=True)] = "x-token-notice"
    max_bytes: Annotated[int, Int(64, 16384), COMMENTED] = 2048


@dataclass(frozen=True, slots=True, kw_only=True)
class Ledger:
    """The `ledger` section."""

    backend: Annotated[str, Str(choices=("sqlite", "postgres", "none")), 'postgres: shared by every replica (README "PostgreSQL ledger"); none: no keys, no balances'] = "sqlite"
    path: Annotated[str, Str(nonempty=True), "sqlite: the database file, relative to this file"] = "data/ledger.db"
    dsn: Annotated[str | None, "postgres: e.g. ${LEDGER_DSN} (postgresql://user:pass@host:5432/db)", COMMENTED] = None
    pool_min: Annotated[int, Int(lo=0), "postgres: connections kept open per process", COMMENTED] = 1
    pool_max: Annotated[int, POS_INT, "postgres: at most this many connections per process", COMMENTED] = 10
    statement_timeout_ms: Annotated[int, POS_INT, "postgres: statement_timeout of every connection", COMMENTED] = 5000
    connect_timeout_s: Annotated[float, POS_NUM, "postgres: connecting (and waiting for a pooled connection)", COMMENTED] = 5
    spool_path: Annotated[str, Str(nonempty=True), "postgres: each settlement is written here first (fsync'd) and applied a moment later", COMMENTED] = "data/ledger-spool.jsonl"
    unavailable_retry_after_s: Annotated[int, POS_INT, "postgres: Retry-After of the 503 while it is unreachable", COMMENTED] = 5
    synchronous: Annotated[str, Str(nonempty=True), "settles, top-ups, revokes: fsync'd at every (group) commit", COMMENTED] = "FULL"
    hold_synchronous: Annotated[str, Str(nonempty=True), "holds: no fsync (proxy/ledger/sqlite/ledger.py says why)", COMMENTED] = "NORMAL"
    busy_timeout_ms: Annotated[int, POS_INT, COMMENTED] = 5000
    max_batch: Annotated[int, POS_INT, "operations per group commit", COMMENTED] = 1024
    settle_linger_ms: Annotated[float, Num(lo=0), "a settle waits up to this long to share its commit", COMMENTED] = 5
    expire_interval_s: Annotated[float, POS_NUM, "expired holds are swept this often", COMMENTED] = 30


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminKeys:
    """The `admin.keys[]` section."""

    name: Annotated[str, Str(nonempty=True), "unique; the audit log names it (admin:<name>)"]
    sha256: Annotated[str | None, Str(), "hex sha256 of the admin key (one of sha256 or key)", COMMENTED] = None
    key: Annotated[str | None, Str(), "the admin key itself, e.g. ${ADMIN_KEY}", COMMENTED] = None
    role: Annotated[str, Str(choices=ADMIN_ROLES), "admin: every admin route; viewer: reads only (a write is a 403); team_admin: the keys and users of `teams`, within the team's money"] = "admin"
    teams: Annotated[tuple[str, ...], ListOf(Str(nonempty=True)), "a team_admin's teams (team ids)", COMMENTED] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminOidc:
    """The `admin.oidc` section."""

    issuer: Annotated[str | None, Nullable(Url(example="https://login.example.com")), "the OpenID Connect provider (its /.well-known/openid-configuration); null: no single sign-on"] = None
    client_id: Annotated[str, "the console's client id at the provider"] = ""
    client_secret: Annotated[str | None, "e.g. ${OIDC_CLIENT_SECRET}; null: a public client (PKCE alone)"] = None
    redirect_url: Annotated[str | None, Nullable(Url()), "<this host>/admin/oidc/callback as the browser reaches it (behind TLS: its https:// URL); null: from the request", COMMENTED] = None
    scopes: Annotated[str, Str(nonempty=True), "asked of the provider"] = "openid email profile"
    name_claim: Annotated[str, Str(nonempty=True), "the claim that names the person (the audit log's oidc:<name>)"] = "email"
    roles_claim: Annotated[str, Str(nonempty=True), "the claim whose values (a string or a list) map to roles"] = "groups"
    roles: Annotated[dict[str, str], MapOf(Str(choices=ADMIN_ROLES)), "claim value -> role, e.g. {proxy-admins: admin, finance: viewer}; several: the widest; none: refused"] = field(default_factory=dict)
    teams_claim: Annotated[str, Str(nonempty=True), "a team_admin's teams: the claim whose values (a string or a list) are team ids", COMMENTED] = "teams"
    label: Annotated[str, Str(nonempty=True), "the login page's button"] = "Sign in with single sign-on"


@dataclass(frozen=True, slots=True, kw_only=True)
class Admin:
    """The `admin` section."""

    keys: Annotated[tuple[AdminKeys, ...], "admin keys (never client keys); none and no oidc: no admin API, no dashboard"] = ()
    oidc: Annotated[AdminOidc, "single sign-on for the dashboard (OpenID Connect, authorization code + PKCE); admin keys keep working"] = field(default_factory=AdminOidc)
    prefix: Annotated[str, Str(nonempty=True), "the admin API, its OpenAPI and the dashboard live under it"] = "/admin"
    session_ttl_s: Annotated[int, Int(60, 604800), "a dashboard login lasts this long"] = 28800
    session_secret: Annotated[str | None, "signs dashboard sessions, e.g. ${ADMIN_SESSION_SECRET}; unset: made at first start beside a SQLite ledger (admin-session.key), shared by every process; a PostgreSQL ledger: random per process", COMMENTED] = None
    cookie_secure: Annotated[bool, "true: the session cookie is sent over HTTPS only (behind TLS)", COMMENTED] = False
    login_failures_per_min: Annotated[int, POS_INT, "failed admin keys (login, Bearer) per client address; past it 429, even for the right key"] = 10
    login_failure_burst: Annotated[int, POS_INT, "failed admin keys an address may make at once"] = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertsWebhooks:
    """The `alerts.webhooks[]` section."""

    name: Annotated[str, Str(nonempty=True), "unique; the metrics and the console count by it"]
    url: Annotated[str, Url(example="https://hooks.slack.com/services/..."), "where each notice is POSTed"]
    format: Annotated[str, Str(choices=("json", "slack")), "json: the notice as an object; slack: an incoming-webhook text"] = "json"
    secret: Annotated[str | None, "signs each body (X-Responses-Proxy-Signature: sha256=HMAC of \"<timestamp>.<body>\"), e.g. ${ALERT_SECRET}; null: unsigned"] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Alerts:
    """The `alerts` section."""

    webhooks: Annotated[tuple[AlertsWebhooks, ...], "where notices go; none: no alerts (nothing looks)"] = ()
    check_interval_s: Annotated[float, POS_NUM, "how often the conditions are looked at (off the request path)"] = 15
    reminder_s: Annotated[float, POS_NUM, "a condition that lasts is told again this often"] = 3600
    budget_thresholds: Annotated[tuple[float, ...], ListOf(Num(gt=0, hi=1)), "shares of a key's daily or monthly budget spent that alert (once each per period)"] = (0.8, 1.0)
    balance_below_micros: Annotated[int | None, Nullable(Int(lo=0)), "a key's balance under this alerts; null: never"] = None
    spool_backlog_bytes: Annotated[int, POS_INT, "the settlement spool waiting past this many bytes alerts (PostgreSQL ledger)"] = 1024 * 1024
    retries: Annotated[int, Int(0, 20), "deliveries tried again after a failure (a 5xx, a 429, no answer)"] = 5
    backoff_s: Annotated[float, POS_NUM, "the first wait before a retry; doubled each time"] = 1
    max_backoff_s: Annotated[float, POS_NUM, "the longest wait between two tries"] = 60


@dataclass(frozen=True, slots=True, kw_only=True)
class Tracing:
    """The `tracing` section."""

    endpoint: Annotated[str | None, Nullable(Url(example="http://otel-collector:4318/v1/traces")), "an OTLP/HTTP traces endpoint; null: no tracing (nothing on the request path)"] = None
    service_name: Annotated[str, Str(nonempty=True), "the traces' service.name"] = "responses-proxy"
    sample_ratio: Annotated[float, Num(lo=0, hi=1), "share of new traces kept (a client's traceparent decides for its own: parent-based)"] = 1.0
    record_prompts: Annotated[bool, "true: the request's input in its span (gen_ai.input.messages, 4 KiB at most); off: never any prompt text"] = False
    headers: Annotated[dict[str, str], MapOf(Str()), "sent with each export, e.g. {authorization: \"Bearer ${OTEL_TOKEN}\"}", COMMENTED] = field(default_factory=dict)
    export_delay_ms: Annotated[int, Int(10, 60000), "spans are sent in batches this far apart"] = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class Prices:
    """The `prices[]` section."""

    input: Annotated[int, Micros(), "uncached input tokens"]
    cached_input: Annotated[int | None, Micros(), "cached input tokens (default: input)", COMMENTED] = None
    output: Annotated[int, Micros(), "output tokens, reasoning included"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Images:
    """The `images` section."""

    allow_hosts: Annotated[tuple[str, ...], ListOf(Str(nonempty=True)), "non-empty: only these hosts (exact, or *.example.com)"] = ()
    allow_private: Annotated[bool, "true: skip the address check (a lab behind a firewall)"] = False
    resolve_timeout_s: Annotated[float, POS_NUM, "DNS budget per request; past it the URL is refused"] = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasoningSeal:
    """The `reasoning_seal` section."""

    keys: Annotated[dict[str, str | None], 'e.g. {k1: "${SEAL_KEY_1}"}'] = field(default_factory=dict)
    active: Annotated[str | None, "the key id that seals; null: the first"] = None
    ttl_s: Annotated[float, POS_NUM, "a ciphertext older than this (7 days) is dropped with a notice", COMMENTED] = DEFAULT_TTL_S


@dataclass(frozen=True, slots=True, kw_only=True)
class Root:
    """The whole configuration (`Config.settings`)."""

    server: Server = field(default_factory=Server)
    simulator: Annotated[Simulator, "the embedded upstream for workers whose url is embedded (also: python -m proxy.simulator.server)"] = field(default_factory=Simulator)
    workers: Annotated[
        tuple[Workers, ...], ListOf(Workers, min_len=1), Note("""\
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
Requests pick among them with the `provider` object (README, "Provider requirements").""")
    ] = (Workers(name="local", url="embedded", dialect="vllm", models=("tiny-org/tiny-model",), api_key=None, labels={}, capacity=256, timeouts=WorkersTimeouts(connect=5.0, first_byte=120.0, idle=120.0, total=1800.0)),)
    health: Health = field(default_factory=Health)
    routing: Routing = field(default_factory=Routing)
    metrics: Metrics = field(default_factory=Metrics)
    responses: Responses = field(default_factory=Responses)
    middlewares: Annotated[
        Middlewares, Note("""\
The request runs through fixed phases: envelope -> auth -> limits -> prepare (read the body,
stateless checks, tool policy, translate) -> balance -> handler. Each built-in policy below is
switched by its section's `enabled`; the order is not configurable. Your own middlewares go at
these named points: "package.module:factory", configured by a top-level section of the same
name (or written {"package.module:factory": {...}} in the list); README, "Your own middleware".""")
    ] = field(default_factory=Middlewares)
    endpoints: Annotated[
        Endpoints, Note("""\
The model server's other APIs, each through the same keys, limits and ledger as /v1/responses
(README, "Other endpoints"). false: that path answers 404 endpoint_disabled. Each body is
rebuilt from the fields the server reads (proxy/protocol/passthrough_fields.py): n, best_of and
batches are multiplied into the hold; unknown fields are not forwarded, and named in x-token-notice.""")
    ] = field(default_factory=Endpoints)
    websocket: Annotated[
        Websocket, Note("""\
Continuation (previous_response_id) over a socket keeps the last response's context in the
connection's memory only; every turn runs through the same pipeline as POST /v1/responses.""")
    ] = field(default_factory=Websocket)
    compact: Annotated[
        Compact, Note("""\
POST /v1/responses/compact and a compaction_trigger input item: a summary of the window the model
writes (thinking off, its cap fitted to the model's window), sealed with reasoning_seal (a
compaction item), opened when the window comes back in a later request.""")
    ] = field(default_factory=Compact)
    stateless: Stateless = field(default_factory=Stateless)
    auth: Auth = field(default_factory=Auth)
    limits: Limits = field(default_factory=Limits)
    tools: Tools = field(default_factory=Tools)
    balance: Balance = field(default_factory=Balance)
    notices: Notices = field(default_factory=Notices)
    ledger: Ledger = field(default_factory=Ledger)
    admin: Annotated[
        Admin, Note("""\
The operator's console (README "Operator's console"): /admin/api/... (keys, usage,
audit), /admin/openapi.json, and the dashboard at /admin/. Admin keys are separate from
client keys: a client key gets 403 there, no key 401.""")
    ] = field(default_factory=Admin)
    alerts: Annotated[
        Alerts, Note("""\
Alerts (README "Alerts"): a key's budget or balance, a worker ejected and back, a model no worker
serves, the ledger's fault and its end, the spool's backlog, Redis down; told to webhooks, never
on a request's path.""")
    ] = field(default_factory=Alerts)
    model_groups: Annotated[
        dict[str, tuple[str, ...]], MapOf(ListOf(Str(nonempty=True))), Note("""\
Named lists of models a key's or a level's allowed_models may name as group:<name>, e.g.
model_groups: {coding: [qwen/qwen3-coder, "deepseek/*"]} and allowed_models: [group:coding].
A change applies to every key and level naming the group (and is live: a reload takes it).""")
    ] = field(default_factory=dict)
    tracing: Annotated[
        Tracing, Note("""\
OpenTelemetry traces (README "Traces"): a span per request with its phases and upstream attempts,
the GenAI attributes, a client's traceparent as the parent and the worker's; off without an
endpoint.""")
    ] = field(default_factory=Tracing)
    prices: Annotated[
        dict[str, Prices], Note("""\
Per million tokens, in integer micro-units of the account currency (1 unit = 1,000,000),
by model name ("default": any other), e.g. tiny-org/tiny-model: {input: 100000, output: 300000}.""")
    ] = field(default_factory=lambda: {"default": Prices(input=500_000, cached_input=100_000, output=1_500_000)})
    images: Annotated[
        Images, Note("""\
input_image URLs are fetched by the model server, so by default the proxy refuses any
whose host resolves to loopback, private, link-local or reserved addresses, and any
scheme but http(s); data: URIs are always allowed.""")
    ] = field(default_factory=Images)
    reasoning_seal: Annotated[
        ReasoningSeal, Note("""\
Sealed reasoning across turns (include: ["reasoning.encrypted_content"]). Keys are base64
of 32 random bytes: python -c "import os,base64;print(base64.urlsafe_b64encode(os.urandom(32)).decode())"
Without a key here (or in RESPONSES_PROXY_SEAL_KEY), serve makes one at its first start beside
a SQLite ledger (seal.key, key id "local", mode 0600, reused). With a PostgreSQL ledger it makes
no key, and then the reasoning text travels in the item instead (x-token-notice says that
encrypted_content is ignored) and /v1/responses/compact answers 501. A ciphertext opens only
for the API key it was made for.""")
    ] = field(default_factory=ReasoningSeal)
