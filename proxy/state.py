"""Typed keys for what travels on the app and on each request: every AppKey and RequestKey
of the product is defined here (their types by name, so this module imports none of their modules).

Middlewares learn things (the caller's key, the notices, the reserved amount, the
output cap) and hand them on under these keys; nothing is passed by string name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:  # imported for annotations only, to keep this module import-light
    from proxy.config.load import Config
    from proxy.protocol.translate import Translation


@dataclass
class Outcome:
    """What the forwarder reports about one request, updated as the answer streams.

    Read by the middlewares after the handler returns (or is cancelled): the balance
    middleware settles from it, the access log prints it.
    """

    status: str = "pending"  # completed | incomplete | failed | cancelled | error
    http_status: int = 0
    upstream: str | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    usage_reported: bool = False  # False: output_tokens is counted from the deltas
    # The upstream's usage as reported (Responses-shaped, unchecked: proxy.ledger.usage
    # checks it before billing), and whether the answer was cut off at the output cap.
    reported_usage: dict | None = None
    counted_output: int = 0  # output deltas counted (each carried at least one token)
    output_capped: bool = False
    ttfb_ms: float | None = None
    cost_micros: int | None = None  # what the ledger row says was charged (None: nothing settled)
    error: str | None = None  # the error code of a stream ended by response.failed, when the proxy ended it
    extra: dict[str, Any] = field(default_factory=dict)


# App-wide state. The resources live here, not beside the code that makes them, so that a
# middleware or an endpoint can read them without importing the app or the forwarder.
CONFIG = web.AppKey("config", "Config")
LEDGER = web.AppKey("ledger", object)  # proxy.ledger.Ledger, or absent (ledger.backend: none)
POOL = web.AppKey("worker_pool", "WorkerPool")
SESSION = web.AppKey("client_session", "aiohttp.ClientSession")  # every upstream call but the chat POST
UPSTREAMS = web.AppKey("upstreams", "UpstreamPool")  # the chat POST (proxy.upstream.client: why)
METRICS = web.AppKey("metrics", "Metrics")  # proxy.runtime.metrics
CHECKER = web.AppKey("health_checker", "HealthChecker")  # proxy.upstream.health's active checks
READINESS = web.AppKey("readiness", "Readiness")  # proxy.upstream.health, answers /readyz
RESPONSE_SETTINGS = web.AppKey("response_settings", "ResponseSettings")  # proxy.http.forwarder
SAMPLING_DEFAULTS = web.AppKey("sampling_defaults", dict)  # proxy.upstream.models.parse_sampling_defaults
IMAGE_POLICY = web.AppKey("image_policy", "ImagePolicy")  # proxy.policy.netguard
SEALER = web.AppKey("sealer", "Sealer")  # the app's proxy.protocol.seal.Sealer, when seal keys are configured
WEBSOCKET_SETTINGS = web.AppKey("websocket_settings", "WebSocketSettings")  # proxy.http.websocket
COMPACT_SETTINGS = web.AppKey("compact_settings", "CompactSettings")  # proxy.http.compact
KEY_CACHE = web.AppKey("key_cache", "KeyCache")  # middlewares.auth
NOTICES_HEADER = web.AppKey("notices_installed", str)  # the header middlewares.notices writes; set once
AFFINITY = web.AppKey("affinity_settings", "AffinitySettings")  # routing.affinity, parsed (proxy.upstream.affinity)
SETTLEMENTS = web.AppKey("settlements", "Settlements")  # middlewares.balance: the ledger work in flight
# The embedded upstream's state (proxy.simulator.server): on the simulator's own app, not the proxy's.
SIM_STATE = web.AppKey("simulator_state", "SimState")

# Per-request state.
REQUEST_ID = web.RequestKey("request_id", str)
BODY = web.RequestKey("body", dict)
TRANSLATION = web.RequestKey("translation", "Translation")
NOTICES = web.RequestKey("notices", list)
OUTPUT_CAP = web.RequestKey("output_cap", int)
OUTCOME = web.RequestKey("outcome", Outcome)
API_KEY = web.RequestKey("api_key", "KeyRecord")  # the caller's key, set by middlewares.auth
# The output cap the balance reserved for (the rewriter stops there even when no
# max_tokens was sent), and the balance's settle-now hook: the forwarder awaits it before
# the last bytes of a stream, so a client that waits for its answer finds it billed.
RESERVED_OUTPUT = web.RequestKey("reserved_output", int)
SETTLE = web.RequestKey("settle", Any)
HOLD = web.RequestKey("hold", "Hold")  # the balance middleware's hold on the ledger
EVENT_STREAM = web.RequestKey("event_stream", "StreamRewriter")  # the streamed answer's rewriter (proxy.http.forwarder)
# The response whose headers went out (set by the last on_response_prepare hook): past that
# point an error can no longer become an HTTP status (see proxy.http.app._after_start).
STARTED = web.RequestKey("started_response", web.StreamResponse)


def notices(request: web.Request) -> list[str]:
    """The request's notice list, created on first use."""
    found = request.get(NOTICES)
    if found is None:
        found = []
        request[NOTICES] = found
    return found


def outcome(request: web.Request) -> Outcome:
    found = request.get(OUTCOME)
    if found is None:
        found = Outcome()
        request[OUTCOME] = found
    return found


# Set by the auth middleware when it creates the demo key at start (embedded defaults).
DEMO_KEY = web.AppKey("demo_key", str)
