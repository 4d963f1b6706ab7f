"""A WebSocket connection's turns and its memory of the last response, sans-I/O (Open Responses
2026-04-24, "WebSocket Transport" and "WebSocket Continuation").

`Continuation` is one connection's state: the id of its last response and that response's whole
context (the input it was created from, then its output items, as input items). A
`response.create` naming that id continues it: the remembered context, then the new items,
become the turn's input. It lives in the connection's memory only: nothing is written anywhere,
and closing the socket forgets it. A failed turn evicts the id it continued from; an id that is
not the last one (an older response, another connection's, an evicted one) is
`previous_response_not_found`, which Codex answers by resending the full request.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import default_code
from proxy.protocol.compaction import without_trigger
from proxy.protocol.events import Event, ResponseEvent

# HTTP/SSE transport fields the spec forbids in a WebSocket `response.create`. A value that
# asks for what the socket does anyway (stream: true, background: false) is let through:
# Codex sends `stream: true`.
_TRANSPORT_FIELDS = {"stream": True, "stream_options": None, "background": False}


class TurnRefused(Exception):
    """A turn refused before it ran: becomes the spec's WebSocket error event."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def event(self) -> dict[str, Any]:
        return error_event(self.status, {"type": "invalid_request_error" if self.status < 500 else "server_error",
                                         "code": self.code, "message": self.message, "param": self.param})


def error_event(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """The spec's WebSocket error envelope around an OpenAI `error` object."""
    error = dict(error)
    if not isinstance(error.get("code"), str):  # the WebSocket envelope requires a string code
        error["code"] = default_code(status)
    if not isinstance(error.get("message"), str):
        error["message"] = "The request failed."
    if not isinstance(error.get("type"), str):  # the openai SDK's ResponseWsError requires it
        error["type"] = "invalid_request_error" if status < 500 else "server_error"
    return {"type": "error", "status": status, "error": error}


def client_param(param: Any, remembered: int) -> Any:
    """An error's `param` about a continued turn's input (the `remembered` items of the last
    response, then the client's own) as the client's message names it: `input[k]` is the
    client's `input[k - remembered]`; a path into the remembered items is `previous_response_id`,
    the field that brought them in. Any other param is the client's already."""
    if not remembered or not isinstance(param, str) or not param.startswith("input["):
        return param
    end = param.find("]")
    index = param[6:end]
    if end < 0 or not index.isdigit():
        return param
    k = int(index)
    if k < remembered:
        return "previous_response_id"
    return f"input[{k - remembered}]{param[end + 1:]}"


def parse_client_event(data: str | bytes) -> dict[str, Any]:
    """A client message -> the `response.create` event it is; TurnRefused(400) otherwise."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise TurnRefused(400, f"The message is not valid JSON: {exc.msg}.", "invalid_json") from None
    return check_client_event(event)


def check_client_event(event: Any) -> dict[str, Any]:
    """A parsed client message -> the `response.create` event it is; TurnRefused(400) otherwise."""
    if not isinstance(event, dict):
        raise TurnRefused(400, "A message must be a JSON object.", "invalid_json")
    kind = event.get("type")
    if kind != "response.create":
        shown = kind if isinstance(kind, str) else orjson.dumps(kind).decode()
        raise TurnRefused(400, f"Unsupported event type '{shown[:80]}': this endpoint accepts 'response.create'.",
                          "invalid_event_type", "type")
    for name, harmless in _TRANSPORT_FIELDS.items():
        if name in event and event[name] != harmless:
            raise TurnRefused(400, f"'{name}' is an HTTP transport field: it must not be sent over the WebSocket.",
                              "invalid_request", name)
    return event


def as_items(value: Any) -> list[Any]:
    """A request's `input` as a list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise TurnRefused(400, "Invalid type for 'input': expected a string or an array.", "invalid_type", "input")


class Continuation:
    """One connection's last response: its id and its full context, in memory only."""

    __slots__ = ("last_id", "context")

    def __init__(self) -> None:
        self.last_id: str | None = None
        self.context: list[Any] = []

    def expand(self, event: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """-> (the turn's HTTP request body, the id it continues or None). A continuation's body
        carries the remembered context then the new items, and no previous_response_id (the
        HTTP path refuses that field: it has no state to find it in)."""
        body = {k: v for k, v in event.items() if k not in ("type", "stream", "stream_options", "background")}
        previous = body.pop("previous_response_id", None)
        if previous is None:
            return body, None
        if not isinstance(previous, str) or previous != self.last_id:
            shown = previous if isinstance(previous, str) else orjson.dumps(previous).decode()
            raise TurnRefused(400, f"Previous response with id '{shown[:100]}' not found.",
                              "previous_response_not_found", "previous_response_id")
        body["input"] = self.context + as_items(body.get("input"))
        return body, previous

    def completed(self, body: dict[str, Any], response: dict[str, Any]) -> None:
        """A turn ended completed or incomplete: its response becomes the one to continue (a
        compaction_trigger has done its work: the context goes on with its compaction item)."""
        self.last_id = response.get("id")
        self.context = without_trigger(as_items(body.get("input"))) + list(response.get("output") or [])

    def failed(self, previous: str | None) -> None:
        """A turn failed (4xx, 5xx, response.failed): the response it continued is evicted."""
        if previous is not None and previous == self.last_id:
            self.forget()

    def forget(self) -> None:
        self.last_id, self.context = None, []


def with_previous(event: Event, previous: str | None) -> Event:
    """An event whose `response` object names the response being created (a ResponseEvent),
    with that response's `previous_response_id` set to the id the turn continued (the HTTP
    path always leaves it null): a copy, the event and its dicts are the assembler's. Any
    other event as it is."""
    if previous is None or not isinstance(event, ResponseEvent):
        return event
    return event.__class__({**event.response, "previous_response_id": previous})
