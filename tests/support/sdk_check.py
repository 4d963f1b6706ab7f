"""Two judges of what the proxy emits: the openai SDK's types, and the Open Responses
specification's published types (PyPI openresponses-types, generated from its OpenAPI).

The spec's types are applied strictly: JSON-mode strict validation (no coercion, every
required field present, closed enums), and every field they do not define must be one of
the documented extensions below (the spec, "Extending existing schemas", lets an
implementation add fields; an undocumented one fails the test). OpenAI-only shapes a
client opts into by sending them (custom and namespace tools, custom_tool_call items and
their events) are outside the spec and are judged by the openai SDK alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import httpx2
import orjson
import pydantic
from openai.types.responses import Response, ResponseStreamEvent
from openresponses_types import types as spec_types

_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _spec_event_classes() -> dict[str, type[pydantic.BaseModel]]:
    found = {}
    for name in dir(spec_types):
        cls = getattr(spec_types, name)
        if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel) and name.endswith("StreamingEvent"):
            (member,) = list(cls.model_fields["type"].annotation)
            found[member.value] = cls
    return found


SPEC_EVENTS = _spec_event_classes()

# Fields beyond the spec's types, each documented (README, "Open Responses"): paths from a
# Response or an output item, [] for any list index.
SPEC_EXTENSIONS = {
    # the 004 doc's AI-content markers
    "ai_generated", "ai_notice",
    # the openai SDK's Response fields the proxy echoes (null or as sent)
    "user", "conversation", "prompt", "prompt_cache_retention", "prompt_cache_options",
    "prompt_cache_diagnostics", "input_transformations", "moderation", "tool_usage", "image", "access_programs",
    # response.failed: when and whether to retry (the openai SDKs read these), and the original
    # error code when `code` is outside the openai SDK's closed set
    "retry_after_ms", "x_should_retry", "error.type",
    "usage.input_tokens_details.cache_write_tokens",
    # items: a reasoning item's status (OpenAI's), a namespaced call's namespace (Codex)
    "status", "namespace", "encrypted_content",
}
# Fields beyond the spec's types on a WebSocket event itself (not in its response or item),
# documented (README, "WebSocket transport"): a turn's carried headers (its notices, the HTTP
# x-token-notice) on its first event or its error event; a refused turn's Retry-After.
WS_EVENT_EXTENSIONS = {"headers", "error.retry_after"}
_OPENAI_ONLY_ITEMS = frozenset({"custom_tool_call", "custom_tool_call_output"})
_OPENAI_ONLY_EVENTS = re.compile(r"^response\.custom_tool_call_input\.")


def _extras(data: Any, dumped: Any, path: str, out: list[str]) -> None:
    if isinstance(data, dict) and isinstance(dumped, dict):
        for key, value in data.items():
            sub = f"{path}.{key}" if path else key
            if key not in dumped:
                out.append(sub)
            else:
                _extras(value, dumped[key], sub, out)
    elif isinstance(data, list) and isinstance(dumped, list):
        for a, b in zip(data, dumped):
            _extras(a, b, path + "[]", out)


def _spec_view(response: dict[str, Any]) -> dict[str, Any]:
    """The response without the OpenAI-only shapes the client asked for (judged by the SDK)."""
    view = dict(response)
    view["tools"] = [t for t in response.get("tools") or [] if t.get("type") == "function"]
    view["output"] = [i for i in response.get("output") or [] if i.get("type") not in _OPENAI_ONLY_ITEMS]
    if isinstance(view.get("tool_choice"), dict) and view["tool_choice"].get("type") not in ("function",
                                                                                            "allowed_tools"):
        view["tool_choice"] = "auto"
    return view


def _check_extras(data: dict, model: pydantic.BaseModel, prefixes: tuple[str, ...],
                  own: frozenset[str] | set[str] = frozenset()) -> None:
    """`own`: extension paths allowed on the object itself (not under one of `prefixes`)."""
    extra: list[str] = []
    _extras(data, model.model_dump(mode="json", by_alias=True, exclude_unset=True), "", extra)
    unknown = []
    for path in extra:
        if path in own:
            continue
        rel = path
        for prefix in prefixes:
            if rel.startswith(prefix):
                rel = rel[len(prefix):]
                break
        if rel.startswith(("tools[].", "tool_choice.", "text.")):
            continue  # echoed as the client sent them, with whatever else it put in them
        rel = re.sub(r"^output\[\]\.", "", rel)
        if rel not in SPEC_EXTENSIONS:
            unknown.append(path)
    assert not unknown, f"fields outside the Open Responses spec and not documented as extensions: {unknown}"


def validate_spec_response(data: dict[str, Any]) -> spec_types.ResponseResource:
    view = _spec_view(data)
    model = spec_types.ResponseResource.model_validate_json(orjson.dumps(view), strict=True)
    _check_extras(view, model, ())
    return model


def validate_spec_compaction(data: dict[str, Any]) -> spec_types.CompactResource:
    """A /v1/responses/compact answer by the spec's CompactResource (strict, no undocumented field)."""
    model = spec_types.CompactResource.model_validate_json(orjson.dumps(data), strict=True)
    _check_extras(data, model, ())
    return model


def validate_spec_event(data: dict[str, Any]) -> pydantic.BaseModel | None:
    """The event by the spec's types; None for an OpenAI-only event (custom tool input)."""
    kind = data["type"]
    item = data.get("item")
    if _OPENAI_ONLY_EVENTS.match(kind) or (isinstance(item, dict) and item.get("type") in _OPENAI_ONLY_ITEMS):
        return None
    cls = SPEC_EVENTS.get(kind)
    assert cls is not None, f"event type {kind!r} is not in the Open Responses spec"
    view = dict(data, response=_spec_view(data["response"])) if "response" in data else data
    model = cls.model_validate_json(orjson.dumps(view), strict=True)
    _check_extras(view, model, ("response.", "item."), WS_EVENT_EXTENSIONS)
    return model


def validate_spec_ws_error(data: dict[str, Any]) -> spec_types.WebSocketErrorEvent:
    """A WebSocket error event by the spec's WebSocketErrorEvent (strict, no undocumented field)."""
    model = spec_types.WebSocketErrorEvent.model_validate_json(orjson.dumps(data), strict=True)
    _check_extras(data, model, (), WS_EVENT_EXTENSIONS)
    return model


def validate_response(data: dict[str, Any]) -> Response:
    validate_spec_response(data)
    return Response.model_validate(data, strict=False)


def validate_event(data: dict[str, Any]):
    validate_spec_event(data)
    event = _EVENT.validate_python(data)
    assert event.type == data["type"]
    return event


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """Parse SSE bytes as a strict client would: `event:` must equal the payload's type, every
    event passes the Open Responses spec's types, and a stream that reached its terminal event
    ends with `data: [DONE]` (the spec's close)."""
    events = []
    done = False
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not block.strip():
            continue
        assert not done, "nothing may follow data: [DONE]"
        name = None
        data = b""
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data += line[5:].strip()
        if data == b"[DONE]" and name is None:
            assert events and events[-1]["type"] in _TERMINAL, "[DONE] comes right after the terminal event"
            done = True
            continue
        payload = orjson.loads(data)
        assert name == payload["type"], (name, payload["type"])
        validate_spec_event(payload)
        events.append(payload)
    assert done or not events or events[-1]["type"] not in _TERMINAL, "the stream ended without data: [DONE]"
    return events


def check_sequence(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Validate every event and the sequence rules a client relies on; return the final response."""
    for event in events:
        validate_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    terminal = events[-1]
    assert terminal["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert sum(e["type"] in ("response.completed", "response.incomplete", "response.failed") for e in events) == 1
    response_id = events[0]["response"]["id"]
    assert terminal["response"]["id"] == response_id
    added = {e["item"]["id"]: e["output_index"] for e in events if e["type"] == "response.output_item.added"}
    done = {e["item"]["id"]: e["output_index"] for e in events if e["type"] == "response.output_item.done"}
    if terminal["type"] == "response.failed":  # a failure may cut items short: no done for those
        assert done.items() <= added.items()
    else:
        assert added == done, "every added item is done, at the same output_index"
    assert sorted(added.values()) == list(range(len(added))), "output indexes are 0..n-1 without collision"
    final = terminal["response"]
    validate_response(final)
    return final


def normalise(response: dict[str, Any]) -> dict[str, Any]:
    """Drop what differs between two runs of the same script (ids, clocks)."""
    data = orjson.loads(orjson.dumps(response))
    data.pop("id", None)
    data.pop("created_at", None)
    data.pop("completed_at", None)
    for item in data.get("output") or []:
        item.pop("id", None)
        item.pop("encrypted_content", None)
    return data


def validate_sdk_response(data: dict[str, Any]) -> Response:
    """The openai SDK's judgement alone: for a Response the SDK parsed and dumped again (its dump
    is not what the proxy sent; the bytes it parsed were judged by SpecCheckingTransport)."""
    return Response.model_validate(data, strict=False)


class _TeeStream(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, done: Any) -> None:
        self._inner = inner
        self._done = done
        self._buf = bytearray()

    async def __aiter__(self):
        async for chunk in self._inner:
            self._buf += chunk
            yield chunk
        self._done(bytes(self._buf))  # read to the end: a stream cut short by the client is not judged

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class SpecLog:
    failures: list[str] = field(default_factory=list)  # verdicts against the spec
    stream_ends: list[bytes] = field(default_factory=list)  # the last bytes of each stream read to its end


class SpecCheckingTransport(httpx2.AsyncBaseTransport):
    """The openai client's transport in the tests: every 200 answer of POST /v1/responses, as the
    bytes the proxy sent, is judged by the Open Responses spec's types (a JSON Response, or
    every event of a stream and its closing data: [DONE]). A verdict against it raises in the
    client and is kept in the log (tests/conftest.py fails the test on any)."""

    def __init__(self, log: SpecLog) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self.log = log

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if request.method != "POST" or request.url.path != "/v1/responses" or response.status_code != 200:
            return response
        kind = response.headers.get("content-type", "")

        def judge(body: bytes) -> None:
            try:
                if kind.startswith("text/event-stream"):
                    self.log.stream_ends.append(body[-32:])
                    events = parse_sse(body)
                    for event in events:
                        validate_spec_event(event)
                    assert events and events[-1]["type"] in _TERMINAL, "the stream has no terminal event"
                else:
                    data = orjson.loads(body)
                    if isinstance(data, dict) and data.get("object") == "response.compaction":
                        validate_spec_compaction(data)
                    else:
                        validate_spec_response(data)
            except Exception as exc:  # noqa: BLE001 - every verdict is recorded, whatever raised it
                self.log.failures.append(f"{type(exc).__name__}: {exc}")
                raise

        response.stream = _TeeStream(response.stream, judge)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def validate_sdk_compaction(data: dict[str, Any]) -> "CompactedResponse":
    """A /v1/responses/compact answer by the openai SDK's own types, as its CompactedResponse
    says it is ("a list of all user messages, followed by a single compaction item"): the
    answer and its compaction item by CompactedResponse.model_validate, each user message
    before it by ResponseInputMessageItem (the SDK's type of a user message item with an id and
    a status). CompactedResponse.output is typed ResponseOutputItem, whose only message is the
    assistant's: no user message, OpenAI's own included, validates there. A window with nothing
    to summarize comes back without a compaction item."""
    from openai.types.responses import CompactedResponse, ResponseInputMessageItem

    output = data["output"]
    compactions = [i for i, item in enumerate(output) if item.get("type") == "compaction"]
    assert compactions in ([], [len(output) - 1]), [item.get("type") for item in output]
    for message in output[:-1] if compactions else output:
        assert ResponseInputMessageItem.model_validate(message).role == "user", message
    return CompactedResponse.model_validate({**data, "output": output[-1:] if compactions else []})
