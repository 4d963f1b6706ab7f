"""Every field a pass-through endpoint's server reads, and what it does to the cost (pure data).

The edge owns every field that costs: a pass-through body is rebuilt from the fields below, so
what goes upstream is what was priced (proxy.protocol.passthrough.build). The fields are those
of vLLM 0.32's protocol classes (vllm/entrypoints/openai/chat_completion/protocol.py
ChatCompletionRequest, completion/protocol.py CompletionRequest, pooling/embed/protocol.py,
anthropic/protocol.py AnthropicMessagesRequest), SGLang's OpenAI-compatible extensions, and the
OpenAI and Anthropic APIs. Each field has one rule:

  PLAIN      sampling and format knobs: the same tokens cost the same; forwarded as sent.
  RENDERED   text the chat template or the server turns into prompt tokens: forwarded, and its
             JSON counted in the prompt's bound (the hold and the context check).
  EXTENSION  a server extension that changes the work in a way no hold bounds (a template of the
             client's own, prompt logprobs over the whole prompt, the scheduler's priority, a
             request id the server keys its state by, a KV transfer, code of the client's to run):
             a 400 naming it, unless the operator lists it in `endpoints.allowed_extensions`.
  SILENT     defined by the API the client speaks, not acted on by the model server (OpenAI's
             `store`, Anthropic's `service_tier`): accepted, not forwarded, no notice.

The fields that size the hold (the messages or prompts, the output caps, `n`, `best_of`,
`use_beam_search`, `logprobs`, `top_logprobs`, `min_tokens`, `stream`, `stream_options`, `model`)
are read by `build` itself and listed in OWN. Any other field is unknown: not forwarded (a
field nobody priced never reaches a worker) and named in the `x-token-notice` header
("unknown field(s) ignored: ..."), as /v1/responses treats one.
"""

from __future__ import annotations

PLAIN = "plain"
RENDERED = "rendered"
EXTENSION = "extension"
SILENT = "silent"

# vLLM's sampling extensions every generating endpoint shares (SamplingParams' knobs).
_SAMPLING = dict.fromkeys((
    "frequency_penalty", "presence_penalty", "logit_bias", "seed", "stop", "temperature", "top_p", "top_k",
    "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos",  # runs to the cap, which is held
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "allowed_token_ids", "bad_words", "logprob_token_ids", "add_special_tokens", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "return_tokens_as_token_ids", "return_token_ids",
    "return_token_offsets", "cache_salt", "thinking_token_budget", "repetition_detection", "stream_interval",
    "watermarking", "session_id", "user",
    # SGLang's
    "regex", "ebnf", "json_schema", "no_stop_trim", "lora_path", "separate_reasoning", "stream_reasoning",
), PLAIN)

# Server extensions whose work no hold bounds; refused unless endpoints.allowed_extensions names them.
_EXTENSIONS = dict.fromkeys((
    "prompt_logprobs",  # a logprob row over the vocabulary for every prompt token, and an answer to match
    "priority",  # a place ahead of other keys' requests in the server's queue
    "request_id", "rid",  # the id the server keys a request's state by: another client's id collides
    "kv_transfer_params", "ec_transfer_params",  # disaggregated prefill: KV or encoder caches from elsewhere
    "vllm_xargs", "logits_processors", "custom_logit_processor", "custom_params",  # the client's code and its inputs
    "mm_payload", "return_mm_kwargs", "mm_processor_kwargs", "media_io_kwargs",  # media sizes the bytes do not bound
    "routed_experts_prompt_start", "return_hidden_states", "return_prompt_text",
    "bootstrap_host", "bootstrap_port", "bootstrap_room",
), EXTENSION)

CHAT: dict[str, str] = {
    **_SAMPLING, **_EXTENSIONS,
    "tools": RENDERED, "documents": RENDERED, "chat_template_kwargs": RENDERED,
    "tool_choice": PLAIN, "parallel_tool_calls": PLAIN, "reasoning_effort": PLAIN, "include_reasoning": PLAIN,
    "add_generation_prompt": PLAIN, "continue_final_message": PLAIN,
    "chat_template": EXTENSION,  # a Jinja template of the client's: a loop renders any number of tokens
    "echo": EXTENSION,
    # OpenAI's, not served by vLLM or SGLang
    "store": SILENT, "metadata": SILENT, "service_tier": SILENT, "prediction": SILENT, "modalities": SILENT,
    "audio": SILENT, "web_search_options": SILENT, "safety_identifier": SILENT, "prompt_cache_key": SILENT,
    "prompt_cache_retention": SILENT, "verbosity": SILENT,
}
CHAT_OWN = frozenset(("model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
                      "use_beam_search", "logprobs", "top_logprobs", "min_tokens"))

COMPLETIONS: dict[str, str] = {
    **_SAMPLING, **_EXTENSIONS,
    "suffix": RENDERED,
    "echo": EXTENSION,  # the prompt (and with logprobs, its logprobs) written back as output
    "prompt_embeds": EXTENSION,  # tensors: their rows are tokens no byte count of the body bounds
}
COMPLETIONS_OWN = frozenset(("model", "prompt", "stream", "stream_options", "max_tokens", "n", "best_of",
                             "use_beam_search", "logprobs", "min_tokens"))

EMBEDDINGS: dict[str, str] = {
    "encoding_format": PLAIN, "dimensions": PLAIN, "user": PLAIN, "truncate_prompt_tokens": PLAIN,
    "truncation_side": PLAIN, "padding": PLAIN, "add_special_tokens": PLAIN, "embed_dtype": PLAIN,
    "endianness": PLAIN, "use_activation": PLAIN, "normalize": PLAIN,
    "priority": EXTENSION, "request_id": EXTENSION, "mm_processor_kwargs": EXTENSION,
}
EMBEDDINGS_OWN = frozenset(("model", "input"))

MESSAGES: dict[str, str] = {
    "system": RENDERED, "tools": RENDERED, "chat_template_kwargs": RENDERED,
    "metadata": PLAIN, "output_config": PLAIN, "thinking": PLAIN, "stop_sequences": PLAIN, "temperature": PLAIN,
    "tool_choice": PLAIN, "top_k": PLAIN, "top_p": PLAIN, "cache_salt": PLAIN, "watermarking": PLAIN,
    "mm_payload": EXTENSION, "return_mm_kwargs": EXTENSION, "kv_transfer_params": EXTENSION,
    "ec_transfer_params": EXTENSION, "vllm_xargs": EXTENSION,
    # Anthropic's, not served by vLLM
    "service_tier": SILENT, "container": SILENT, "mcp_servers": SILENT, "context_management": SILENT,
    "inference_geo": SILENT,
}
MESSAGES_OWN = frozenset(("model", "messages", "stream", "max_tokens"))
MESSAGES_COUNT = {k: v for k, v in MESSAGES.items() if k in ("system", "tools", "tool_choice", "thinking",
                                                              "chat_template_kwargs", "mm_payload",
                                                              "output_config", "metadata", "context_management")}
MESSAGES_COUNT_OWN = frozenset(("model", "messages"))

FIELDS: dict[str, tuple[dict[str, str], frozenset[str]]] = {
    "chat": (CHAT, CHAT_OWN),
    "completions": (COMPLETIONS, COMPLETIONS_OWN),
    "embeddings": (EMBEDDINGS, EMBEDDINGS_OWN),
    "messages": (MESSAGES, MESSAGES_OWN),
    "messages_count": (MESSAGES_COUNT, MESSAGES_COUNT_OWN),
}

# Every name `endpoints.allowed_extensions` may list (config.yaml is checked against it).
EXTENSION_NAMES = tuple(sorted({name for table, _ in FIELDS.values() for name, rule in table.items()
                                if rule == EXTENSION}))
