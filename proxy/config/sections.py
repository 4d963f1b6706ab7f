"""The typed settings of config.yaml: one frozen class per section of the schema.

Generated from proxy/config/schema.py by `responses-proxy config sections > proxy/config/sections.py`
(proxy/config/codegen.py); edit the schema, not this file. tests/config/test_schema.py keeps
the two equal, and proxy/config/settings.py refuses to build settings from a stale copy.
A field's comment is its key's doc in the schema. Other modules import these classes for
annotations only (under TYPE_CHECKING), so the command that regenerates this file runs while
it is stale, or empty (the shell truncates it for the redirect).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Server:
    """The `server` section."""

    host: str  # also: serve --host, RESPONSES_PROXY_HOST
    port: int  # also: serve --port, RESPONSES_PROXY_PORT
    # processes sharing the port (SO_REUSEPORT); auto (or 0) = one per core (also: serve --workers N)
    workers: int | str
    log_format: str  # auto: console on a terminal, JSON otherwise
    log_level: str
    max_body_bytes: int  # 413 above this (gzip/deflate/zstd decoding stops here too)
    max_json_depth: int  # 400 above this nesting depth
    max_input_items: int  # 400 above this many input items
    max_tools: int  # 400 above this many tools
    max_unbilled_body_bytes: int  # 413 above this for work nobody pays for: input_tokens counts and WebSocket warm-ups
    body_read_timeout: float  # seconds; a client that trickles its body gets 408
    max_line_size: int  # bytes of the request line; 400 above
    max_field_size: int  # bytes of one header line; 400 above
    max_headers: int  # header lines of one request; 400 above
    max_header_bytes: int  # request line + headers of one request, in bytes; 431, close
    # for a request's line + headers (from the connection's start, then its first byte); 408, close
    header_read_timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Simulator:
    """The `simulator` section."""

    host: str
    port: int  # 0: any free port
    dialect: str
    model: str  # served when no embedded worker lists models
    max_model_len: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkersTimeouts:
    """The `workers[].timeouts` section."""

    connect: float  # TCP connect; past it the next eligible worker is tried (504 if none is left)
    first_byte: float  # request sent -> first upstream chunk; past it the client gets 504
    idle: float  # between two upstream chunks; past it, response.failed
    total: float  # the whole upstream exchange


@dataclass(frozen=True, slots=True, kw_only=True)
class Workers:
    """The `workers[]` section."""

    name: str  # unique; shown in logs and metrics
    url: str  # http(s)://host:port of a vLLM / SGLang server, or embedded (the simulator)
    dialect: str  # detect: from /v1/models owned_by at start-up
    models: tuple[str, ...] | None  # null: discovered from its /v1/models
    # the worker's own key (e.g. ${GPU_A_KEY}); printable ASCII only (a CR/LF stops start-up); the client's never
    # travels upstream
    api_key: str | None
    labels: dict[str, Any]  # matched by provider.labels, e.g. {region: eu, zdr: true, price_prompt: 0.2}
    capacity: int  # concurrent requests; over it -> next worker, or 429
    # the chat-template kwarg of reasoning.effort: Qwen3/GLM enable_thinking, DeepSeek V3.1 thinking
    thinking_switch: str
    timeouts: WorkersTimeouts  # seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthOutlier:
    """The `health.outlier` section."""

    consecutive_failures: int
    base_ejection_s: float  # doubled on each repeated ejection, up to max_ejection_s
    max_ejection_s: float  # re-admitted by the first passing check after that
    max_ejection_percent: int  # share of a model's workers ejected at once (below 100: never its last)


@dataclass(frozen=True, slots=True, kw_only=True)
class Health:
    """The `health` section."""

    enabled: bool  # active checks (vLLM GET /health, SGLang GET /v1/models); no traffic to a worker before one passes
    interval_s: float
    timeout_s: float
    unhealthy_threshold: int  # failed checks in a row -> unhealthy
    healthy_threshold: int  # passed checks in a row -> healthy again
    vllm_path: str
    sglang_path: str  # SGLang's own /health is never used
    outlier: HealthOutlier  # passive ejection (Envoy-style): N connection failures / 5xx in a row


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingAffinity:
    """The `routing.affinity` section."""

    enabled: bool  # false: least loaded
    epsilon: float  # a worker takes at most ceil((1 + epsilon) * average in-flight)
    vnodes: int  # points per worker on the consistent-hash ring
    hash_messages: bool  # key on system + first user message without prompt_cache_key


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing:
    """The `routing` section."""

    max_attempts: int  # workers tried when one fails before the first byte
    context_check: bool  # 400 context_length_exceeded before forwarding
    bytes_per_token_floor: float  # "clearly over" estimate: prompt bytes / this (0: never)
    affinity: RoutingAffinity  # prompt-cache affinity (README, "Prompt-cache affinity")


@dataclass(frozen=True, slots=True, kw_only=True)
class Metrics:
    """The `metrics` section."""

    enabled: bool
    path: str  # Prometheus text, unauthenticated: keep it off the public edge
    key_ids: tuple[str, ...]  # per-key spend and balance for these keys (opt-in)
    top_keys: int  # and for the N keys with the most spend this month (0: none)
    key_refresh_s: float  # the per-key figures are read from the ledger this often


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesSamplingDefaults:
    """The `responses.sampling_defaults[]` section."""

    temperature: float | None
    top_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Responses:
    """The `responses` section."""

    ai_markers: bool  # ai_generated / ai_notice on every Response
    ai_notice: str
    reasoning_items: bool  # false: leave reasoning items out of output
    reasoning_in_clear: bool  # false: when sealing (reasoning_seal), send only the ciphertext
    default_max_output_tokens: int | None  # not read (balance.default_max_output_tokens caps holds)
    # served model -> the sampling values its server applies when a request leaves them out (its
    # generation_config.json); echoed only
    sampling_defaults: dict[str, ResponsesSamplingDefaults] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Middlewares:
    """The `middlewares` section."""

    after_auth: tuple[Any, ...]  # the key is known (context .key), the body not read yet (every keyed route)
    # body read and translated once (context .body, .translation), nothing held yet (routes that translate)
    after_prepare: tuple[Any, ...]
    # the balance is held (context .hold) and the output cap final (context .to_answer()); the handler is next (billed
    # routes)
    before_handler: tuple[Any, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoints:
    """The `endpoints` section."""

    chat_completions: bool  # POST /v1/chat/completions, the body passed through
    completions: bool  # POST /v1/completions, the body passed through
    embeddings: bool  # POST /v1/embeddings, the body passed through
    messages: bool  # POST /v1/messages (+ /count_tokens): Anthropic's API, passed through
    max_choices: int  # n, best_of or a beam's width of one request; above it, a 400
    max_batch_inputs: int  # prompts of one completion, inputs of one embedding request; above, a 400
    max_top_logprobs: int  # top_logprobs (chat) and logprobs (completions) at most this
    # server extensions no hold bounds, accepted anyway (else a 400 naming the field)
    allowed_extensions: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Websocket:
    """The `websocket` section."""

    enabled: bool  # GET /v1/responses with an upgrade: the Responses WebSocket transport
    max_connection_minutes: float  # then websocket_connection_limit_reached and the socket closes
    idle_timeout_s: float  # a socket with no turn in flight and no message this long is closed
    ping_interval_s: float | None  # pings this often; a peer that misses a pong is closed; null: none
    # response.create messages waiting behind the one in flight; past it, websocket_queue_full and the socket closes
    max_queued_turns: int
    max_queued_bytes: int  # bytes of those messages (as inflated); past it, the same
    max_message_bytes: int  # one message, bounded while permessage-deflate inflates it (default: server.max_body_bytes)
    # open sockets of one key in this process; past it the handshake gets 429 too_many_connections
    max_sockets_per_key: int | None
    max_sockets: int | None  # open sockets in all in this process; past it, the same
    # pings and pongs a peer may send (twice this as a burst); a flood past it closes the socket
    max_control_frames_per_s: float
    permessage_deflate: bool  # accept compressed messages (RFC 7692); their inflated size is what every bound counts
    # turns in a row refused for rate or balance (429, 402); then the socket closes (1008), and the key's sockets are
    # not compressed for refused_for_s
    max_refused_turns: int
    refused_for_s: float  # how long a key refused so gets no permessage-deflate on a new socket
    # and how long its new sockets' handshakes get that refusal (402, 429) instead, as a plain HTTP answer: a reconnect
    # flood costs what HTTP's does
    refuse_sockets_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Compact:
    """The `compact` section."""

    # the latest user messages kept as they are, at most this many, before the summary of the whole window
    keep_recent_items: int
    max_summary_tokens: int  # output cap of the summary the model writes
    instructions: str  # the summary's instructions


@dataclass(frozen=True, slots=True, kw_only=True)
class Stateless:
    """The `stateless` section."""

    enabled: bool  # false: this policy does not run
    previous_response_id: str  # refuse (004 doc) | ignore (000 doc)


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthStaticKeys:
    """The `auth.static_keys[]` section."""

    name: str  # unique
    sha256: str | None  # hex sha256 of the key (one of sha256 or key)
    key: str | None  # the key itself, e.g. ${OPS_KEY}
    allowed_models: tuple[str, ...] | None  # default: every model
    concurrency: int | None  # requests in flight (per process unless limits.backend is redis)
    rate_per_min: int | None  # requests per minute (per process unless limits.backend is redis)


@dataclass(frozen=True, slots=True, kw_only=True)
class Auth:
    """The `auth` section."""

    enabled: bool  # false: this policy does not run
    # true: create a demo key at start and print it (true without a config file; make run passes --demo-key)
    demo_key: bool
    static_keys: tuple[AuthStaticKeys, ...]  # keys without a database
    key_cache_ttl_s: float  # revocation takes effect within this; 0: no cache
    key_cache_size: int  # cached keys per process (LRU)


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsRedis:
    """The `limits.redis` section."""

    url: str  # e.g. ${REDIS_URL}; rediss:// for TLS
    key_prefix: str  # every key the limits write starts with it
    slot_ttl_s: float  # a replica renews its slots every third of this; a dead replica's slots free up after it
    socket_timeout_ms: int  # connect and reply budget of each Redis call
    # Redis unreachable: open admits (counted per process meanwhile); closed answers 503 limits_unavailable
    on_error: str
    retry_after_s: float  # Retry-After of that 503


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """The `limits` section."""

    enabled: bool  # false: this policy does not run
    # memory: counted per process (serve --workers N divides the global limits by N); redis: one count shared by every
    # process and replica
    backend: str
    global_concurrency: int | None  # requests in flight over all keys; null: no limit
    default_key_concurrency: int | None  # per key, unless its own limit is set
    retry_after_s: float  # Retry-After of a 429
    redis: LimitsRedis  # backend: redis only


@dataclass(frozen=True, slots=True, kw_only=True)
class Tools:
    """The `tools` section."""

    enabled: bool  # false: this policy does not run
    drop: tuple[str, ...] | None  # hosted tool types left out, named in x-token-notice; null: built-in list
    refuse: tuple[str, ...] | None  # tool types refused with 400; null: built-in list


@dataclass(frozen=True, slots=True, kw_only=True)
class Balance:
    """The `balance` section."""

    enabled: bool  # false: this policy does not run
    hold_ttl_s: float  # a hold whose request never settles is released after this
    demo_balance_micros: int  # the demo key's balance
    default_max_output_tokens: int  # output cap reserved when nothing else says one
    bytes_per_token: float  # input hold: prompt bytes / this + template; <= 1 (an upper bound)
    lease_max_micros: int  # largest lease per key and process (0: no leases)
    lease_min_rate: int  # requests/s of a key in one process before a lease
    lease_seconds: float  # a lease covers ~this long of the key's spend
    lease_idle_s: float  # an unused lease is given back after this
    lease_ttl_s: float  # a lease row expires this long after its last renewal
    lease_commit_ms: float  # leased usage rows are committed this far apart
    lease_commit_rows: int  # or as soon as this many wait, whichever comes first
    # a leased row on disk before its answer ends: fsync'd (group-committed), write(2) only (survives a crash of the
    # proxy, not of the machine), or off
    lease_journal: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Notices:
    """The `notices` section."""

    enabled: bool  # false: this policy does not run
    header: str
    max_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Ledger:
    """The `ledger` section."""

    backend: str  # postgres: shared by every replica (README "PostgreSQL ledger"); none: no keys, no balances
    path: str  # sqlite: the database file, relative to this file
    dsn: str | None  # postgres: e.g. ${LEDGER_DSN} (postgresql://user:pass@host:5432/db)
    pool_min: int  # postgres: connections kept open per process
    pool_max: int  # postgres: at most this many connections per process
    statement_timeout_ms: int  # postgres: statement_timeout of every connection
    connect_timeout_s: float  # postgres: connecting (and waiting for a pooled connection)
    spool_path: str  # postgres: each settlement is written here first (fsync'd) and applied a moment later
    unavailable_retry_after_s: int  # postgres: Retry-After of the 503 while it is unreachable
    synchronous: str  # settles, top-ups, revokes: fsync'd at every (group) commit
    hold_synchronous: str  # holds: no fsync (proxy/ledger/sqlite/ledger.py says why)
    busy_timeout_ms: int
    max_batch: int  # operations per group commit
    settle_linger_ms: float  # a settle waits up to this long to share its commit
    expire_interval_s: float  # expired holds are swept this often


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminKeys:
    """The `admin.keys[]` section."""

    name: str  # unique; the audit log names it (admin:<name>)
    sha256: str | None  # hex sha256 of the admin key (one of sha256 or key)
    key: str | None  # the admin key itself, e.g. ${ADMIN_KEY}


@dataclass(frozen=True, slots=True, kw_only=True)
class Admin:
    """The `admin` section."""

    keys: tuple[AdminKeys, ...]  # admin keys (never client keys); none: no admin API, no dashboard
    prefix: str  # the admin API, its OpenAPI and the dashboard live under it
    session_ttl_s: int  # a dashboard login lasts this long
    # signs dashboard sessions, e.g. ${ADMIN_SESSION_SECRET}; unset: made at first start beside a SQLite ledger
    # (admin-session.key), shared by every process; a PostgreSQL ledger: random per process
    session_secret: str | None
    cookie_secure: bool  # true: the session cookie is sent over HTTPS only (behind TLS)
    # failed admin keys (login, Bearer) per client address; past it 429, even for the right key
    login_failures_per_min: int
    login_failure_burst: int  # failed admin keys an address may make at once


@dataclass(frozen=True, slots=True, kw_only=True)
class Prices:
    """The `prices[]` section."""

    input: float  # uncached input tokens
    cached_input: float | None  # cached input tokens (default: input)
    output: float  # output tokens, reasoning included


@dataclass(frozen=True, slots=True, kw_only=True)
class Images:
    """The `images` section."""

    allow_hosts: tuple[str, ...]  # non-empty: only these hosts (exact, or *.example.com)
    allow_private: bool  # true: skip the address check (a lab behind a firewall)
    resolve_timeout_s: float  # DNS budget per request; past it the URL is refused


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasoningSeal:
    """The `reasoning_seal` section."""

    keys: dict[str, str | None]  # e.g. {k1: "${SEAL_KEY_1}"}
    active: str | None  # the key id that seals; null: the first
    ttl_s: float  # a ciphertext older than this (7 days) is dropped with a notice


@dataclass(frozen=True, slots=True, kw_only=True)
class Root:
    """The whole configuration (`Config.settings`)."""

    server: Server
    # the embedded upstream for workers whose url is embedded (also: python -m proxy.simulator.server)
    simulator: Simulator
    workers: tuple[Workers, ...]
    health: Health
    routing: Routing
    metrics: Metrics
    responses: Responses
    middlewares: Middlewares
    endpoints: Endpoints
    websocket: Websocket
    compact: Compact
    stateless: Stateless
    auth: Auth
    limits: Limits
    tools: Tools
    balance: Balance
    notices: Notices
    ledger: Ledger
    admin: Admin
    prices: dict[str, Prices]
    images: Images
    reasoning_seal: ReasoningSeal


class Sections:
    """The root's keys as attributes of Config (proxy/config/load.py): `config.balance`."""

    server: Server
    simulator: Simulator
    workers: tuple[Workers, ...]
    health: Health
    routing: Routing
    metrics: Metrics
    responses: Responses
    middlewares: Middlewares
    endpoints: Endpoints
    websocket: Websocket
    compact: Compact
    stateless: Stateless
    auth: Auth
    limits: Limits
    tools: Tools
    balance: Balance
    notices: Notices
    ledger: Ledger
    admin: Admin
    prices: dict[str, Prices]
    images: Images
    reasoning_seal: ReasoningSeal
