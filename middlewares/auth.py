"""API keys: `Authorization: Bearer <key>` on the API routes.

Guarded: every unit of work whose phases include `auth` (proxy.http.routes, proxy.units):
the Responses routes, each WebSocket turn (a key revoked after the handshake stops the next
turn), /v1/models (as on OpenAI, listing models needs a key) and /v1/key (the caller's own
key), whatever the method (HEAD /v1/models too); a method a guarded path does not serve still
gets its 405. The probes (/livez, /healthz, /readyz) and /metrics stay open. Auth is the first
phase after the envelope (middlewares/__init__.py), so a request without a valid key is
refused from its headers alone: its body is never read, and when the body is still arriving
the refusal closes the connection (`_refuse`).

Keys come from the ledger (`app[LEDGER].lookup_key`) and, for deployments without a
database, from `static_keys` in the section:

    auth:
      demo_key: true                # on start: a fresh "demo" key, printed once to stdout
      key_cache_ttl_s: 5            # successful ledger lookups are cached this long (0: off)
      key_cache_size: 10000         # at most this many cached keys (least recently used out)
      static_keys:
        - {name: ci, sha256: 3f4c...}            # hex sha256 of the secret
        - {name: ops, key: "${OPS_KEY}", allowed_models: [tiny-org/tiny-model], concurrency: 4}

Key cache. A ledger lookup is a trip through the ledger's writer thread, so successful
lookups are cached in the process, keyed by the secret's sha256 (the secret itself is
never kept), for `key_cache_ttl_s`, in an LRU bounded by `key_cache_size`. Unknown and
revoked keys are never cached (no negative cache: a flood of made-up keys cannot fill
memory or evict real ones; each costs one indexed read, as before). Consequences:
  * a revoke or limit change made through this process's ledger object empties the cache
    at once (`Ledger.key_generation`);
  * one made elsewhere (`responses-proxy keys revoke` from the CLI, another worker of
    `serve --workers N`) takes effect within key_cache_ttl_s: that is the revocation
    bound. Set 0 to look every request up in the ledger.
  * a cached KeyRecord's balance_micros is as old as the entry; nothing on the request
    path reads it (the balance middleware asks the ledger).

Every failure (missing header, another scheme, unknown, revoked or expired key) is the same 401
`invalid_api_key`, whose message never repeats what was sent; a revoked or an expired key is
told so (only the holder of its secret could present it). Two Authorization headers
are a 400 `duplicate_header` (which one counts would depend on the software reading them).
A key limited to some models gets 403 `model_not_allowed` for the others (checked by the
prepare phase, once the body is read). The caller's `KeyRecord` is the context's `key` for
the phases after this one (limits, prepare, balance).

Static keys have no ledger account: the balance middleware does not bill them
(`is_static`), the limits middleware applies their `concurrency` / `rate_per_min`.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import re
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy import state
from proxy.config.cross_checks import key_digest
from proxy.errors import APIError
from proxy.http.errors import close_if_unread, error_response, ledger_unavailable
from proxy.ledger import KeyRecord, LedgerUnavailable
from proxy.ledger.base import STATIC_PREFIX
from proxy.ledger.service import new_demo_key
from proxy.logs import log
from proxy.protocol.passthrough import ANTHROPIC
from proxy.state import LEDGER, RequestContext

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Auth

_TOKEN = re.compile(r"^[\x21-\x7e]+$")  # a bearer token is printable ASCII without spaces


class KeyCache:
    """Successful ledger lookups by sha256 of the secret, each (the key, its levels' records):
    TTL'd, LRU-bounded, dropped wholesale when the ledger's key_generation moves on (a change to
    a key or a level). No negative entries."""

    __slots__ = ("ttl", "size", "_entries", "_generation", "hits", "misses")

    def __init__(self, ttl_s: float, size: int) -> None:
        self.ttl = ttl_s
        self.size = size if ttl_s > 0 else 0
        self._entries: OrderedDict[bytes, tuple[tuple[KeyRecord, tuple], float]] = OrderedDict()
        self._generation = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:  # never the digests
        return f"KeyCache(ttl_s={self.ttl}, size={self.size}, entries={len(self._entries)})"

    def get(self, digest: bytes, generation: int) -> tuple[KeyRecord, tuple] | None:
        if generation != self._generation:
            self._entries.clear()
            self._generation = generation
            return None
        entry = self._entries.get(digest)
        if entry is None:
            self.misses += 1
            return None
        if time.monotonic() >= entry[1]:
            del self._entries[digest]
            self.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.hits += 1
        return entry[0]

    def put(self, digest: bytes, record: tuple[KeyRecord, tuple], generation: int) -> None:
        """`generation`: the ledger's key_generation read BEFORE the lookup that found
        `record`, so a revoke that committed meanwhile makes this entry stale at once."""
        if self.size <= 0 or generation != self._generation:
            return
        self._entries[digest] = (record, time.monotonic() + self.ttl)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def _x_api_key(request: web.Request) -> list[str] | None:
    """`x-api-key: <key>` (the Anthropic SDKs, Claude Code) as the Authorization header it stands
    for, when no Authorization header came: one key, checked exactly as a Bearer token."""
    found = request.headers.getall("x-api-key", None)
    if not found:
        return None
    return [f"Bearer {v}" for v in found]


def _credentials(request: web.Request, anthropic: bool) -> list[str] | None:
    """The Authorization values to check: x-api-key first on Anthropic's routes (its SDKs and
    Claude Code send it; a Bearer beside it is another client's habit), Authorization first on
    the others. Both present and naming different keys: None, a 401 that says so."""
    bearer = request.headers.getall("Authorization", None)
    api_key = _x_api_key(request)
    if bearer and api_key and len(bearer) == len(api_key) == 1:
        scheme, _, secret = bearer[0].strip().partition(" ")
        if scheme.lower() == "bearer" and secret.strip() != api_key[0][7:].strip():
            return None
    if anthropic:
        return api_key or bearer or []
    return bearer or api_key or []


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _refuse(request: web.Request, ctx: RequestContext, call_next, exc: APIError) -> web.StreamResponse:
    """The refusal, answered before any byte of the body is read.

    While the body is still arriving, the answer says `Connection: close` and the connection
    is marked closing (`RequestHandler.close()`): aiohttp then drops what the client still
    sends as it arrives, unparsed (instead of draining it through its parser), and closes
    the connection once the client is done or its lingering time is over. Closing at once
    would cut off a client still sending before it reads its 401 (the OpenAI SDK then
    reports a connection error, and retries).
    """
    if request.match_info.http_exception is not None:
        return await call_next(request, ctx)  # a method this path does not serve: its 405, not a 401
    return close_if_unread(request, error_response(exc))


def _static_keys(entries: Any) -> list[tuple[bytes, KeyRecord]]:
    """auth.static_keys (checked at load, proxy.config.cross_checks): (digest, record) of each."""
    out: list[tuple[bytes, KeyRecord]] = []
    for i, entry in enumerate(entries):
        given = {"name": entry.name, **({"sha256": entry.sha256} if entry.sha256 is not None else {"key": entry.key})}
        record = KeyRecord(
            key_id=STATIC_PREFIX + entry.name, name=entry.name, prefix="static", balance_micros=0,
            allowed_models=tuple(entry.allowed_models) if entry.allowed_models is not None else None,
            concurrency=entry.concurrency, rate_per_min=entry.rate_per_min, revoked=False, created_at=0.0,
        )
        out.append((key_digest(given, f"auth.static_keys[{i}]"), record))
    return out


def _demo_key_ctx(balance_micros: int):
    async def demo_key(app: web.Application) -> AsyncIterator[None]:
        ledger = app.get(LEDGER)
        if ledger is None:
            log.warning("demo key not created: no ledger (ledger.backend is none)")
            yield
            return
        secret = await new_demo_key(ledger, balance_micros)
        app[state.DEMO_KEY] = secret
        # The one place a secret is ever printed: stdout, once, for the operator.
        print(f"demo key: {secret}", file=sys.stdout, flush=True)
        yield

    return demo_key


def create(section: Auth, app: web.Application):
    """config.yaml `auth` (config.auth)."""
    statics = _static_keys(section.static_keys)
    cache = KeyCache(section.key_cache_ttl_s, section.key_cache_size)
    app[KEY_CACHE] = cache
    if section.demo_key:
        # build_app appends the ledger's cleanup context before building the chain, so this
        # one runs after it (cleanup contexts start in order) and finds app[LEDGER] set.
        app.cleanup_ctx.append(_demo_key_ctx(app[state.CONFIG].balance.demo_balance_micros))

    def match_static(digest: bytes) -> KeyRecord | None:
        found = None
        for hashed, record in statics:  # compare against every entry: no early exit
            if hmac.compare_digest(hashed, digest):
                found = record
        return found

    async def auth(request: web.Request, ctx: RequestContext, call_next) -> web.StreamResponse:
        headers = _credentials(request, ctx.unit.family in ANTHROPIC)
        if headers is None:
            return await _refuse(request, ctx, call_next, _unauthorized(
                "Two different API keys in one request (Authorization and x-api-key): send one."))
        if not headers:
            return await _refuse(request, ctx, call_next, _unauthorized(
                "Missing API key: send it as 'x-api-key: <key>' (or 'Authorization: Bearer <key>')."
                if ctx.unit.family in ANTHROPIC else
                "Missing API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')."))
        if len(headers) > 1:
            return await _refuse(request, ctx, call_next, APIError(
                400, "More than one Authorization header: send exactly one, 'Authorization: Bearer <key>'.",
                code="duplicate_header"))
        scheme, _, secret = headers[0].strip().partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret or not _TOKEN.match(secret):
            return await _refuse(request, ctx, call_next, _unauthorized(
                "Malformed Authorization header: expected 'Authorization: Bearer <key>'."))
        digest = hashlib.sha256(secret.encode()).digest()  # ASCII: checked by _TOKEN above
        record = match_static(digest) if statics else None
        levels: tuple = ()
        if record is None:
            ledger = app.get(LEDGER)  # this middleware's app: the one whose keys it checks
            if ledger is not None:
                generation = ledger.key_generation
                found = cache.get(digest, generation)
                if found is None:
                    try:
                        record = await ledger.lookup_key(secret)
                        if record is not None and record.levels:
                            levels = await _levels_of(ledger, record)
                    except LedgerUnavailable as exc:  # 503 + Retry-After, from the headers alone
                        return await _refuse(request, ctx, call_next, ledger_unavailable(exc))
                    if record is not None and not record.revoked:
                        cache.put(digest, (record, levels), generation)
                else:
                    record, levels = found
        if record is None or record.revoked or (record.expires_at is not None and record.expired()) or (
                record.presented_previous and _grace_over(record)):
            return await _refuse(request, ctx, call_next, _unauthorized(_why_refused(record)))
        if record.blocked or (levels and any(level.blocked for level in levels)):
            return await _refuse(request, ctx, call_next, _blocked(record, levels))
        ctx.key = record
        ctx.levels = levels
        return await call_next(request, ctx)

    return auth


def _when(seconds: float | None) -> str:
    return datetime.datetime.fromtimestamp(seconds or 0, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _grace_over(record: KeyRecord) -> bool:
    """A rotated key's previous secret past its grace (checked at every request, cached or not)."""
    return record.grace_until is None or time.time() >= record.grace_until


async def _levels_of(ledger: Any, record: KeyRecord) -> tuple:
    """The key's levels' records, top down (org, team, user), for the checks of every request."""
    found = {level.level_id: level for level in await ledger.get_levels(record.levels)}
    return tuple(found[level_id] for level_id in record.levels if level_id in found)


def _blocked(record: KeyRecord, levels: tuple) -> APIError:
    if record.blocked:
        return APIError(403, "This API key is blocked: ask its owner to unblock it.", code="key_blocked",
                        type="permission_error")
    level = next(level for level in levels if level.blocked)
    return APIError(403, f"This API key's {level.kind} ({level.name[:64]}) is blocked.", code="key_blocked",
                    type="permission_error")


def _why_refused(record: KeyRecord | None) -> str:
    """What a refused key is told: only the holder of its secret gets this far, so a revoked,
    expired or rotated key is told which (and since when); an unknown one learns nothing."""
    if record is None:
        return "Incorrect API key provided."
    if record.revoked:
        return "This API key was revoked."
    if record.presented_previous and _grace_over(record):
        return (f"This API key was rotated: its previous secret stopped working at {_when(record.grace_until)}; "
                "use the new one.")
    return f"This API key expired at {_when(record.expires_at)}."


KEY_CACHE = web.AppKey("key_cache", KeyCache)  # middlewares.auth
