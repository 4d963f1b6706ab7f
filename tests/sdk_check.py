"""The openai SDK as the judge: its own types validate what the proxy emits."""

from __future__ import annotations

from typing import Any

import orjson
import pydantic
from openai.types.responses import Response, ResponseStreamEvent

_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def validate_response(data: dict[str, Any]) -> Response:
    return Response.model_validate(data, strict=False)


def validate_event(data: dict[str, Any]):
    event = _EVENT.validate_python(data)
    assert event.type == data["type"]
    return event


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """Parse SSE bytes as a strict client would: `event:` must equal the payload's type."""
    events = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not block.strip():
            continue
        name = None
        data = b""
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data += line[5:].strip()
        payload = orjson.loads(data)
        assert name == payload["type"], (name, payload["type"])
        events.append(payload)
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
