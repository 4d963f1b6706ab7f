"""The request body, read and parsed once, and its translation, computed once.

Middlewares and the handler all call these; the first caller pays, the rest read the
cached value from the request under its typed key.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from typing import Any

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError, bad_request
from proxy.netguard import check_images, policy_for
from proxy.translate import TranslateOptions, translate_request

try:  # zstd is what Codex sends when it compresses; optional so a bare install still runs
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None

SEALER = web.AppKey("sealer", object)
SAMPLING_DEFAULTS = web.AppKey("sampling_defaults", dict)  # proxy.models.parse_sampling_defaults


def _limits(request: web.Request) -> dict[str, Any]:
    return request.app[state.CONFIG].section("server")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")


def _decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    # Each decoder is bounded by the body limit, so a small bomb cannot expand without end.
    try:
        if encoding == "gzip":
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            d = zlib.decompressobj()
        elif encoding == "zstd":
            if zstandard is None:
                raise APIError(415, "zstd request bodies are not supported here.", code="unsupported_encoding")
            out = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
            if len(out) > limit:
                raise _too_large(limit)
            return out
        else:
            raise APIError(415, f"Unsupported Content-Encoding '{encoding}'.", code="unsupported_encoding")
        out = d.decompress(raw, limit + 1)
        if len(out) > limit or d.unconsumed_tail:
            raise _too_large(limit)
        return out
    except (zlib.error, gzip.BadGzipFile, EOFError) as exc:
        raise bad_request(f"Request body could not be decompressed ({encoding}).", code="invalid_body") from exc
    except APIError:
        raise
    except Exception as exc:  # zstandard.ZstdError and friends
        raise bad_request(f"Request body could not be decompressed ({encoding}).", code="invalid_body") from exc


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
    try:  # request[...] rather than request.get(): one Python frame less (aiohttp's Request is a Mapping)
        return request[state.BODY]
    except KeyError:
        pass
    limits = _limits(request)
    limit = int(limits["max_body_bytes"])
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    content = request.content
    if content.is_eof():
        # The whole body is buffered already (a small body arrives with the headers): take
        # it without a timer or an await; the same bytes the loop below would read.
        raw = content.read_nowait(limit + 1)
    else:
        try:
            async with asyncio.timeout(float(limits["body_read_timeout"])):
                # read(n) returns what has arrived so far, not n bytes: loop to the end of the body.
                buf = bytearray()
                while len(buf) <= limit:
                    chunk = await content.read(limit + 1 - len(buf))
                    if not chunk:
                        break
                    buf += chunk
                raw = bytes(buf)
        except TimeoutError:
            raise APIError(408, "The request body arrived too slowly.", code="request_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limit) from None
    if len(raw) > limit:
        raise _too_large(limit)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raw = _decompress(raw, encoding, limit)
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc.msg}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    depth = int(limits["max_json_depth"])
    # Every nesting level opens with its own { or [, so a body with no more of them than the
    # limit cannot nest deeper than it: the walk is only for the rest.
    if raw.count(b"{") + raw.count(b"[") > depth and not _depth_ok(body, depth):
        raise bad_request(f"The request body nests deeper than {limits['max_json_depth']} levels.", code="too_deep")
    request[state.BODY] = body
    return body


async def translation(request: web.Request):
    """The request's `Translation`, translated once (and after any middleware edits of the body)."""
    try:
        return request[state.TRANSLATION]
    except KeyError:
        pass
    body = await read_json(request)
    sealer = request.app.get(SEALER)
    limits = _limits(request)
    # Size checks before translating: a hostile body should cost a len(), not a translation.
    if isinstance(body.get("input"), list) and len(body["input"]) > int(limits["max_input_items"]):
        raise bad_request(f"input has more than {limits['max_input_items']} items.", param="input", code="too_many_items")
    if isinstance(body.get("tools"), list) and len(body["tools"]) > int(limits["max_tools"]):
        raise bad_request(f"More than {limits['max_tools']} tools.", param="tools", code="too_many_tools")
    from proxy.forwarder import POOL  # proxy.forwarder imports this module

    pool = request.app.get(POOL)
    options = TranslateOptions(unseal=sealer.unseal if sealer is not None else None,
                               served=pool.serves if pool is not None else None,
                               sampling_defaults=request.app.get(SAMPLING_DEFAULTS))
    result = translate_request(body, options)
    # The model server fetches input_image URLs: refuse private/loopback/metadata targets first.
    await check_images(policy_for(request.app), result.chat)
    state.notices(request).extend(result.notices)
    request[state.TRANSLATION] = result
    return result
