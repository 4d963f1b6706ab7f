"""The prepare phase: the request body, read and parsed once, checked, and translated once.

`read_json` reads the body (decoded, bounded, parsed) into the request's context; a custom
middleware may call it early, prepare then finds it there. `prepare_phase` is the phase
(middlewares/__init__.py): body, the key's model, the body checks (stateless, tools), the
size limits, then one frozen Translation and the image-URL guard.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError, bad_request
from proxy.http.passthrough_handler import passthrough_translate, policy_for
from proxy.http.turn import TURN
from proxy.ledger.base import models_allow
from proxy.policy.netguard import check_images
from proxy.protocol.seal import binding
from proxy.protocol.translate import TranslateOptions, Translation, translate_request
from proxy.state import SAMPLING_DEFAULTS, SEALER, RequestContext
from proxy.units import MODELS, SIZES, TRANSLATE, Unit

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Server

try:  # zstd is what Codex sends when it compresses; optional so a bare install still runs
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None  # type: ignore[assignment]  # checked before each use


def _limits(request: web.Request) -> Server:
    return request.app[state.CONFIG].server  # config.yaml `server`: the bounds on a request


def _too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")


def _unread(request: web.Request, exc: APIError) -> APIError:
    """`exc`, for a refusal that leaves part of the body unread: when more is still arriving,
    the connection is marked closing (aiohttp drops the rest unparsed instead of draining it
    through its parser) and the answer says so."""
    if not request.content.is_eof():
        request.protocol.close()
        exc.headers["Connection"] = "close"
    return exc


def _inflate(wbits: int, members: bool):
    """A zlib-family decoder: `members` lets a gzip body be several members back to back
    (RFC 1952), each decoded in turn within the same output budget."""

    def decode(raw: bytes, cap: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        data = raw
        while True:
            d = zlib.decompressobj(wbits)
            out = d.decompress(data, cap - size)  # cap - size > 0 here: 0 would mean "no bound"
            parts.append(out)
            size += len(out)
            if size >= cap:
                break
            if not d.eof:
                raise ValueError("truncated stream")
            data = d.unused_data
            if not data:
                break
            if not members:
                raise ValueError("data after the end of the stream")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    return decode


def _unzstd(raw: bytes, cap: int) -> bytes:
    if zstandard is None:
        raise APIError(415, "zstd request bodies are not supported here.", code="unsupported_encoding")
    # max_window_size: a frame header may ask for a window of up to 2 GB, which the decoder
    # allocates before writing a byte. A window larger than the body gains nothing, so a
    # frame that declares one beyond the limit is refused (400) instead.
    window = max(1 << 23, 1 << cap.bit_length())
    reader = zstandard.ZstdDecompressor(max_window_size=window).stream_reader(raw, read_across_frames=True)
    parts: list[bytes] = []
    size = 0
    with reader:
        while size < cap:  # read(n) may return less than n before the end (a frame boundary)
            out = reader.read(cap - size)
            if not out:
                break
            parts.append(out)
            size += len(out)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# Content-Encoding -> decoder(raw, cap): returns the decoded body, or its first `cap` bytes
# when it is longer, and never holds more than `cap` decoded bytes at any time. A decoder
# added here must keep that bound (tests/http/test_body_bombs.py sends each one a bomb).
DECODERS = {
    "gzip": _inflate(16 + zlib.MAX_WBITS, members=True),
    "x-gzip": _inflate(16 + zlib.MAX_WBITS, members=True),  # RFC 9110 8.4.1.3: the same as gzip
    "deflate": _inflate(zlib.MAX_WBITS, members=False),
    "zstd": _unzstd,
}


def _decompress(raw: bytes, headers: list[str], limit: int) -> bytes:
    codings = [c for h in headers for c in (part.strip().lower() for part in h.split(","))
               if c not in ("", "identity")]
    if not codings:
        return raw
    if len(codings) > 1:
        # Each layer would multiply the expansion; no client of this API stacks them.
        raise APIError(415, f"Stacked Content-Encoding ({', '.join(codings)[:100]}) is not supported: "
                            "send one encoding.", code="unsupported_encoding")
    encoding = codings[0]
    decoder = DECODERS.get(encoding)
    if decoder is None:
        raise APIError(415, f"Unsupported Content-Encoding '{encoding[:64]}'.", code="unsupported_encoding")
    try:
        out = decoder(raw, limit + 1)
    except APIError:
        raise
    except Exception as exc:  # zlib.error, ValueError, zstandard.ZstdError and friends
        raise bad_request(f"Request body could not be decompressed ({encoding}).", code="invalid_body") from exc
    if len(out) > limit:
        raise _too_large(limit)
    return out


def _depth_ok(value: Any, limit: int) -> bool:
    # Iterative, so a hostile nesting depth costs a loop, not the C stack.
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return True


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON body, read once (ctx.body), within its unit's body bound."""
    ctx = request[state.CONTEXT]
    body = ctx.body
    if body is None:
        limits = _limits(request)
        body = ctx.body = await _read_body(request, limits, getattr(limits, ctx.unit.body_limit))
    return body


async def _read_raw(request: web.Request, limits: Any, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise _unread(request, _too_large(limit))
    content = request.content
    if content.is_eof():
        # The whole body is buffered already (a small body arrives with the headers): take
        # it without a timer or an await; the same bytes the loop below would read.
        return content.read_nowait(limit + 1)
    try:
        async with asyncio.timeout(limits.body_read_timeout):
            # read(n) returns what has arrived so far, not n bytes: loop to the end of the body.
            buf = bytearray()
            while len(buf) <= limit:
                chunk = await content.read(limit + 1 - len(buf))
                if not chunk:
                    break
                buf += chunk
            return bytes(buf)
    except TimeoutError:
        raise _unread(request, APIError(408, "The request body arrived too slowly.",
                                        code="request_timeout")) from None
    except web.HTTPRequestEntityTooLarge:
        raise _unread(request, _too_large(limit)) from None


async def _read_body(request: web.Request, limits: Any, limit: int) -> dict[str, Any]:
    turn = request.get(TURN)
    if turn is not None:  # a transport's turn: its body is in memory, not on the connection
        raw = turn.body
        if len(raw) > limit:
            raise _too_large(limit)
    else:
        raw = await _read_raw(request, limits, limit)
        if len(raw) > limit:
            raise _unread(request, _too_large(limit))
    encodings = request.headers.getall("Content-Encoding", None)
    if encodings is not None:
        raw = _decompress(raw, encodings, limit)
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc.msg}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    depth = limits.max_json_depth
    # Every nesting level opens with its own { or [, so a body with no more of them than the
    # limit cannot nest deeper than it: the walk is only for the rest.
    if raw.count(b"{") + raw.count(b"[") > depth and not _depth_ok(body, depth):
        raise bad_request(f"The request body nests deeper than {limits.max_json_depth} levels.", code="too_deep")
    return body


BodyCheck = Callable[[RequestContext, dict[str, Any]], dict[str, Any]]
# The rest of a unit's chain, as a phase calls it (middlewares.Phases builds the chains).
Next = Callable[[web.Request, RequestContext], Awaitable[web.StreamResponse]]

def _check_model(ctx: RequestContext, body: dict[str, Any], pool: Any, groups: dict[str, tuple[str, ...]]) -> None:
    """A key limited to some models (auth) may use only those: 403 for the others. An entry
    group:<name> stands for config.yaml's model_groups[name]."""
    key = ctx.key
    if key is None or (key.allowed_models is None and not ctx.levels):
        return
    model = body.get("model")
    if not isinstance(model, str):
        return
    served = pool.serves if pool is not None else None
    if key.allowed_models is not None and not models_allow(_expand(key.allowed_models, groups), model, served):
        raise APIError(403, f"This API key may not use the model '{model[:128]}'.",
                       code="model_not_allowed", param="model")
    for level in ctx.levels:  # every level above the key must allow it too
        if level.allowed_models is not None and not models_allow(_expand(level.allowed_models, groups), model,
                                                                 served):
            raise APIError(403, f"This API key's {level.kind} ({level.name[:64]}) may not use the model "
                           f"'{model[:128]}'.", code="model_not_allowed", param="model")


def _expand(allowed: tuple[str, ...], groups: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The allowed models with each group:<name> replaced by the group's models (an unknown
    group stands for none)."""
    if not any(m.startswith("group:") for m in allowed):
        return allowed
    out: list[str] = []
    for m in allowed:
        out.extend(groups.get(m[6:], ()) if m.startswith("group:") else (m,))
    return tuple(out)


def _check_sizes(body: dict[str, Any], limits: Any, items: str = "input") -> None:
    # Before translating: a hostile body should cost a len(), not a translation.
    if isinstance(body.get(items), list) and len(body[items]) > limits.max_input_items:
        raise bad_request(f"{items} has more than {limits.max_input_items} items.", param=items,
                          code="too_many_items")
    if isinstance(body.get("tools"), list) and len(body["tools"]) > limits.max_tools:
        raise bad_request(f"More than {limits.max_tools} tools.", param="tools", code="too_many_tools")


def _decoded_turn(request: web.Request, ctx: RequestContext, limits: Any, body: dict[str, Any]) -> dict:
    """A transport's message -> the request body it stands for (proxy.http.turn.Turn.decode), and
    the unit it asks for: one of the turn's declared variants (a warm-up), with that variant's
    handler and body bound."""
    turn = request.get(TURN)
    if turn is None or turn.decode is None:
        return body
    body, asked = turn.decode(body)
    if asked in ctx.unit.variants:
        ctx.unit = asked
        ctx.endpoint = turn.handlers.get(asked, ctx.endpoint)
        limit = getattr(limits, asked.body_limit)
        if len(turn.body) > limit:
            raise _too_large(limit)
    elif asked != ctx.unit:
        raise RuntimeError(f"{asked.name} is not a variant of {ctx.unit.name}")
    return body


def prepare_phase(app: web.Application, body_checks: list[BodyCheck]) -> Callable[[Unit, dict[str, Next]], Next]:
    """The body phase of `app`, made per unit of work (proxy.units) by middlewares.Phases:
    the body, sizes, models and translate steps that unit declares, applying `body_checks` (the
    enabled stateless and tools policies, in that order) between reading and translating.
    Translating is the last step: nothing after it edits the body, so the one Translation is
    the request. `rest`: the chain after the body phase, for the unit and for each variant its
    body may ask for (a socket message that is a warm-up)."""
    checks = tuple(body_checks)

    def checked(unit: Unit, rest: Next, compaction: tuple[Unit, Next] | None) -> Next:
        """What follows the read for `unit`: only the steps it declares, chosen here, once.
        `compaction`: its compaction_trigger variant and that variant's chain, taken when the
        translation made the request a compaction's."""
        sizes, models = SIZES in unit.phases, MODELS in unit.phases
        items = unit.items
        translate = None
        if TRANSLATE in unit.phases:
            translate = _passthrough_step(app) if unit.family else _responses_step(app, checks)

        async def after_body(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
            body = ctx.body
            assert body is not None  # read by the body phase
            if sizes:
                _check_sizes(body, _limits(request), items)
            if models:
                _check_model(ctx, body, app.get(state.POOL), app[state.CONFIG].model_groups)
            if translate is not None:
                await translate(ctx, body)
                if compaction is not None and isinstance(t := ctx.translation, Translation) and \
                        t.compaction is not None:
                    ctx.unit = compaction[0]
                    return await compaction[1](request, ctx)
            return await rest(request, ctx)

        return after_body

    def for_unit(unit: Unit, rest: dict[str, Next]) -> Next:
        variant = unit.compaction_variant()
        compaction = (variant, rest[variant.name]) if variant is not None else None
        # The unit and the variants its message may ask for (a warm-up); not the compaction
        # variant, which its translation asks for, after these steps.
        after = {v.name: checked(v, rest[v.name], compaction if v is unit else None)
                 for v in (unit, *unit.variants) if not v.compaction}
        only = after[unit.name] if len(after) == 1 else None
        body_limit = unit.body_limit

        async def prepare(request: web.Request, ctx: RequestContext) -> web.StreamResponse:
            limits = _limits(request)
            body = ctx.body
            if body is None:  # read once: a custom middleware may have read it (read_json) already
                body = await _read_body(request, limits, getattr(limits, body_limit))
            ctx.body = _decoded_turn(request, ctx, limits, body)
            if only is not None:
                return await only(request, ctx)
            return await after[ctx.unit.name](request, ctx)  # the unit, or the variant its message asked for

        return prepare

    return for_unit


def _passthrough_step(app: web.Application) -> Callable[[RequestContext, dict[str, Any]], Awaitable[None]]:
    async def translate(ctx: RequestContext, body: dict[str, Any]) -> None:
        # Another API of the model server: its body rebuilt from what was priced (proxy.http.passthrough_handler).
        ctx.translation = await passthrough_translate(app, ctx, body)

    return translate


def _responses_step(app: web.Application, checks: tuple[BodyCheck, ...]) \
        -> Callable[[RequestContext, dict[str, Any]], Awaitable[None]]:
    async def translate(ctx: RequestContext, body: dict[str, Any]) -> None:
        for check in checks:
            body = check(ctx, body)
        ctx.body = body
        sealer = app.get(SEALER)
        compact = app[state.COMPACT_SETTINGS]
        pool = app.get(state.POOL)
        options = TranslateOptions(unseal=sealer.bound(binding(ctx.key))[1] if sealer is not None else None,
                                   served=pool.serves if pool is not None else None,
                                   sampling_defaults=app.get(SAMPLING_DEFAULTS),
                                   compaction=None if sealer is None else compact.ask)
        result = translate_request(body, options)
        # The model server fetches input_image URLs: refuse private/loopback/metadata targets first.
        await check_images(policy_for(app), result.chat)
        ctx.notices.extend(result.notices)
        ctx.translation = result

    return translate
