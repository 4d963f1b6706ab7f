"""proxy/protocol/translate.py: Responses request body -> chat-completions body."""

from __future__ import annotations

import copy

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.errors import APIError
from proxy.protocol.translate import (
    HOSTED_ITEM_TYPES,
    KNOWN_FIELDS,
    HOSTED_TOOL_TYPES,
    REFUSED_TOOL_TYPES,
    NO_SEAL_INCLUDE,
    NO_SEAL_KEY,
    UNSEAL_FAILED,
    ToolOrigin,
    TranslateOptions,
    Translation,
    translate_request,
)


def tr(body, **opts) -> Translation:
    return translate_request(body, TranslateOptions(**opts) if opts else None)


def body(input_, **kw):
    return {"model": "m", "input": input_, **kw}


def refused(b, *, param=None, code=None, options=None) -> APIError:
    with pytest.raises(APIError) as ei:
        translate_request(b, options)
    err = ei.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    if param is not None:
        assert err.param == param
    if code is not None:
        assert err.code == code
    return err


def msg(role, content, **kw):
    return {"type": "message", "role": role, "content": content, **kw}


FN = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


# --------------------------------------------------------------------------- model / input basics


def test_string_input_is_one_user_message():
    t = tr(body("hello"))
    assert t.chat["messages"] == [{"role": "user", "content": "hello"}]
    assert t.chat["model"] == "m"
    assert t.chat["stream"] is False
    assert "stream_options" not in t.chat
    assert t.stream is False
    assert t.notices == ()


@pytest.mark.parametrize(
    "model,served,upstream",
    [
        ("qwen/qwen3-8b", {"qwen3-8b"}, "qwen3-8b"),
        ("a/b/c", {"b/c"}, "b/c"),
        ("plain", {"plain"}, "plain"),
        ("/x", {"x"}, "/x"),
        ("x/", {"x"}, "x/"),
        # the exact name first: an org/name id is never cut to its last segment
        ("Qwen/Qwen3-8B", {"Qwen/Qwen3-8B", "Qwen3-8B"}, "Qwen/Qwen3-8B"),
        ("Qwen/Qwen3-8B", {"Qwen/Qwen3-8B"}, "Qwen/Qwen3-8B"),
        ("acme/Qwen/Qwen3-8B", {"Qwen/Qwen3-8B"}, "Qwen/Qwen3-8B"),
        # served by nobody either way: goes on as sent (routing's 404 names it)
        ("Qwen/Qwen3-8B", {"other"}, "Qwen/Qwen3-8B"),
    ],
)
def test_vendor_prefix(model, served, upstream):
    t = tr({"model": model, "input": "hi"}, served=served.__contains__)
    assert t.model == model
    assert t.upstream_model == upstream
    assert t.chat["model"] == upstream


@pytest.mark.parametrize("b", [None, [], "x", 3, True])
def test_body_must_be_object(b):
    refused(b)


@pytest.mark.parametrize("model", [None, "", "   ", 3, ["m"], {"id": "m"}])
def test_model_required(model):
    b = {"input": "hi"} if model is None else {"model": model, "input": "hi"}
    refused(b, param="model")


@pytest.mark.parametrize("inp", [None, 3, {"role": "user"}, True])
def test_input_required_and_typed(inp):
    b = {"model": "m"} if inp is None else {"model": "m", "input": inp}
    refused(b, param="input")


def test_non_object_item_refused():
    refused(body(["hi"]), param="input[0]")


def test_unknown_item_type():
    err = refused(body([msg("user", "a"), {"type": "telepathy"}]), param="input[1].type")
    assert "Unknown input item type 'telepathy'" in err.message


def test_item_without_type_but_role_is_message():
    t = tr(body([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]))
    assert t.chat["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_bad_role():
    refused(body([msg("tool", "x")]), param="input[0].role")
    refused(body([{"type": "message", "content": "x"}]), param="input[0].role")


def test_bad_content_type():
    refused(body([msg("user", 5)]), param="input[0].content")
    refused(body([msg("user", [5])]), param="input[0].content[0]")
    refused(body([msg("user", [{"type": "input_text", "text": 5}])]), param="input[0].content[0].text")


def test_item_reference_is_stateless_only():
    refused(body([msg("user", "a"), {"type": "item_reference", "id": "msg_1"}]), param="input[1]",
            code="stateless_only")


@pytest.mark.parametrize(
    "extra,param",
    [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background"),
     ({"prompt": {"id": "pmpt_1"}}, "prompt")],
)
def test_stateful_fields_refused(extra, param):
    refused(body("hi", **extra), param=param, code="stateless_only")


# --------------------------------------------------------------------------- content parts


def test_user_text_parts_collapse_to_string():
    t = tr(body([msg("user", [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"},
                              {"type": "output_text", "text": "c"}])]))
    assert t.chat["messages"] == [{"role": "user", "content": "a\nb\nc"}]


def test_user_image_keeps_parts():
    t = tr(body([msg("user", [
        {"type": "input_text", "text": "what is this"},
        {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
    ])]))
    assert t.chat["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]}]


def test_image_file_id_refused():
    refused(body([msg("user", "x"), msg("user", [{"type": "input_text", "text": "a"},
                                                 {"type": "input_image", "file_id": "file_1"}])]),
            param="input[1].content[1]", code="unsupported_content")


def test_input_file_refused():
    refused(body([msg("user", "a"), msg("user", "b"), msg("user", "c"),
                  msg("user", [{"type": "input_file", "file_id": "file_1"}])]),
            param="input[3].content[0]", code="unsupported_content")


def test_bad_image_url_refused():
    refused(body([msg("user", [{"type": "input_image", "image_url": "file:///etc/passwd"}])]),
            param="input[0].content[0].image_url")


def test_unknown_part_type_named():
    err = refused(body([msg("user", [{"type": "hologram"}])]), param="input[0].content[0].type")
    assert "hologram" in err.message


def test_refusal_part_becomes_text():
    t = tr(body([msg("user", "q"), msg("assistant", [{"type": "refusal", "refusal": "I can't"}])]))
    assert t.chat["messages"][1] == {"role": "assistant", "content": "I can't"}


def test_image_in_assistant_refused():
    refused(body([msg("assistant", [{"type": "input_image", "image_url": "https://x"}])]),
            param="input[0].content[0]", code="unsupported_content")


# --------------------------------------------------------------------------- system merging


def test_instructions_and_all_system_developer_merged_into_one_leading_message():
    t = tr(body([
        msg("developer", "dev1"),
        msg("user", "u1"),
        msg("system", [{"type": "input_text", "text": "sys2"}]),
        msg("assistant", "a1"),
        msg("developer", "dev3"),
        msg("user", "u2"),
    ], instructions="inst"))
    assert t.chat["messages"] == [
        {"role": "system", "content": "inst\n\ndev1\n\nsys2\n\ndev3"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert [m["role"] for m in t.chat["messages"]].count("system") == 1
    assert t.echo["instructions"] == "inst"


def test_no_system_message_without_system_text():
    t = tr(body([msg("user", "u")]))
    assert t.chat["messages"][0]["role"] == "user"
    assert t.echo["instructions"] is None


def test_instructions_must_be_string():
    refused(body("x", instructions=["a"]), param="instructions")


# --------------------------------------------------------------------------- assistant turns


def test_assistant_turn_grouping():
    t = tr(body([
        msg("user", "weather in Paris and Rome?"),
        msg("assistant", [{"type": "output_text", "text": "Let me check."}]),
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "need two calls"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "20C"},
        {"type": "function_call_output", "call_id": "c2", "output": "25C"},
    ], tools=[FN]))
    assert t.chat["messages"] == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "need two calls", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
        {"role": "tool", "tool_call_id": "c2", "content": "25C"},
    ]


def test_tool_calls_without_text_have_null_content():
    t = tr(body([msg("user", "u"), {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]))
    assert t.chat["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_user_message_ends_assistant_turn():
    t = tr(body([msg("assistant", "a"), msg("user", "u"), msg("assistant", "b"), msg("assistant", "c")]))
    assert t.chat["messages"] == [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "b\n\nc"},
    ]


def test_reasoning_content_parts_win_over_summary():
    t = tr(body([msg("user", "u"), {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}],
                                    "content": [{"type": "reasoning_text", "text": "full thoughts"}]},
                 msg("assistant", "answer")]))
    assert t.chat["messages"][1] == {"role": "assistant", "content": "answer", "reasoning_content": "full thoughts"}


def test_reasoning_only_turn():
    t = tr(body([msg("user", "u"), {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
                 msg("user", "v")]))
    assert t.chat["messages"][1] == {"role": "assistant", "content": "", "reasoning_content": "hm"}


def test_reasoning_unsealed():
    seen = []

    def unseal(s):
        seen.append(s)
        return "secret thoughts" if s == "CIPHER" else None

    t = tr(body([msg("user", "u"), {"type": "reasoning", "summary": [], "encrypted_content": "CIPHER"},
                 msg("assistant", "a")]), unseal=unseal)
    assert seen == ["CIPHER"]
    assert t.chat["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": "secret thoughts"}
    assert t.notices == ()


def test_reasoning_unseal_fails_dropped_with_notice():
    t = tr(body([msg("user", "u"), {"type": "reasoning", "summary": [], "encrypted_content": "junk"},
                 msg("assistant", "a"),
                 msg("user", "again"), {"type": "reasoning", "encrypted_content": "junk2"}, msg("assistant", "b")]),
           unseal=lambda s: None)
    assert t.chat["messages"][1] == {"role": "assistant", "content": "a"}
    assert t.chat["messages"][3] == {"role": "assistant", "content": "b"}
    assert t.notices == (UNSEAL_FAILED,)


def test_reasoning_unseal_fails_falls_back_to_summary_text():
    t = tr(body([msg("user", "u"), {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}],
                                    "encrypted_content": "junk"}, msg("assistant", "a")]), unseal=lambda s: None)
    assert t.chat["messages"][1]["reasoning_content"] == "sum"
    assert t.notices == ()


def test_reasoning_unseal_exception_is_a_failure_not_a_500():
    def boom(s):
        raise RuntimeError("bad key")

    t = tr(body([msg("user", "u"), {"type": "reasoning", "encrypted_content": "x"}]), unseal=boom)
    assert t.chat["messages"] == [{"role": "user", "content": "u"}]
    assert t.notices == (UNSEAL_FAILED,)


def test_encrypted_reasoning_without_unseal_ignored_with_a_notice():
    t = tr(body([msg("user", "u"), {"type": "reasoning", "summary": [], "encrypted_content": "CIPHER"},
                 msg("assistant", "a")]))
    assert t.chat["messages"][1] == {"role": "assistant", "content": "a"}
    assert t.notices == (NO_SEAL_KEY,)


def test_bad_reasoning_item():
    refused(body([{"type": "reasoning", "summary": "x"}]), param="input[0].summary")
    refused(body([{"type": "reasoning", "summary": [{"text": 1}]}]), param="input[0].summary[0].text")


def test_function_call_output_parts():
    t = tr(body([
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_text", "text": "line1"}, {"type": "input_image", "image_url": "https://x"},
            {"type": "output_text", "text": "line2"}]},
    ]))
    assert t.chat["messages"][1] == {"role": "tool", "tool_call_id": "c", "content": "line1\n[image]\nline2"}


def test_function_call_validation():
    refused(body([{"type": "function_call", "name": "f", "arguments": "{}"}]), param="input[0].call_id")
    refused(body([{"type": "function_call", "call_id": "c", "arguments": "{}"}]), param="input[0].name")
    refused(body([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]),
            param="input[0].arguments")
    refused(body([{"type": "function_call_output", "call_id": "c"}]), param="input[0].output")
    refused(body([{"type": "function_call_output", "call_id": "c", "output": 3}]), param="input[0].output")
    refused(body([{"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]),
            param="input[0].output[0].type")


@pytest.mark.parametrize("itype, words", [("function_call_output", "function call output"),
                                          ("custom_tool_call_output", "custom tool call output")])
def test_a_tool_output_answering_no_call_is_refused_as_openai_does(itype, words):
    err = refused(body([msg("user", "u"), {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                        {"type": itype, "call_id": "c1", "output": "ok"},
                        {"type": itype, "call_id": "call_elsewhere", "output": "lost"}]), param="input")
    assert err.message == f"No tool call found for {words} with call_id call_elsewhere."
    assert err.code == "invalid_request"
    # An output before its call answers nothing yet.
    refused(body([{"type": itype, "call_id": "c1", "output": "ok"},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]), param="input")


def test_tool_outputs_whose_calls_are_elsewhere_in_the_input_are_answered():
    """A call far back, a hosted call answered by a function_call_output (Codex's
    local_shell_call), or a summary that may stand for the call (a compaction item, this
    proxy's or another provider's): accepted."""
    far = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}, msg("user", "u"),
           msg("assistant", "a"), {"type": "function_call_output", "call_id": "c1", "output": "late"}]
    assert tr(body(far)).chat["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "late"}
    shell = [msg("user", "u"), {"type": "local_shell_call", "call_id": "sh1", "status": "completed",
                                "action": {"type": "exec", "command": ["ls"]}},
             {"type": "function_call_output", "call_id": "sh1", "output": "README.md"}]
    assert tr(body(shell)).chat["messages"][-1]["tool_call_id"] == "sh1"
    for summary in ({"type": "compaction", "encrypted_content": "gAAAA-another-providers"},
                    {"type": "compaction_summary", "encrypted_content": "x"}):
        after = [msg("user", "u"), summary, {"type": "function_call_output", "call_id": "c_gone", "output": "r"}]
        assert tr(body(after)).chat["messages"][-1]["tool_call_id"] == "c_gone"
    from proxy.protocol.compaction import SEAL_FORMAT, compaction_item

    ours = compaction_item("we listed the files", lambda text: SEAL_FORMAT + text)
    after = [ours, {"type": "function_call_output", "call_id": "c_gone", "output": "r"}]
    t = tr(body(after), unseal=lambda sealed: sealed[len(SEAL_FORMAT):])
    assert t.chat["messages"][-1]["tool_call_id"] == "c_gone"


def test_custom_tool_call_and_output():
    t = tr(body([
        msg("user", "patch it"),
        {"type": "custom_tool_call", "call_id": "c9", "name": "apply_patch", "input": "*** Begin Patch\n\"x\""},
        {"type": "custom_tool_call_output", "call_id": "c9", "output": "Done!"},
    ]))
    call = t.chat["messages"][1]["tool_calls"][0]
    assert call["id"] == "c9"
    assert call["function"]["name"] == "apply_patch"
    assert orjson.loads(call["function"]["arguments"]) == {"input": "*** Begin Patch\n\"x\""}
    assert t.chat["messages"][2] == {"role": "tool", "tool_call_id": "c9", "content": "Done!"}
    refused(body([{"type": "custom_tool_call", "call_id": "c", "name": "x", "input": 5}]), param="input[0].input")


def test_namespaced_calls():
    t = tr(body([
        {"type": "function_call", "call_id": "a", "name": "list", "namespace": "fs", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "b", "name": "exec", "namespace": "sh", "input": "ls"},
    ]))
    names = [c["function"]["name"] for c in t.chat["messages"][0]["tool_calls"]]
    assert names == ["fs__list", "sh__exec"]


@pytest.mark.parametrize("itype", sorted(HOSTED_ITEM_TYPES))
def test_hosted_items_degrade_to_assistant_note(itype):
    t = tr(body([msg("user", "u"), {"type": itype, "id": "x", "status": "completed"},
                 msg("assistant", "done")]))
    assert t.chat["messages"][1] == {
        "role": "assistant",
        "content": f"[{itype} replayed from a previous conversation: hosted tool results are not replayed]\n\ndone",
    }


def test_hosted_item_joins_the_call_turn():
    t = tr(body([msg("user", "u"), {"type": "web_search_call", "id": "ws"},
                 {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "c", "output": "r"}]))
    m = t.chat["messages"]
    assert len(m) == 3
    assert m[1]["content"] == ("[web_search_call replayed from a previous conversation: "
                               "hosted tool results are not replayed]")
    assert m[1]["tool_calls"][0]["id"] == "c"


# --------------------------------------------------------------------------- configuration_update / reasoning


def test_configuration_update_sets_effort():
    t = tr(body([msg("user", "u"), {"type": "configuration_update", "reasoning": {"effort": "high"}}]))
    assert t.chat["reasoning_effort"] == "high"
    assert t.chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert t.chat["messages"] == [{"role": "user", "content": "u"}]
    assert t.echo["reasoning"] == {"effort": "high", "summary": None}


def test_configuration_update_none_turns_thinking_off():
    t = tr(body([{"type": "configuration_update", "reasoning": {"effort": "none"}}, msg("user", "u")]))
    assert t.chat["chat_template_kwargs"] == {"enable_thinking": False}


def test_request_reasoning_wins_over_configuration_update():
    t = tr(body([{"type": "configuration_update", "reasoning": {"effort": "high"}}, msg("user", "u")],
                reasoning={"effort": "low"}))
    assert t.chat["reasoning_effort"] == "low"


def test_configuration_update_without_effort_contributes_nothing():
    t = tr(body([{"type": "configuration_update", "model": "x"}, msg("user", "u")]))
    assert "reasoning_effort" not in t.chat and "chat_template_kwargs" not in t.chat
    refused(body([{"type": "configuration_update", "reasoning": {"effort": "max"}}]),
            param="input[0].reasoning.effort")


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", "xhigh"])
def test_reasoning_effort(effort):
    t = tr(body("u", reasoning={"effort": effort, "summary": "auto"}))
    assert t.chat["reasoning_effort"] == effort
    assert t.chat["chat_template_kwargs"] == {"enable_thinking": effort != "none"}
    assert t.echo["reasoning"] == {"effort": effort, "summary": "auto"}


def test_reasoning_validation():
    refused(body("u", reasoning={"effort": "ultra"}), param="reasoning.effort")
    refused(body("u", reasoning="high"), param="reasoning")
    t = tr(body("u", reasoning={"summary": "detailed"}))
    assert "reasoning_effort" not in t.chat
    assert t.echo["reasoning"] == {"effort": None, "summary": "detailed"}


# --------------------------------------------------------------------------- scalar parameters


def test_sampling_and_limits_pass_through():
    t = tr(body("u", max_output_tokens=100, temperature=0.7, top_p=0.9, top_logprobs=3, user="u1",
                safety_identifier="s1", parallel_tool_calls=False))
    c = t.chat
    assert (c["max_tokens"], c["temperature"], c["top_p"]) == (100, 0.7, 0.9)
    assert (c["logprobs"], c["top_logprobs"]) == (True, 3)
    assert c["user"] == "u1"
    assert t.max_output_tokens == 100
    e = t.echo
    assert (e["max_output_tokens"], e["temperature"], e["top_p"], e["top_logprobs"]) == (100, 0.7, 0.9, 3)
    assert (e["user"], e["safety_identifier"], e["parallel_tool_calls"]) == ("u1", "s1", False)


def test_safety_identifier_is_user_alias():
    assert tr(body("u", safety_identifier="s1")).chat["user"] == "s1"
    assert "user" not in tr(body("u")).chat


@pytest.mark.parametrize(
    "field,value",
    [("max_output_tokens", 0), ("max_output_tokens", -1), ("max_output_tokens", 1.5), ("max_output_tokens", "9"),
     ("max_output_tokens", True), ("temperature", 2.5), ("temperature", -0.1), ("temperature", "1"),
     ("top_p", 1.01), ("top_p", False), ("stream", "yes"), ("user", 5), ("safety_identifier", []),
     ("prompt_cache_key", 1), ("metadata", []), ("include", "x"), ("include", [1]), ("top_logprobs", 21),
     ("parallel_tool_calls", 1), ("conversation", 5), ("conversation", {"x": 1}), ("max_tool_calls", -1),
     ("tools", {}), ("tool_choice", 3), ("text", "json")],
)
def test_bad_types_name_param(field, value):
    refused(body("u", **{field: value}), param=field)


def test_stream_sets_include_usage():
    t = tr(body("u", stream=True, stream_options={"include_obfuscation": False}))
    assert t.stream is True
    assert t.chat["stream"] is True
    assert t.chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_accepted_not_forwarded():
    t = tr(body("u", prompt_cache_key="pck", metadata={"a": "b"}, conversation={"id": "conv_1"}, store=True,
                include=["reasoning.encrypted_content", "message.output_text.logprobs"], service_tier="flex",
                truncation="auto", client_metadata={"x": 1}, text={"verbosity": "low"}, max_tool_calls=5,
                provider={"region": "eu"}, some_future_field={"z": 1}))
    assert set(t.chat) == {"model", "messages", "stream"}
    assert t.prompt_cache_key == "pck"
    assert t.conversation == "conv_1"
    assert t.include_encrypted_reasoning is True
    e = t.echo
    assert e["metadata"] == {"a": "b"}
    assert e["store"] is True
    assert e["prompt_cache_key"] == "pck"
    assert e["text"] == {"verbosity": "low", "format": {"type": "text"}}
    assert e["max_tool_calls"] == 5
    assert (e["service_tier"], e["truncation"], e["background"]) == ("default", "disabled", False)
    assert tr(body("u", conversation="conv_2")).conversation == "conv_2"


# The request body's fields in the two docs this API follows (000: the Engy reference; 004: the
# ZDR doc): none of them is ever named as unknown.
DOC_FIELDS = ("model", "input", "instructions", "max_output_tokens", "stream", "temperature", "top_p", "tools",
              "tool_choice", "parallel_tool_calls", "provider", "store", "previous_response_id", "reasoning",
              "text", "prompt_cache_key", "user", "safety_identifier", "metadata", "conversation", "include")


def test_unknown_fields_and_store_true_are_accepted_and_named_in_a_notice():
    t = tr(body("u", colour="blue", store=True, **{"x-extra": 1}))
    assert "unknown field(s) ignored: colour, x-extra" in t.notices
    assert "store: true accepted, nothing is stored (this endpoint is stateless)" in t.notices
    assert t.echo["store"] is True  # accepted as sent
    many = tr(body("u", **{f"f{i:02d}": i for i in range(13)})).notices
    assert many == ("unknown field(s) ignored: f00, f01, f02, f03, f04, f05, f06, f07, f08, f09 and 3 more",)
    assert tr(body("u", store=False)).notices == ()


def test_a_known_field_is_never_named():
    from openai.types.responses.response_create_params import ResponseCreateParamsBase
    from openresponses_types import types as spec_types

    sdk = set(ResponseCreateParamsBase.__annotations__)
    spec = set(spec_types.CreateResponseBody.model_fields)
    assert set(DOC_FIELDS) | sdk | spec <= KNOWN_FIELDS
    t = tr(body("u", store=False, provider={"sort": "latency"}, client_metadata={"a": "b"}, truncation="auto",
                service_tier="auto", prompt_cache_retention="24h", context_management=[], stream_options=None))
    assert t.notices == ()


def test_echo_defaults():
    e = tr(body("u")).echo
    assert e == {
        "instructions": None, "tools": [], "tool_choice": "auto", "temperature": 1.0, "top_p": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "max_output_tokens": None, "parallel_tool_calls": True, "metadata": {}, "store": False,
        "text": {"format": {"type": "text"}}, "reasoning": {"effort": None, "summary": None}, "user": None,
        "safety_identifier": None, "prompt_cache_key": None, "top_logprobs": 0, "service_tier": "default",
        "truncation": "disabled", "background": False, "max_tool_calls": None,
    }


def test_text_format():
    assert "response_format" not in tr(body("u", text={"format": {"type": "text"}})).chat
    assert tr(body("u", text={"format": {"type": "json_object"}})).chat["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    t = tr(body("u", text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True,
                                      "description": "d"}}))
    assert t.chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": True, "description": "d"}}
    assert t.echo["text"]["format"]["name"] == "out"
    # The Open Responses JsonSchemaResponseFormat requires description (string | null) and strict
    bare = tr(body("u", text={"format": {"type": "json_schema", "name": "out", "schema": schema}}))
    assert bare.echo["text"]["format"] == {"type": "json_schema", "name": "out", "schema": schema,
                                           "description": None, "strict": False}
    assert "strict" not in bare.chat["response_format"]["json_schema"]  # not sent: the server's default


def test_text_format_errors():
    refused(body("u", text={"format": {"type": "json_schema", "schema": {}}}), param="text.format.name")
    refused(body("u", text={"format": {"type": "json_schema", "name": "n"}}), param="text.format.schema")
    refused(body("u", text={"format": {"type": "yaml"}}), param="text.format.type")
    refused(body("u", text={"format": "json"}), param="text.format")


# --------------------------------------------------------------------------- tools


def test_function_tool():
    t = tr(body("u", tools=[FN, {"type": "function", "name": "noargs", "strict": True}]))
    assert t.chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                          "parameters": FN["parameters"]}},
        {"type": "function", "function": {"name": "noargs", "parameters": {"type": "object", "properties": {}},
                                          "strict": True}},
    ]
    assert t.tools == {"get_weather": ToolOrigin("function", "get_weather"),
                       "noargs": ToolOrigin("function", "noargs")}
    assert t.echo["tools"][0] == {**FN, "strict": None}
    # description and parameters, required (nullable) by the Open Responses spec, are echoed null
    assert t.echo["tools"][1] == {"type": "function", "name": "noargs", "strict": True, "description": None,
                                  "parameters": None}
    assert "strict" not in FN  # the client's dict is not mutated


def test_custom_tool_with_grammar():
    grammar = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'
    t = tr(body("u", tools=[{"type": "custom", "name": "apply_patch", "description": "Edit files.",
                             "format": {"type": "grammar", "syntax": "lark", "definition": grammar}}]))
    fn = t.chat["tools"][0]["function"]
    assert fn["name"] == "apply_patch"
    assert fn["description"] == "Edit files."
    assert fn["parameters"]["required"] == ["input"]
    assert fn["parameters"]["type"] == "object"
    desc = fn["parameters"]["properties"]["input"]["description"]
    assert fn["parameters"]["properties"]["input"]["type"] == "string"
    assert desc.startswith("Edit files.")
    assert "lark grammar" in desc and grammar in desc
    assert t.tools == {"apply_patch": ToolOrigin("custom", "apply_patch")}


def test_namespace_tool_flattened():
    ns = {"type": "namespace", "name": "fs", "description": "Files",
          "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}},
                    {"type": "custom", "name": "write"}]}
    t = tr(body("u", tools=[ns]))
    assert [x["function"]["name"] for x in t.chat["tools"]] == ["fs__read", "fs__write"]
    assert t.tools == {"fs__read": ToolOrigin("function", "read", "fs"),
                       "fs__write": ToolOrigin("custom", "write", "fs")}
    assert t.echo["tools"][0]["name"] == "fs"
    assert t.echo["tools"][0]["tools"][0]["strict"] is None
    refused(body("u", tools=[{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]),
            param="tools[0].tools[0].type")
    refused(body("u", tools=[{"type": "namespace", "name": "n"}]), param="tools[0].tools")


@pytest.mark.parametrize("ttype", sorted(HOSTED_TOOL_TYPES))
def test_hosted_tools_left_out_with_notice(ttype):
    t = tr(body("u", tools=[{"type": ttype}, FN]))
    assert [x["function"]["name"] for x in t.chat["tools"]] == ["get_weather"]
    assert t.notices == (f"tools left out: {ttype}",)
    assert [x["name"] for x in t.echo["tools"]] == ["get_weather"]


def test_hosted_tools_one_notice_listing_them():
    t = tr(body("u", tools=[{"type": "web_search"}, {"type": "mcp", "server_label": "x"}, {"type": "web_search"}]))
    assert t.notices == ("tools left out: web_search, mcp",)
    assert "tools" not in t.chat and "tool_choice" not in t.chat
    assert t.tools == {}


def test_all_tools_left_out_omits_tool_choice():
    t = tr(body("u", tools=[{"type": "file_search"}], tool_choice="required", parallel_tool_calls=True))
    assert "tools" not in t.chat and "tool_choice" not in t.chat and "parallel_tool_calls" not in t.chat
    assert t.echo["tool_choice"] == "required"


def test_image_generation_refused():
    assert REFUSED_TOOL_TYPES == frozenset({"image_generation"})
    refused(body("u", tools=[FN, {"type": "image_generation"}]), param="tools[1].type",
            code="image_generation_unsupported")


def test_unknown_tool_type():
    err = refused(body("u", tools=[FN, {"type": "teleport"}]), param="tools[1].type")
    assert "teleport" in err.message
    refused(body("u", tools=["f"]), param="tools[0]")
    refused(body("u", tools=[{"type": "function"}]), param="tools[0].name")
    refused(body("u", tools=[{"type": "function", "name": "f", "parameters": "x"}]), param="tools[0].parameters")


def test_duplicate_tool_names():
    refused(body("u", tools=[FN, FN]), param="tools[1]", code="duplicate_tool_name")
    # a namespace that flattens onto an existing function name
    refused(body("u", tools=[{"type": "function", "name": "a__b"},
                             {"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "b"}]}]),
            code="duplicate_tool_name")
    refused(body("u", tools=[{"type": "function", "name": "x"}, {"type": "custom", "name": "x"}]),
            code="duplicate_tool_name")


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tool_choice_strings(choice):
    t = tr(body("u", tools=[FN], tool_choice=choice, parallel_tool_calls=False))
    assert t.chat["tool_choice"] == choice
    assert t.chat["parallel_tool_calls"] is False
    assert t.echo["tool_choice"] == choice


def test_tool_choice_named():
    tools = [FN, {"type": "custom", "name": "apply_patch"},
             {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read"}]}]
    c = tr(body("u", tools=tools, tool_choice={"type": "function", "name": "get_weather"})).chat["tool_choice"]
    assert c == {"type": "function", "function": {"name": "get_weather"}}
    c = tr(body("u", tools=tools, tool_choice={"type": "custom", "name": "apply_patch"})).chat["tool_choice"]
    assert c == {"type": "function", "function": {"name": "apply_patch"}}
    t = tr(body("u", tools=tools, tool_choice={"type": "function", "name": "read", "namespace": "fs"}))
    assert t.chat["tool_choice"] == {"type": "function", "function": {"name": "fs__read"}}
    assert t.echo["tool_choice"] == {"type": "function", "name": "read", "namespace": "fs"}


def test_tool_choice_errors():
    refused(body("u", tools=[FN], tool_choice={"type": "function", "name": "nope"}), param="tool_choice")
    refused(body("u", tools=[FN], tool_choice={"type": "custom", "name": "get_weather"}), param="tool_choice")
    refused(body("u", tool_choice={"type": "function", "name": "get_weather"}), param="tool_choice")
    refused(body("u", tools=[FN], tool_choice="sometimes"), param="tool_choice")
    refused(body("u", tools=[FN], tool_choice={"type": "function"}), param="tool_choice.name")
    refused(body("u", tools=[FN], tool_choice={"type": "psychic"}), param="tool_choice.type")
    refused(body("u", tools=[FN], tool_choice={"type": "image_generation"}), code="image_generation_unsupported")


def test_tool_choice_allowed_tools_and_hosted():
    t = tr(body("u", tools=[FN], tool_choice={"type": "allowed_tools", "mode": "required",
                                              "tools": [{"type": "function", "name": "get_weather"}]}))
    assert t.chat["tool_choice"] == "required"
    assert t.allowed_tools == {"get_weather"}
    # an empty allowed set: no tool goes upstream, so the model can call none
    t = tr(body("u", tools=[FN], tool_choice={"type": "allowed_tools", "tools": []}))
    assert "tools" not in t.chat and "tool_choice" not in t.chat and t.allowed_tools == frozenset()
    assert t.echo["tools"] == [dict(FN, strict=None)]
    t = tr(body("u", tools=[FN], tool_choice={"type": "web_search"}))
    assert t.chat["tool_choice"] == "auto"
    assert t.notices == ("tools left out: web_search",)
    refused(body("u", tools=[FN], tool_choice={"type": "allowed_tools", "mode": "none"}), param="tool_choice.mode")


# --------------------------------------------------------------------------- Codex-shaped body


def test_codex_shaped_body():
    ns_tools = [{"type": "function", "name": f"tool{k}", "description": f"d{k}",
                 "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}} for k in range(5)]
    b = {
        "model": "openai/gpt-oss-20b",
        "instructions": "You are Codex.",
        "input": [
            msg("developer", [{"type": "input_text", "text": "<permissions>sandbox</permissions>"}]),
            msg("developer", [{"type": "input_text", "text": "<env>cwd=/repo</env>"}]),
            msg("user", [{"type": "input_text", "text": "fix the bug"}]),
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look at file"}],
             "encrypted_content": "gAAAA..."},
            {"type": "function_call", "call_id": "call_1", "name": "tool2", "namespace": "mcp_files",
             "arguments": '{"x":"a.py"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"},
            {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "ok"},
            msg("user", [{"type": "input_text", "text": "thanks"}]),
        ],
        "tools": [
            {"type": "namespace", "name": "mcp_files", "description": "MCP", "tools": ns_tools},
            {"type": "web_search", "external_web_access": False},
            {"type": "custom", "name": "apply_patch", "description": "Use apply_patch to edit files.",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: patch"}},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-session",
        "client_metadata": {"originator": "codex_cli_rs"},
        "text": {"verbosity": "low"},
    }
    snapshot = copy.deepcopy(b)
    t = tr(b, served={"gpt-oss-20b"}.__contains__)
    assert b == snapshot  # input not mutated
    c = t.chat
    assert c["model"] == "gpt-oss-20b" and t.model == "openai/gpt-oss-20b"
    assert c["stream"] is True and c["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert c["reasoning_effort"] == "medium" and c["chat_template_kwargs"] == {"enable_thinking": True}
    assert [x["function"]["name"] for x in c["tools"]] == [f"mcp_files__tool{k}" for k in range(5)] + ["apply_patch"]
    assert c["tool_choice"] == "auto" and c["parallel_tool_calls"] is False
    assert c["messages"] == [
        {"role": "system", "content": "You are Codex.\n\n<permissions>sandbox</permissions>\n\n<env>cwd=/repo</env>"},
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": None, "reasoning_content": "look at file", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "mcp_files__tool2", "arguments": '{"x":"a.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "apply_patch", "arguments": '{"input":"*** Begin Patch"}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
        {"role": "user", "content": "thanks"},
    ]
    assert t.tools["mcp_files__tool3"] == ToolOrigin("function", "tool3", "mcp_files")
    assert t.tools["apply_patch"] == ToolOrigin("custom", "apply_patch")
    assert len(t.tools) == 6
    assert t.notices == (NO_SEAL_INCLUDE, "tools left out: web_search", NO_SEAL_KEY,)
    assert t.include_encrypted_reasoning is True
    assert t.prompt_cache_key == "019a-session"
    assert [x["type"] for x in t.echo["tools"]] == ["namespace", "custom"]
    assert t.echo["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert t.echo["parallel_tool_calls"] is False
    assert "client_metadata" not in c and "prompt_cache_key" not in c and "include" not in c


# --------------------------------------------------------------------------- the output cap


def test_with_cap_returns_a_new_translation_and_leaves_the_old_one_as_it_was():
    t = tr(body("u", max_output_tokens=1000))
    capped = t.with_cap(250)
    assert capped.chat["max_tokens"] == 250
    assert capped.echo["max_output_tokens"] == 250
    assert capped.max_output_tokens == 250 and capped.output_cap == 250
    assert t.chat["max_tokens"] == 1000 and t.echo["max_output_tokens"] == 1000 and t.output_cap == 1000
    t2 = tr(body("u"))
    assert "max_tokens" not in t2.chat and t2.output_cap is None
    assert t2.with_cap(64).chat["max_tokens"] == 64
    reserved = t2.with_cap(64, lowered=False)  # held to 64, nothing sent or echoed
    assert "max_tokens" not in reserved.chat and reserved.echo["max_output_tokens"] is None
    assert reserved.output_cap == 64
    assert reserved.with_max_tokens(32).output_cap == 32 and reserved.output_cap == 64
    with pytest.raises(ValueError):
        t2.with_cap(0)
    with pytest.raises(AttributeError):  # frozen
        t2.chat = {}


def test_the_copies_keep_every_other_field():
    # with_cap and with_max_tokens name every field by position (Translation._copy): a field
    # added to Translation and left out there, or two swapped, fails here.
    t = tr(body("u", max_output_tokens=1000, tools=[{"type": "function", "name": "f", "parameters": {}}],
                prompt_cache_key="k", include=["reasoning.encrypted_content"]))
    copies = {
        "lowered": (t.with_cap(250), {"chat", "echo", "max_output_tokens", "reserved_output"}),
        "reserved": (t.with_cap(250, lowered=False), {"reserved_output"}),
        "clamped": (t.with_max_tokens(7), {"chat"}),
    }
    for name, (copy_, changed) in copies.items():
        for field in t._fields:
            if field not in changed:
                assert getattr(copy_, field) is getattr(t, field), (name, field)
        assert t._replace(**{n: getattr(copy_, n) for n in changed}) == copy_, name


def test_the_prompt_bound_is_computed_once_and_follows_the_messages():
    from proxy.protocol.prompt import prompt_bound, prompt_bytes

    t = tr(body("héllo"))
    assert t.prompt_bound()[1:] == prompt_bytes(t.chat) == (6, False)
    assert t.prompt_bound() == prompt_bound(t.chat)
    assert t.with_cap(5).prompt_bound()[1:] == (6, False)  # a copy shares the messages, and the bound
    other = t._replace(chat={**t.chat, "messages": [{"role": "user", "content": "a much longer text"}]})
    assert other.prompt_bound()[1:] == (18, False)  # other messages: counted again, never the stale bound


# --------------------------------------------------------------------------- fuzz: only APIError, only 4xx

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=25,
)

VALID = {
    "model": "vendor/m",
    "instructions": "sys",
    "input": [
        msg("developer", "dev"),
        msg("user", [{"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "https://x"}]),
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}], "encrypted_content": "E"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "o"}]},
        {"type": "custom_tool_call", "call_id": "d", "name": "p", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "d", "output": "ok"},
        {"type": "web_search_call", "id": "w"},
        {"type": "configuration_update", "reasoning": {"effort": "low"}},
    ],
    "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}},
        {"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark", "definition": "s"}},
        {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "g"}]},
        {"type": "web_search"},
    ],
    "tool_choice": {"type": "function", "name": "f"},
    "reasoning": {"effort": "high", "summary": "auto"},
    "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    "max_output_tokens": 10,
    "temperature": 1,
    "top_p": 0.5,
    "stream": True,
    "metadata": {"k": "v"},
    "conversation": {"id": "c"},
    "include": ["reasoning.encrypted_content"],
    "top_logprobs": 2,
    "user": "u",
}


def _fuzz_options():
    return TranslateOptions(unseal=lambda s: None if s == "E" else s, served={"m"}.__contains__)


def test_valid_fuzz_base_translates():
    t = translate_request(copy.deepcopy(VALID), _fuzz_options())
    assert t.upstream_model == "m"
    assert t.chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}


def _check(b):
    try:
        t = translate_request(b, _fuzz_options())
    except APIError as e:
        assert 400 <= e.status < 500
        assert isinstance(e.message, str) and e.message
    else:
        assert isinstance(t, Translation)
        orjson.dumps(t.chat)  # the chat body is serialisable
        orjson.dumps(t.echo)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_fuzz_arbitrary_json(value):
    _check(value)
    _check({"model": "m", "input": value})
    if isinstance(value, dict):
        _check({"model": "m", "input": "x", **value})


def _paths(obj, prefix=()):
    """Every (container path) in VALID, for mutation."""
    out = []
    stack = [(obj, prefix)]
    while stack:
        node, p = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                out.append(p + (k,))
                stack.append((v, p + (k,)))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                out.append(p + (i,))
                stack.append((v, p + (i,)))
    return sorted(out, key=repr)


_VALID_PATHS = _paths(VALID)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_VALID_PATHS), json_values, st.booleans()), min_size=1, max_size=3))
def test_fuzz_mutated_valid_bodies(mutations):
    b = copy.deepcopy(VALID)
    for path, value, delete in mutations:
        node = b
        try:
            for key in path[:-1]:
                node = node[key]
            last = path[-1]
            if delete:
                del node[last]
            else:
                node[last] = value
        except (KeyError, IndexError, TypeError):
            continue
    _check(b)


# --------------------------------------------------------------------------- Open Responses fields (issue 14)


TIME_FN = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


def test_allowed_tools_sends_only_the_allowed_tools_upstream():
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]}
    t = tr(body("u", tools=[FN, TIME_FN], tool_choice=choice))
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["get_time"]
    assert t.chat["tool_choice"] == "auto" and t.allowed_tools == {"get_time"}
    assert [tool["name"] for tool in t.echo["tools"]] == ["get_weather", "get_time"]  # the echo keeps them all
    assert t.echo["tool_choice"] == choice
    assert tr(body("u", tools=[FN, TIME_FN])).allowed_tools is None
    refused(body("u", tools=[FN], tool_choice=dict(choice, tools=[{"type": "function", "name": "nope"}])),
            param="tool_choice.tools[0]")
    refused(body("u", tools=[FN], tool_choice=dict(choice, tools="get_weather")), param="tool_choice.tools")
    refused(body("u", tools=[FN], tool_choice=dict(choice, tools=[{"type": "mystery"}])),
            param="tool_choice.tools[0].type")
    refused(body("u", tools=[FN], tool_choice=dict(choice, mode="required", tools=[{"type": "web_search"}])),
            param="tool_choice.tools")


def test_penalties_are_forwarded_and_echoed():
    t = tr(body("u", presence_penalty=0.5, frequency_penalty=-1))
    assert (t.chat["presence_penalty"], t.chat["frequency_penalty"]) == (0.5, -1)
    assert (t.echo["presence_penalty"], t.echo["frequency_penalty"]) == (0.5, -1)
    t = tr(body("u"))
    assert "presence_penalty" not in t.chat and "frequency_penalty" not in t.chat
    assert (t.echo["presence_penalty"], t.echo["frequency_penalty"]) == (0.0, 0.0)
    refused(body("u", presence_penalty=3), param="presence_penalty")
    refused(body("u", frequency_penalty="1"), param="frequency_penalty")


def test_top_logprobs_zero_leaves_logprobs_off():
    t = tr(body("u", top_logprobs=0))
    assert "logprobs" not in t.chat and "top_logprobs" not in t.chat
    assert t.echo["top_logprobs"] == 0
    t = tr(body("u", top_logprobs=2))
    assert (t.chat["logprobs"], t.chat["top_logprobs"], t.echo["top_logprobs"]) == (True, 2, 2)


def test_effective_sampling_values_are_echoed():
    e = tr(body("u")).echo
    assert (e["temperature"], e["top_p"], e["top_logprobs"]) == (1.0, 1.0, 0)
    e = tr(body("u", temperature=0.2, top_p=0.5)).echo
    assert (e["temperature"], e["top_p"]) == (0.2, 0.5)
