"""The OpenAPI description of the pass-through endpoints (proxy.http.passthrough_handler), merged into
/openapi.json by proxy.http.openapi: /v1/chat/completions, /v1/completions, /v1/embeddings in
the OpenAI error envelope, /v1/messages and /v1/messages/count_tokens in Anthropic's. The request
schemas name what the edge reads (the rest of a body goes upstream as sent)."""

from __future__ import annotations

from typing import Any

# What a refusal on these routes means (the Responses route's table, less what only it does).
_STATUSES: dict[int, str] = {
    400: "The request is invalid (bad JSON, a field of the wrong type, n or best_of above 1, echo, too many "
         "items, a refused image URL, or a context window overflow), or the model server refused it.",
    401: "The API key is missing or invalid (Authorization: Bearer, or x-api-key).",
    402: "The available balance does not cover the request.",
    403: "The API key may not use this model.",
    404: "The model does not exist, the endpoint is turned off (endpoints.*: endpoint_disabled), or no worker "
         "serves this path (endpoint_not_served, naming the worker).",
    408: "The request body arrived too slowly.",
    413: "The request body is larger than server.max_body_bytes.",
    415: "The Content-Encoding is not supported.",
    429: "Capacity is exhausted, or a concurrency or rate limit is reached.",
    502: "The model server failed or could not be reached.",
    503: "No worker can take the request.",
    504: "The model server timed out before answering.",
}
_REFUSALS = (400, 401, 402, 403, 404, 408, 413, 415, 429, 502, 503, 504)

_OPENAI_ERR = {"$ref": "#/components/schemas/ErrorEnvelope"}
_ANTHROPIC_ERR = {"$ref": "#/components/schemas/AnthropicErrorEnvelope"}

ANTHROPIC_ENVELOPE = {
    "type": "object",
    "required": ["type", "error"],
    "additionalProperties": False,
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"], "additionalProperties": False,
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}

_CAP = {"type": ["integer", "null"], "minimum": 1}
_MODEL = {"type": "string", "description": "A model id from GET /v1/models (resolved as for /v1/responses)."}
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_PROMPT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
                     {**_TOKENS, "minItems": 1}, {"type": "array", "items": _TOKENS, "minItems": 1}]}
_CHAT_MESSAGE = {"type": "object", "required": ["role"],
                 "properties": {"role": {"type": "string",
                                         "enum": ["system", "developer", "user", "assistant", "tool"]},
                                "content": {"oneOf": [{"type": "string"}, {"type": "array"}, {"type": "null"}]}}}
_ANTHROPIC_MESSAGE = {"type": "object", "required": ["role", "content"],
                      "properties": {"role": {"type": "string", "enum": ["user", "assistant"]},
                                     "content": {"oneOf": [{"type": "string"}, {"type": "array",
                                                                                "items": {"type": "object"}}]}}}
_STREAM_OPTIONS = {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}}

CHAT_REQUEST = {
    "type": "object", "required": ["model", "messages"],
    "properties": {"model": _MODEL, "messages": {"type": "array", "items": _CHAT_MESSAGE, "minItems": 1},
                   "stream": {"type": ["boolean", "null"]}, "stream_options": _STREAM_OPTIONS,
                   "max_tokens": _CAP, "max_completion_tokens": _CAP, "n": {"enum": [1, None]},
                   "tools": {"type": "array", "items": {"type": "object"}}},
}
COMPLETIONS_REQUEST = {
    "type": "object", "required": ["model", "prompt"],
    "properties": {"model": _MODEL, "prompt": _PROMPT, "stream": {"type": ["boolean", "null"]},
                   "stream_options": _STREAM_OPTIONS, "max_tokens": _CAP, "echo": {"enum": [False, None]},
                   "n": {"enum": [1, None]}, "best_of": {"enum": [1, None]}},
}
EMBEDDINGS_REQUEST = {
    "type": "object", "required": ["model", "input"],
    "properties": {"model": _MODEL, "input": _PROMPT, "encoding_format": {"type": "string", "enum": ["float"]},
                   "dimensions": {"type": "integer", "minimum": 1}},
}
MESSAGES_REQUEST: dict[str, Any] = {
    "type": "object", "required": ["model", "messages", "max_tokens"],
    "properties": {"model": _MODEL, "messages": {"type": "array", "items": _ANTHROPIC_MESSAGE},
                   "max_tokens": {"type": "integer", "minimum": 1}, "stream": {"type": ["boolean", "null"]},
                   "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                   "tools": {"type": "array", "items": {"type": "object"}}},
}
COUNT_REQUEST = {
    "type": "object", "required": ["model", "messages"],
    "properties": {"model": _MODEL, "messages": {"type": "array", "items": _ANTHROPIC_MESSAGE},
                   "system": MESSAGES_REQUEST["properties"]["system"],
                   "tools": {"type": "array", "items": {"type": "object"}}},
}

_ANSWER = {"type": "object"}  # the model server's answer, passed through as its bytes


def _operation(operation: str, request: dict, ok: str, *, stream: bool, anthropic: bool = False) -> dict[str, Any]:
    err = _ANTHROPIC_ERR if anthropic else _OPENAI_ERR
    content: dict[str, Any] = {"application/json": {"schema": _ANSWER}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    responses: dict[str, Any] = {"200": {"description": ok, "content": content}}
    responses.update({str(s): {"description": _STATUSES[s], "content": {"application/json": {"schema": err}}}
                      for s in _REFUSALS})
    return {"post": {
        "operationId": operation,
        "security": [{"bearer": []}, {"apiKey": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": responses,
    }}


EDGE_PATHS: dict[str, Any] = {
    "/v1/chat/completions": _operation(
        "createChatCompletion", CHAT_REQUEST,
        "The model server's chat completion as it sent it, or with stream: true its chunks (the usage chunk the "
        "proxy asked for itself is not passed on; a failure after the headers is a data: {\"error\"} event).",
        stream=True),
    "/v1/completions": _operation(
        "createCompletion", COMPLETIONS_REQUEST,
        "The model server's text completion as it sent it, or its chunks with stream: true.", stream=True),
    "/v1/embeddings": _operation(
        "createEmbedding", EMBEDDINGS_REQUEST,
        "The model server's embeddings as it sent them (billed its prompt_tokens).", stream=False),
    "/v1/messages": _operation(
        "createMessage", MESSAGES_REQUEST,
        "Anthropic's Message from a worker that serves /v1/messages (vLLM, SGLang), or its events with stream: "
        "true (a failure after the headers is an event: error). Errors in Anthropic's envelope.",
        stream=True, anthropic=True),
    "/v1/messages/count_tokens": _operation(
        "countMessageTokens", COUNT_REQUEST,
        "{input_tokens} from the worker's tokenizer. Nothing is billed.", stream=False, anthropic=True),
}
