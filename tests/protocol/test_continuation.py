"""The sans-I/O cores of the WebSocket transport and of compaction: a connection's memory
(proxy.protocol.continuation), the messages a compacted window keeps and the place of a
compaction_trigger (proxy.protocol.compaction)."""

from __future__ import annotations

import orjson
import pytest

from proxy.errors import APIError
from proxy.protocol.compaction import kept_user_messages, take_trigger
from proxy.protocol.continuation import Continuation, TurnRefused, client_param, parse_client_event, with_previous
from proxy.protocol.events import OutputItemAdded, ResponseCompleted, ResponseCreated


def test_a_continuation_is_the_remembered_context_then_the_new_items():
    memory = Continuation()
    body, previous = memory.expand({"type": "response.create", "model": "m", "input": "hi", "stream": True})
    assert previous is None and body == {"model": "m", "input": "hi"}
    memory.completed(body, {"id": "resp_1", "output": [{"type": "message", "role": "assistant", "content": []}]})
    body, previous = memory.expand({"type": "response.create", "model": "m", "previous_response_id": "resp_1",
                                    "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]})
    assert previous == "resp_1" and "previous_response_id" not in body
    assert [i.get("type") for i in body["input"]] == ["message", "message", "function_call_output"]
    assert body["input"][0] == {"type": "message", "role": "user", "content": "hi"}


def test_only_the_last_response_is_kept_and_a_failed_continuation_evicts_it():
    memory = Continuation()
    memory.completed({"input": "a"}, {"id": "resp_1", "output": []})
    memory.completed({"input": "b"}, {"id": "resp_2", "output": []})
    with pytest.raises(TurnRefused) as refused:
        memory.expand({"type": "response.create", "previous_response_id": "resp_1"})
    assert refused.value.code == "previous_response_not_found" and refused.value.status == 400
    memory.failed(None)  # a turn that continued nothing leaves the last response alone
    memory.failed("resp_1")
    assert memory.expand({"type": "response.create", "previous_response_id": "resp_2"})[1] == "resp_2"
    memory.failed("resp_2")
    with pytest.raises(TurnRefused):
        memory.expand({"type": "response.create", "previous_response_id": "resp_2"})


@pytest.mark.parametrize("message, code", [
    (b"{", "invalid_json"), (b"3", "invalid_json"), (b'{"type": 1}', "invalid_event_type"),
    (b'{"type": "response.create", "background": true}', "invalid_request"),
    (b'{"type": "response.create", "stream": false}', "invalid_request"),
])
def test_client_events_that_are_refused(message, code):
    with pytest.raises(TurnRefused) as refused:
        parse_client_event(message)
    event = refused.value.event()
    assert event["type"] == "error" and event["status"] == 400 and event["error"]["code"] == code


def test_with_previous_sets_only_the_responses_own_field_on_a_copy():
    text = 'say "previous_response_id":null please'
    response = {"id": "resp_1", "previous_response_id": None, "instructions": text}
    for kind in (ResponseCreated, ResponseCompleted):
        event = kind(response)
        patched = with_previous(event, "resp_9")
        assert type(patched) is kind  # the same event type, a copy
        assert patched.response == {"id": "resp_1", "previous_response_id": "resp_9", "instructions": text}
        assert list(patched.response) == list(response)  # the field keeps its place
        assert response["previous_response_id"] is None and event.response is response  # the assembler's, unchanged
        assert with_previous(event, None) is event
    item = OutputItemAdded(0, {})
    assert with_previous(item, "resp_9") is item


@pytest.mark.parametrize("param, remembered, told", [
    ("input[5].content[0].text", 3, "input[2].content[0].text"),
    ("input[3]", 3, "input[0]"),
    ("input[12].role", 3, "input[9].role"),
    ("input[2].encrypted_content", 3, "previous_response_id"),  # in the remembered items
    ("input", 3, "input"),
    ("tools[0].name", 3, "tools[0].name"),
    ("input[7].x", 0, "input[7].x"),
    ("input[x]", 3, "input[x]"),
    (None, 3, None),
])
def test_an_errors_param_names_the_clients_own_items(param, remembered, told):
    assert client_param(param, remembered) == told


def _msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def test_a_compacted_window_keeps_the_latest_user_messages_as_item_resources():
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c", "output": "x"}
    window = [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c"), call, out, _msg("assistant", "d")]
    kept, whole = kept_user_messages(window, 8)
    assert not whole and [k["content"] for k in kept] == [[{"type": "input_text", "text": t}] for t in "ac"]
    assert all(k["type"] == "message" and k["role"] == "user" and k["status"] == "completed"
               and k["id"].startswith("msg_") for k in kept)
    kept, _ = kept_user_messages(window, 1)
    assert [k["content"][0]["text"] for k in kept] == ["c"]
    parts = [{"type": "input_text", "text": "p"}, {"type": "input_image", "image_url": "https://x/y.png"}]
    kept, whole = kept_user_messages([{"type": "message", "id": "msg_7", "role": "user", "content": parts}], 8)
    assert whole and kept == [{"type": "message", "id": "msg_7", "status": "completed", "role": "user",
                               "content": parts}]
    assert kept_user_messages([], 8) == ([], True)
    assert kept_user_messages([_msg("user", "a"), _msg("user", "b")], 1)[1] is False


def test_a_compaction_trigger_is_taken_off_the_end_and_refused_anywhere_else():
    trigger = {"type": "compaction_trigger"}
    items = [_msg("user", "a"), _msg("assistant", "b")]
    assert take_trigger([*items, trigger]) == (items, True)
    assert take_trigger(items) == (items, False) and take_trigger("hi") == ("hi", False)
    with pytest.raises(APIError) as info:
        take_trigger([items[0], trigger, items[1]])
    assert info.value.status == 400 and info.value.param == "input[1].type"
    memory = Continuation()  # a continuation of the compaction goes on from its item, not the trigger
    memory.completed({"input": [*items, trigger]}, {"id": "resp_1", "output": [{"type": "compaction", "id": "cmp_1",
                                                                                "encrypted_content": "rp2.x"}]})
    assert [i.get("type") for i in memory.context] == [None, None, "compaction"]
