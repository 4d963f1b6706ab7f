"""Where state lives: every AppKey and RequestKey of the product (their types by name, so this
module imports none of their modules), the one per-request `RequestContext`
and the values its phases hand on (`AnswerReport`, `Bill`, `Tail`).

App-wide resources hang on the app under these keys; what one request learns (the caller's
key, the body, the translation, the notices, the hold) is a field of its RequestContext,
written by the phase that owns it; nothing is passed by string name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.protocol.answer_report import AnswerReport, Tokens

if TYPE_CHECKING:  # for annotations only (never evaluated here), to keep this module import-light
    from aiohttp import ClientSession

    from proxy.config.load import Config
    from proxy.config.sections import Responses
    from proxy.ledger.base import Hold, KeyRecord
    from proxy.ledger.interface import Ledger
    from proxy.ledger.scope import Scope
    from proxy.policy.netguard import ImagePolicy
    from proxy.protocol.passthrough import Limits, Passthrough
    from proxy.protocol.rewriter import StreamRewriter
    from proxy.protocol.seal import Sealer
    from proxy.protocol.translate import Translation
    from proxy.units import Unit
    from proxy.upstream.client import UpstreamPool
    from proxy.upstream.workers import WorkerPool
# This module stands below everything that keeps state on an app or a request.


# The values the phases hand on are NamedTuples: immutable, and built by one C call (a frozen
# dataclass's __init__ sets each field through object.__setattr__), once or twice a request. An
# answer's Tokens and AnswerReport are proxy.protocol.answer_report's.


class Bill(NamedTuple):
    """What the balance charged for an answer (the ledger row's figures)."""

    tokens: Tokens
    cost_micros: int


class Tail(NamedTuple):
    """The end of a streamed answer, written by the envelope after the phases returned: the
    balance has billed it and the limits have given the slot back by then, so a client that
    reads the end of its answer finds both done (and its next request admitted)."""

    response: Any  # the prepared web.StreamResponse (or a transport's TurnStream)
    pending: bytes  # the last events, not yet written
    whole: bool  # the answer was complete: a client hanging up on its end is no error
    # The proxy's own end of a failed stream, made from the figures it ends with (the bill,
    # else what was shown): (those Tokens) -> its last event's bytes.
    failure: Callable[[Tokens], bytes] | None = None

    async def send(self, tokens: Tokens) -> None:
        data = self.pending
        if self.failure is not None:
            data += self.failure(tokens)
        try:
            await self.response.write_eof(data)  # the last events and the end of the body: one send
        except ConnectionResetError:
            # Clients such as Codex hang up as soon as they read the terminal event: an
            # answer that was whole is a success, not a disconnect.
            if not self.whole:
                raise


def _app_key(name: str, type_name: str) -> web.AppKey[Any]:
    # The value's type by name at run time (aiohttp shows it in the key's repr): importing it
    # would make this module depend on every module that keeps state here. The type checker
    # reads each key's annotation instead (web.AppKey[Ledger]: imported for it alone, above).
    # A key whose type's module imports this one is defined beside its type instead (listed below),
    # but COMPACT_SETTINGS (said why there).
    return web.AppKey(name, type_name)  # type: ignore[arg-type]  # a name, not a type: see above


def _request_key(name: str, type_name: str) -> web.RequestKey[Any]:
    return web.RequestKey(name, type_name)  # type: ignore[arg-type]  # a name, not a type: see _app_key


# App-wide state. The resources live here, not beside the code that makes them, so that a
# middleware or an endpoint can read them without importing the app or the handlers.
CONFIG: web.AppKey[Config] = _app_key("config", "Config")
LEDGER: web.AppKey[Ledger] = _app_key("ledger", "Ledger")  # proxy.ledger.Ledger, or absent (ledger.backend: none)
POOL: web.AppKey[WorkerPool] = _app_key("worker_pool", "WorkerPool")
# every upstream call but the chat POST
SESSION: web.AppKey[ClientSession] = _app_key("client_session", "aiohttp.ClientSession")
# the chat POST (proxy.upstream.client: why)
UPSTREAMS: web.AppKey[UpstreamPool] = _app_key("upstreams", "UpstreamPool")
# config.responses, read by proxy.http.responses_handler
RESPONSE_SETTINGS: web.AppKey[Responses] = _app_key("response_settings", "Responses")
SAMPLING_DEFAULTS = web.AppKey("sampling_defaults", dict)  # proxy.protocol.models.sampling_defaults
IMAGE_POLICY: web.AppKey[ImagePolicy] = _app_key("image_policy", "ImagePolicy")  # proxy.policy.netguard
# proxy.protocol.passthrough, from config.endpoints
PASSTHROUGH_LIMITS: web.AppKey[Limits] = _app_key("passthrough_limits", "Limits")
# the app's proxy.protocol.seal.Sealer, when seal keys are configured
SEALER: web.AppKey[Sealer] = _app_key("sealer", "Sealer")
# proxy.http.compact.CompactSettings: untyped, since its module imports proxy.http.request, which reads
# the key (beside the class it would close an import cycle; imported here, a climb back up)
COMPACT_SETTINGS = _app_key("compact_settings", "CompactSettings")
NOTICES_HEADER = web.AppKey("notices_installed", str)  # the header middlewares.notices writes; set once
# proxy.app: the app's one middleware; a turn runs through it
ENVELOPE: web.AppKey[Middleware] = web.AppKey("envelope", Middleware)
# Keys kept beside the type they hold, each in a module that uses this one (here the type would be
# an import back up): proxy.upstream.health.CHECKER, proxy.upstream.health.READINESS,
# proxy.runtime.metrics.METRICS,
# proxy.runtime.key_metrics.KEY_METRICS, proxy.runtime.refusals.REFUSALS, proxy.simulator.chat.SIM_STATE,
# proxy.http.websocket.SOCKETS, proxy.http.parse_errors.HEAD_LIMITS, proxy.http.turn.TURN (a request's),
# proxy.admin.auth.ADMIN, proxy.admin.auth.ADMIN_SESSION (a request's), middlewares.PHASES,
# middlewares.auth.KEY_CACHE, middlewares.balance.SETTLEMENTS, proxy.limits.redis_backend.SHARED_COUNTER,
# proxy.runtime.alerts.ALERTS, proxy.runtime.reload.RELOADERS.

# Per-request state: one context, created by the envelope (proxy.app) and passed explicitly
# to every phase and the handler; it is also on the request under CONTEXT, for aiohttp-shaped
# code (a custom middleware, an on_response_prepare hook, a route handler).
CONTEXT: web.RequestKey[RequestContext] = _request_key("context", "RequestContext")
ADMIN_ACTOR = web.RequestKey("admin_actor", str)  # proxy.admin: "admin:<name>" of an admin request
# proxy.admin.auth: what the calling admin may see and change (proxy.ledger.scope.Scope)
ADMIN_SCOPE: web.RequestKey[Scope] = _request_key("admin_scope", "Scope")


@dataclass(eq=False, slots=True)
class RequestContext:
    """What one request's phases learn and hand on (middlewares/__init__.py: who writes what).

    It never refers to the request (the request refers to it): no cycle for the cyclic GC.
    """

    request_id: str
    method: str  # the request's, or "POST" for a turn of another transport
    path: str  # the route: /v1/responses, /v1/responses/input_tokens, ...
    transport: str = "http"  # what carried it: http | websocket (the envelope's, proxy.app)
    started_at: float = 0.0  # time.perf_counter() at its arrival (the envelope's)
    key: KeyRecord | None = None  # auth: the caller's key (None: no auth, or not a guarded route)
    # auth: the records of the levels above the key (proxy/ledger/levels.py), top down; () for most keys
    levels: tuple = ()
    body: dict | None = None  # prepare: the parsed body, read once (a turn's from its TURN, proxy.http.turn)
    # prepare: the one translation, as the client asked (a pass-through route's: its Passthrough)
    translation: Translation | Passthrough | None = None
    notices: list[str] = field(default_factory=list)  # joined into x-token-notice (middlewares.notices)
    report: AnswerReport | None = None  # the handler: its answer, once it ended (None: no worker was chosen)
    tail: Tail | None = None  # the handler: a stream's end, written by the envelope after the phases
    hold: Hold | None = None  # balance: the hold on the ledger
    # balance: the translation with the output cap it held for (Translation.with_cap): lowered,
    # sent upstream and echoed when the balance or a budget covers less than the client asked.
    capped: Translation | Passthrough | None = None
    bill: Bill | None = None  # balance: what the answer was charged, once settled
    # balance: the settlement still in flight when the handler was cancelled (the client went
    # away); the envelope writes the access line and the metrics once it is done, so they carry
    # the billed figures (an asyncio.Task).
    settling: Any = None
    event_stream: StreamRewriter | None = None  # the handler: the streamed answer's rewriter
    # The response whose headers went out (the last on_response_prepare hook sets it): past
    # that point an error can no longer become an HTTP status (proxy.app._after_start).
    started: web.StreamResponse | None = None
    endpoint: Any = None  # what runs after the last phase: the route's handler(request)
    # The unit of work (proxy.units): which phases run. The envelope sets it from the route
    # table or the turn; the body phase may refine it to one of its variants.
    unit: Unit = None  # type: ignore[assignment]

    def to_answer(self) -> Translation | Passthrough | None:
        """The translation the handler answers: the balance's capped copy, when it held."""
        return self.capped if self.capped is not None else self.translation

    def tokens(self) -> Tokens | None:
        """The figures the answer ends with: as billed, else as shown; None: no answer."""
        if self.bill is not None:
            return self.bill.tokens
        report = self.report
        return report.shown if report is not None else None


def context(request: web.Request) -> RequestContext:
    """The request's context (the envelope made it before anything else ran)."""
    return request[CONTEXT]


# Set by the auth middleware when it creates the demo key at start (embedded defaults).
DEMO_KEY = web.AppKey("demo_key", str)
