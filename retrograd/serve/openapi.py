"""The OpenAPI 3 document retrograd-server publishes at /openapi.json: the management API and the
OpenAI routes, with the request shapes the server validates (the fuzz test generates from it)."""

from __future__ import annotations

ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _answers(ok: str, *errors: int) -> dict:
    out = {ok: {"description": "success", **_json({"type": "object"})}}
    for code in errors:
        out[str(code)] = {"description": "error", **_json(ERROR)}
    return out


RUN_PARAM = {"name": "run", "in": "path", "required": True, "schema": {"type": "string"}}

MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"},
                              {"type": "array", "items": {"type": "object", "properties": {
                                  "type": {"type": "string"}, "text": {"type": "string"}}}}]},
        "tool_call_id": {"type": "string"},
    },
}

CHAT = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "description": "RUN_ID, RUN_ID@final|@best|@latest|@base|@step-N"},
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "seed": {"type": "integer"},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stream": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": "string", "enum": ["auto", "none"]},
        "n": {"type": "integer"},
    },
}

SUBMIT = {
    "type": "object",
    "properties": {
        "config": {"type": "string", "description": "path of a configuration file on the server"},
        "toml": {"type": "string", "description": "the configuration itself"},
        "name": {"type": "string"},
        "base_dir": {"type": "string", "description": "where a TOML body's relative paths resolve"},
    },
}


def document() -> dict:
    run_ops = {
        "/api/runs/{run}": {"get": {"summary": "one run", "parameters": [RUN_PARAM], "responses": _answers("200", 404)}},
        "/api/runs/{run}/metrics": {"get": {"summary": "every metrics record", "parameters": [RUN_PARAM],
                                            "responses": _answers("200", 404)}},
        "/api/runs/{run}/log": {"get": {"summary": "the training log", "parameters": [RUN_PARAM],
                                        "responses": {"200": {"description": "text"}, "404": {"description": "error"}}}},
        "/api/runs/{run}/events": {"get": {"summary": "server-sent events: state, metrics, log, end",
                                           "parameters": [RUN_PARAM],
                                           "responses": {"200": {"description": "text/event-stream"},
                                                         "404": {"description": "error"}}}},
        "/api/runs/{run}/stop": {"post": {"summary": "stop a queued or running run (checkpoint first)",
                                          "parameters": [RUN_PARAM], "responses": _answers("200", 404, 409)}},
        "/api/runs/{run}/resume": {"post": {"summary": "resume a stopped, failed or crashed run",
                                            "parameters": [RUN_PARAM], "responses": _answers("200", 404, 409)}},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "retrograd-server", "version": "1"},
        "paths": {
            "/health": {"get": {"summary": "liveness; requests decoding, waiting", "responses": _answers("200")}},
            "/api/runs": {
                "get": {"summary": "every run with its state and latest metrics", "responses": _answers("200")},
                "post": {"summary": "submit a run", "requestBody": {"required": True, **_json(SUBMIT)},
                         "responses": _answers("201", 400)},
            },
            **run_ops,
            "/v1/models": {"get": {"summary": "the weights every run can answer with", "responses": _answers("200")}},
            "/v1/chat/completions": {"post": {"summary": "OpenAI chat completion",
                                              "requestBody": {"required": True, **_json(CHAT)},
                                              "responses": _answers("200", 400, 404, 409, 413, 429, 503)}},
        },
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type"],
                                     "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                    "param": {"type": "string", "nullable": True},
                                                    "code": {"type": "string", "nullable": True}}}}}}},
    }
