"""The OpenAI chat-completions contract: validating a request (400s that name the field) and
building the response objects, streamed or not. No I/O here."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def error_body(exc: Exception) -> dict:
    """An exception as {"status", "body"} to send across a process boundary."""
    if isinstance(exc, ApiError):
        return {"status": exc.status, "body": exc.body()}
    return {"status": 500, "body": ApiError(500, f"{type(exc).__name__}: {exc}", code="internal_error",
                                            kind="server_error").body()}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: Any = "auto"


ROLES = ("system", "developer", "user", "assistant", "tool")


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"expected a number, got {v!r}")
    if not lo <= v <= hi:
        raise _bad(key, f"must be between {lo} and {hi}, got {v}")
    return float(v)


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:      # JSON's \ud800 escapes can carry what no tokenizer can encode
        raise ApiError(400, "the request contains text that is not valid Unicode (a lone surrogate)") from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "a model id is required")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "expected a non-empty list of messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}].role", f"expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):   # content parts: keep the text ones
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                parts.append(p["text"])
            content = "".join(parts)
        if content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "expected a string or a list of text parts")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise _bad(f"messages[{i}].tool_calls", "expected a list")
            msg["tool_calls"] = m["tool_calls"]
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        clean.append(msg)
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise _bad("n", "only n = 1 is supported")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs", "log-probabilities are not returned by this server")
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(key):
            raise _bad(key, "penalties are not supported")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit bias is not supported")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise _bad("response_format", "only {\"type\": \"text\"} is supported")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                  and isinstance(t["function"].get("name"), str) for t in tools):
            raise _bad("tools", "expected a list of {\"type\": \"function\", \"function\": {\"name\", ...}}")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        raise _bad("tool_choice", "only \"auto\" and \"none\" are supported")
    if tool_choice not in ("auto", "none", None):
        raise _bad("tool_choice", f"expected \"auto\" or \"none\", got {tool_choice!r}")
    if tools and body.get("parallel_tool_calls") is False:
        raise _bad("parallel_tool_calls", "false is not supported beside tools")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _bad("max_tokens", f"expected a positive integer, got {max_tokens!r}")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", f"expected an integer, got {seed!r}")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "expected a string or a list of strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected true or false, got {stream!r}")
    return ChatRequest(model, clean, _number(body, "temperature", 1.0, 0.0, 2.0), _number(body, "top_p", 1.0, 0.0, 1.0),
                       max_tokens, seed, stop, stream, tools if tool_choice != "none" else None, tool_choice or "auto")


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def message_payload(content: str | None, tool_calls: list[dict]) -> dict:
    msg: dict = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def completion_body(cid: str, model: str, message: dict, finish: str, usage: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage, "system_fingerprint": "retrograd"}


def stream_chunk(cid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
                 extra: dict | None = None) -> bytes:
    """One server-sent `chat.completion.chunk` event."""
    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
    if extra:
        body.update(extra)
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def stream_events(cid: str, model: str, message: dict, finish: str, usage: dict) -> list[bytes]:
    """An answer known whole (tool calls, live weights): one delta, then the finish reason, then [DONE]."""
    created = int(time.time())
    delta: dict = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    return [stream_chunk(cid, model, created, delta), stream_chunk(cid, model, created, {}, finish, {"usage": usage}),
            b"data: [DONE]\n\n"]
