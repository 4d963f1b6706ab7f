"""Bad input, by property: any JSON value as a body, and mutations of Codex-, SDK- and
agent-shaped bodies, give either a valid upstream request or a 4xx in the envelope.

Twice: through the pure translation (no I/O), and through live HTTP against the proxy with
the full default chain (auth, limits, tools, balance...) in front of the simulator. Bounded:
FUZZ_TRANSLATE examples per shape through translate_request, FUZZ_HTTP per live test.
"""

from __future__ import annotations

import copy
import json

import orjson
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.errors import APIError
from proxy.protocol.translate import TranslateOptions, Translation, translate_request
from tests.support.live import LiveStack
from tests.support.sdk_check import parse_sse

FUZZ_TRANSLATE = 300
FUZZ_HTTP = 100  # per live test; four live tests -> 400 HTTP bodies

CHAT_ROLES = {"system", "user", "assistant", "tool"}

def _json(max_int: int):
    return st.recursive(
        st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=max_int)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
        lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
        max_leaves=25,
    )


# Over HTTP, integers past 64 bits too (the body parser must refuse them with a 400); through
# the pure translation, only what that parser (orjson) can produce.
json_values = _json(2**70)
parsed_json_values = _json(2**64 - 1)

CODEX = {
    "model": "tiny-org/tiny-model",
    "instructions": "You are Codex, a coding agent.",
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions/>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "I will run ls."}],
         "content": None, "encrypted_content": None},
        {"type": "function_call", "name": "shell", "arguments": "{\"command\":[\"ls\"]}", "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nproxy"},
        {"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch", "call_id": "call_2"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "ok"},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Runs a command",
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                        "required": ["command"], "additionalProperties": False}, "strict": False},
        {"type": "custom", "name": "apply_patch", "description": "Patch files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "web_search"},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199-codex-session",
}

SDK = {
    "model": "tiny-org/tiny-model",
    "input": "Say hello.",
    "max_output_tokens": 64,
    "temperature": 0.7,
    "top_p": 0.9,
    "metadata": {"team": "a"},
    "user": "u-1",
    "text": {"format": {"type": "text"}},
}

AGENT = {
    "model": "openai/tiny-org/tiny-model",
    "instructions": "You are a helpful agent.",
    "input": [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}", "call_id": "c1",
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}],
         "type": "message", "status": "completed", "id": "msg_1"},
        {"role": "user", "content": [{"type": "input_text", "text": "and an image?"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=",
                                      "detail": "auto"}]},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                              "additionalProperties": False}, "strict": True}],
    "tool_choice": "required",
    "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}},
    "truncation": "disabled",
    "store": False,
}

SHAPES = {"codex": CODEX, "sdk": SDK, "agent": AGENT}


def _paths(obj, prefix=()):
    out, stack = [], [(obj, prefix)]
    while stack:
        node, p = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append(p + (k,))
            stack.append((v, p + (k,)))
    return sorted(out, key=repr)


# A mutation: (path, new value | None, op) with op in set | delete | insert-key.
mutation = st.tuples(st.integers(min_value=0, max_value=10_000), parsed_json_values,
                     st.sampled_from(["set", "delete", "insert"]), st.text(max_size=10))


def mutate(base: dict, mutations) -> dict:
    body = copy.deepcopy(base)
    for index, value, op, new_key in mutations:
        paths = _paths(body)
        if not paths:
            break
        path = paths[index % len(paths)]
        node = body
        try:
            for key in path[:-1]:
                node = node[key]
            last = path[-1]
            if op == "delete":
                del node[last]
            elif op == "insert" and isinstance(node[last], dict):
                node[last][new_key] = value
            else:
                node[last] = value
        except (KeyError, IndexError, TypeError):
            continue
    return body


def assert_valid_chat(t: Translation) -> None:
    """What vLLM and SGLang accept: a model string, a non-empty list of role messages, and
    tools as function definitions with unique names; all serialisable."""
    chat = t.chat
    orjson.dumps(chat)
    assert isinstance(chat["model"], str) and chat["model"]
    messages = chat["messages"]
    assert isinstance(messages, list) and messages
    for m in messages:
        assert isinstance(m, dict) and m.get("role") in CHAT_ROLES, m
        content = m.get("content")
        assert content is None or isinstance(content, (str, list))
        if m["role"] == "tool":
            assert isinstance(m.get("tool_call_id"), str)
        for call in m.get("tool_calls") or []:
            assert isinstance(call["function"]["name"], str) and isinstance(call["function"]["arguments"], str)
    names = [tool["function"]["name"] for tool in chat.get("tools") or []]
    assert len(names) == len(set(names))
    if "max_tokens" in chat:
        assert isinstance(chat["max_tokens"], int) and chat["max_tokens"] >= 1


def check_translation(body) -> None:
    try:
        t = translate_request(body, TranslateOptions(unseal=lambda s: None))
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.message
        envelope = exc.envelope()["error"]
        assert set(envelope) == {"message", "type", "param", "code"}
    else:
        assert_valid_chat(t)


def test_shapes_translate_cleanly():
    for body in SHAPES.values():
        assert_valid_chat(translate_request(copy.deepcopy(body), TranslateOptions()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_translate_mutated_shapes(shape):
    @settings(max_examples=FUZZ_TRANSLATE, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(mutation, min_size=1, max_size=4))
    def run(mutations):
        check_translation(mutate(SHAPES[shape], mutations))

    run()


# --------------------------------------------------------------------------- live HTTP


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with LiveStack(tmp_path_factory.mktemp("fuzz")) as stack:
        yield stack


def _post(live: LiveStack, session: requests.Session, raw: bytes, path: str = "/v1/responses"):
    r = session.post(live.url + path, data=raw, timeout=30,
                     headers={"Authorization": f"Bearer {live.api_key}", "Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], raw[:500])
    if r.status_code >= 400:
        envelope = r.json()
        assert set(envelope) == {"error"} and set(envelope["error"]) == {"message", "type", "param", "code"}
        assert isinstance(envelope["error"]["message"], str)
    elif path == "/v1/responses":
        if r.headers["Content-Type"].startswith("text/event-stream"):
            # SSE lines end only at CR or LF (str.splitlines would also cut at U+2028, U+0085,
            # ... which JSON strings may carry raw): parse the bytes as a client must.
            events = parse_sse(r.content)
            assert events and events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
        else:
            answer = r.json()
            assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
    return r


def _dumps(value) -> bytes:
    # json, not orjson: integers past 64 bits must reach the proxy too
    return json.dumps(value).encode()


def _settled(live: LiveStack) -> None:
    holds, audit = live.ledger_state()
    assert holds == [], holds  # every hold settled or released
    for key_id, balance, expected in audit:
        assert balance == expected, key_id


@settings(max_examples=FUZZ_HTTP, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(json_values)
def test_http_any_json_value(live, value):
    with requests.Session() as session:
        _post(live, session, _dumps(value))
        _post(live, session, _dumps({"model": "tiny-org/tiny-model", "input": value}))
        if isinstance(value, dict):
            _post(live, session, _dumps({"model": "tiny-org/tiny-model", "input": "x", **value}),
                  path="/v1/responses/input_tokens")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_http_mutated_shapes(live, shape):
    @settings(max_examples=FUZZ_HTTP, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(mutation, min_size=1, max_size=3))
    def run(mutations):
        body = mutate(SHAPES[shape], mutations)
        with requests.Session() as session:
            _post(live, session, _dumps(body))

    run()
    _settled(live)


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_http_arbitrary_bytes(live, raw):
    with requests.Session() as session:
        _post(live, session, raw)
