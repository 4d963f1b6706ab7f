"""The sans-I/O cores of the WebSocket transport and of compaction: a connection's memory
(proxy.protocol.continuation) and the cut of a window (proxy.protocol.compaction)."""

from __future__ import annotations

import orjson
import pytest

from proxy.protocol.compaction import split_window
from proxy.protocol.continuation import Continuation, TurnRefused, client_param, parse_client_event, with_previous


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


def test_with_previous_sets_only_the_responses_own_field():
    text = 'say "previous_response_id":null please'
    data = orjson.dumps({"type": "response.created", "response": {"previous_response_id": None, "instructions": text}})
    patched = orjson.loads(with_previous(data, "resp_9"))
    assert patched["response"] == {"previous_response_id": "resp_9", "instructions": text}
    assert with_previous(data, None) is data


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


def test_the_cut_keeps_the_last_user_turn_and_never_splits_a_call_from_its_output():
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c", "output": "x"}
    window = [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c"), call, out, _msg("assistant", "d")]
    assert split_window(window, 8) == (window[:2], window[2:])
    older, recent = split_window(window, 2)  # the last two items would start on the tool output
    assert recent == [call, out, _msg("assistant", "d")] and older == window[:3]
    assert split_window([_msg("user", "only")], 8) == ([], [_msg("user", "only")])
    assert split_window([_msg("user", "a"), _msg("user", "b")], 8) == ([_msg("user", "a")], [_msg("user", "b")])
