"""The OpenAPI 3.1 description of the proxy's public endpoints, served at GET /openapi.json.

It is the contract the schemathesis run (tests/http/test_schemathesis.py) holds the live proxy
to: every documented status answers in the error envelope, nothing else is answered.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.http.openapi_edge import ANTHROPIC_ENVELOPE, EDGE_PATHS

__all__ = ["openapi_document", "openapi_handler", "ERROR_STATUSES"]

# What each status means on this proxy (the README / spec error tables, plus the transport limits).
ERROR_STATUSES: dict[int, str] = {
    400: "The request is invalid (bad JSON, a field of the wrong type, too deep, too many items or tools, "
         "a refused image URL, or a context window overflow).",
    401: "The API key is missing or invalid.",
    402: "The available balance does not cover the request.",
    403: "The API key may not use this model.",
    404: "The model does not exist or is unavailable.",
    408: "The request body arrived too slowly.",
    413: "The request body is larger than server.max_body_bytes.",
    405: "GET /v1/responses without a WebSocket upgrade (or with websocket.enabled false).",
    415: "The Content-Encoding is not supported.",
    429: "Capacity is exhausted, or a concurrency or rate limit is reached.",
    501: "Compaction needs a sealing key (reasoning_seal.keys) the operator has not configured.",
    502: "The model server failed or could not be reached.",
    503: "No worker can take the request.",
    504: "The model server timed out before answering.",
}

_ERR = {"$ref": "#/components/schemas/ErrorEnvelope"}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": ERROR_STATUSES[s], "content": {"application/json": {"schema": _ERR}}}
            for s in statuses}


_CONTENT_PART = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["input_text", "output_text", "input_image", "refusal"]},
        "text": {"type": "string"},
        "image_url": {"type": "string"},
    },
    "required": ["type"],
}

_INPUT_ITEM = {
    "type": "object",
    "description": "A message, function_call, function_call_output, reasoning, compaction or hosted-tool item; "
                   "as the last item, a compaction_trigger: the answer is then one compaction item, the "
                   "window's summary sealed to the key (501 without a sealing key).",
    "properties": {
        "type": {"type": "string"},
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART}]},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
        "output": {"type": "string"},
    },
}

_TOOL = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["function", "custom", "namespace", "web_search", "file_search",
                                            "code_interpreter", "mcp", "local_shell", "image_generation"]},
        "name": {"type": "string"},
        "description": {"type": "string"},
        "parameters": {"type": "object"},
        "strict": {"type": "boolean"},
    },
    "required": ["type"],
}

_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "description": "A model id from GET /v1/models (a leading vendor/ segment "
                                                   "is stripped only when no worker serves the exact name)."},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _INPUT_ITEM}]},
        "instructions": {"type": ["string", "null"]},
        "stream": {"type": ["boolean", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
        "tools": {"type": "array", "items": _TOOL},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "reasoning": {"type": ["object", "null"]},
        "text": {"type": ["object", "null"]},
        "include": {"type": ["array", "null"], "items": {"type": "string"}},
        "prompt_cache_key": {"type": ["string", "null"]},
        "user": {"type": ["string", "null"]},
        "safety_identifier": {"type": ["string", "null"]},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "store": {},
        "provider": {"type": "object"},
    },
}

_USAGE = {
    "type": ["object", "null"],
    "properties": {
        "input_tokens": {"type": "integer"},
        "input_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "output_tokens": {"type": "integer"},
        "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": {"type": "integer"}}},
        "total_tokens": {"type": "integer"},
    },
}

_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string", "pattern": "^resp_"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "completed_at": {"type": ["integer", "null"]},
        "status": {"type": "string", "enum": ["completed", "incomplete", "failed", "in_progress"]},
        "error": {"type": ["object", "null"]},
        "incomplete_details": {"type": ["object", "null"]},
        "model": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object", "required": ["type"]}},
        "usage": _USAGE,
        # the effective sampling values: numbers, never null (the Open Responses spec)
        "temperature": {"type": "number"},
        "top_p": {"type": "number"},
        "presence_penalty": {"type": "number"},
        "frequency_penalty": {"type": "number"},
        "top_logprobs": {"type": "integer"},
        "ai_generated": {"type": "boolean"},
        "ai_notice": {"type": "string"},
    },
}

_ENVELOPE = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_COMPACT_REQUEST = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _INPUT_ITEM}, {"type": "null"}]},
        "instructions": {"type": ["string", "null"]},
        "prompt_cache_key": {"type": ["string", "null"]},
    },
}

_COMPACTION = {
    "type": "object",
    "required": ["id", "object", "created_at", "output", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^resp_"},
        "object": {"const": "response.compaction"},
        "created_at": {"type": "integer"},
        "output": {"type": "array", "items": {"type": "object", "required": ["type"]},
                   "description": "The latest user messages as they were (at most compact.keep_recent_items), "
                                  "then one compaction item (the window's summary, sealed)."},
        "usage": _USAGE,
    },
}

# The WebSocket transport as the Open Responses spec describes it (its `x-openresponses-websocket`).
_WEBSOCKET = {
    "description": "Open a WebSocket connection to /v1/responses (the key is checked at the handshake). Send "
                   "{\"type\": \"response.create\", ...the request body without stream, stream_options, "
                   "background}; the server sends the streaming events of the HTTP stream, one per message, "
                   "and failures as {\"type\": \"error\", \"status\", \"error\": {\"code\", \"message\"}}. "
                   "previous_response_id continues the connection's last response (kept in its memory only).",
    "clientMessage": {"type": "object", "required": ["type"], "properties": {"type": {"const": "response.create"}}},
    "errorMessage": {"type": "object", "required": ["type", "status", "error"],
                     "properties": {"type": {"const": "error"}, "status": {"type": "integer"},
                                    "error": {"type": "object", "required": ["code", "message"]}}},
}

_WEBSOCKET_UPGRADE = {
    "operationId": "openResponsesWebSocket",
    "security": [{"bearer": []}],
    "responses": {
        "101": {"description": "Switching Protocols: the WebSocket transport (see x-openresponses-websocket)."},
        **_errors(401, 405),
    },
}

_COMPACT = {
    "operationId": "compactResponse",
    "security": [{"bearer": []}],
    "requestBody": {"required": True, "content": {"application/json": {"schema": _COMPACT_REQUEST}}},
    "responses": {
        "200": {"description": "The compacted window (nothing is stored); the summary is billed as any request.",
                "content": {"application/json": {"schema": _COMPACTION}}},
        **_errors(400, 401, 402, 403, 404, 408, 413, 415, 429, 501, 502, 503, 504),
    },
}

_JSON_REQUEST = {"required": True,
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}}


_KEY_PATH: dict[str, Any] = {
    "get": {
        "operationId": "getKey",
        "security": [{"bearer": []}],
        "responses": {
            "200": {
                "description": "The caller's own key (as OpenRouter's key endpoint): its balance, limits, "
                               "spend today and this month (UTC). Nothing about other keys.",
                "content": {"application/json": {"schema": {
                    "type": "object", "required": ["data"], "properties": {"data": {
                        "type": "object", "required": ["label", "key_id", "limits"],
                        "properties": {"label": {"type": "string"}, "key_id": {"type": "string"},
                                       "balance_micros": {"type": ["integer", "null"]},
                                       "limit_remaining": {"type": ["number", "null"]},
                                       "limits": {"type": "object"}}}}}}},
            },
            **_errors(400, 401, 429),  # 400: a request the HTTP parser refused (malformed headers)
        },
    }
}


_MODELS_PATH: dict[str, Any] = {
    "get": {
        "operationId": "listModels",
        "security": [{"bearer": []}],
        "responses": {
            "200": {
                "description": "The union of the workers' models.",
                "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                        "type": "object", "required": ["id", "object"],
                        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                       "context_window": {"type": "integer"}}}}}}}},
            },
            **_errors(400, 401, 429),  # 400: a request the HTTP parser refused (malformed headers)
        },
    }
}

_OPENAPI_PATH: dict[str, Any] = {"get": {"operationId": "openapi", "security": [], "responses": {"200": {
    "description": "This description.", "content": {"application/json": {"schema": {"type": "object"}}}}}}}


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "responses-proxy",
            "version": "0.1.0",
            "description": "A stateless OpenAI Responses API in front of vLLM and SGLang chat-completions servers, "
                           "and their other APIs passed through. Every error is the OpenAI envelope "
                           "{\"error\": {message, type, param, code}}; on /v1/messages and "
                           "/v1/messages/count_tokens, Anthropic's {\"type\": \"error\", \"error\": {type, message}}.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
            "schemas": {"ResponsesRequest": _REQUEST, "Response": _RESPONSE, "ErrorEnvelope": _ENVELOPE,
                        "AnthropicErrorEnvelope": ANTHROPIC_ENVELOPE, "Usage": _USAGE},
        },
        "paths": {
            "/v1/responses": {
                "x-openresponses-websocket": _WEBSOCKET,
                "get": _WEBSOCKET_UPGRADE,
                "post": {
                    "operationId": "createResponse",
                    "security": [{"bearer": []}],
                    "requestBody": _JSON_REQUEST,
                    "responses": {
                        "200": {
                            "description": "The Response object, or with stream: true its server-sent events "
                                           "(an error after the headers is a response.failed event).",
                            "content": {
                                "application/json": {"schema": {"$ref": "#/components/schemas/Response"}},
                                "text/event-stream": {"schema": {"type": "string"}},
                            },
                        },
                        **_errors(400, 401, 402, 403, 404, 408, 413, 415, 429, 501, 502, 503, 504),
                    },
                }
            },
            "/v1/responses/compact": {"post": _COMPACT},
            "/v1/responses/input_tokens": {
                "post": {
                    "operationId": "countInputTokens",
                    "security": [{"bearer": []}],
                    "requestBody": _JSON_REQUEST,
                    "responses": {
                        "200": {
                            "description": "The input token count, from the worker's own tokenizer. Nothing is billed.",
                            "content": {"application/json": {"schema": {
                                "type": "object", "required": ["object", "input_tokens"],
                                "properties": {"object": {"const": "response.input_tokens"},
                                               "input_tokens": {"type": "integer", "minimum": 0}}}}},
                        },
                        **_errors(400, 401, 403, 404, 408, 413, 415, 429, 501, 502, 503, 504),
                    },
                }
            },
            "/v1/models": _MODELS_PATH,
            "/v1/key": _KEY_PATH,
            "/livez": _probe("livez", "Liveness: the process answers (no dependency is checked).", None),
            "/healthz": _probe("healthz", "Liveness, as /livez.", None),
            "/readyz": _probe("readyz", "Readiness: some worker takes traffic and the ledger answers.",
                              "Not ready: no worker takes traffic (reason no_worker) or the ledger does not "
                              "answer (reason ledger)."),
            "/openapi.json": _OPENAPI_PATH,
            **EDGE_PATHS,
        },
    }


def _probe(operation: str, ok: str, unavailable: str | None) -> dict:
    status = {"type": "object", "required": ["status"], "additionalProperties": False,
              "properties": {"status": {"type": "string"}, "reason": {"type": "string"}}}
    responses = {"200": {"description": ok, "content": {"application/json": {"schema": status}}}}
    if unavailable:
        responses["503"] = {"description": unavailable, "content": {"application/json": {"schema": status}}}
    return {"get": {"operationId": operation, "security": [], "responses": responses}}


_CACHED: bytes | None = None


async def openapi_handler(request: web.Request) -> web.Response:
    global _CACHED
    if _CACHED is None:
        _CACHED = orjson.dumps(openapi_document())
    return web.Response(body=_CACHED, content_type="application/json")
