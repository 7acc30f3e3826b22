"""An OpenAI-compatible HTTP server (aiohttp) over one llama.cpp generator: /v1/chat/completions and
/v1/models. Requests are admitted into a bounded queue and served one at a time (never interleaved
into one context); generation runs in a worker thread so the event loop keeps answering. Every
error is an OpenAI-style JSON object, never a 500 for bad input."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import threading
import time
from dataclasses import dataclass

from aiohttp import web

from retrograd.data.chat import ChatFormat
from retrograd.generation.conversation import encode_prompt, read_reply
from retrograd.generation.llama import Generator, SamplingParams
from retrograd.serve.openai_api import (
    ApiError,
    ChatRequest,
    completion_body,
    completion_id,
    message_payload,
    parse_chat_request,
    stream_events,
)

BASE_ID = "base"


@dataclass
class ServedModel:
    id: str
    adapter: bytes | None      # None: the base model


class ModelHost:
    """The generator and the models it can answer as; switching swaps the adapter in memory."""

    def __init__(self, gen: Generator, chat: ChatFormat, models: list[ServedModel]) -> None:
        self.gen = gen
        self.chat = chat
        self.models = {m.id: m for m in models}
        self.created = int(time.time())
        self._seed = 0
        self._lock = threading.Lock()

    def complete(self, req: ChatRequest) -> tuple[dict, str, dict]:
        with self._lock:
            model = self.models[req.model]
            if (model.adapter is None) == self.gen.has_adapter:
                self.gen.set_adapter(model.adapter)
            self._seed += 1
            return answer(self.gen, self.chat, req, self._seed)


def answer(gen: Generator, chat: ChatFormat, req: ChatRequest, seed: int) -> tuple[dict, str, dict]:
    """One chat completion with whatever adapter `gen` holds: (message, finish reason, usage)."""
    prompt = encode_prompt(gen.tokenizer, chat, req.messages, req.tools)
    room = gen.n_ctx - len(prompt) - 1
    if room < 1:
        raise ApiError(400, f"messages: the prompt has {len(prompt)} tokens, the context holds "
                            f"{gen.n_ctx}", param="messages", code="context_length_exceeded")
    max_new = min(req.max_tokens or room, room)
    params = SamplingParams(req.temperature, req.top_p, 0, max_new,
                            req.seed if req.seed is not None else seed, tuple(req.stop))
    out = gen.generate(prompt, [params])[0]
    finish = "stop" if out.finish_reason == "stop" else "length"
    reply = read_reply(out.text, req.tools)
    msg = reply.message()
    content, calls = msg["content"], msg.get("tool_calls", [])
    if calls:
        finish = "tool_calls"
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out.tokens),
             "total_tokens": len(prompt) + len(out.tokens)}
    return message_payload(content, calls), finish, usage


async def read_json(request: web.Request) -> tuple[bytes, object]:
    """The raw body and its JSON (ApiError 400 when it is not JSON)."""
    raw = await request.read()
    try:
        return raw, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None


async def read_chat_request(request: web.Request) -> ChatRequest:
    """The validated request body (ApiError 400 naming the field otherwise)."""
    return parse_chat_request((await read_json(request))[1])


async def respond(request: web.Request, req: ChatRequest, answered: tuple[dict, str, dict],
                  headers: dict | None = None) -> web.StreamResponse:
    """The completion as one JSON body, or as server-sent events when the request streams."""
    message, finish, usage = answered
    cid = completion_id()
    if not req.stream:
        return web.json_response(completion_body(cid, req.model, message, finish, usage), headers=headers)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **(headers or {})})
    await resp.prepare(request)
    try:
        for event in stream_events(cid, req.model, message, finish, usage):
            await resp.write(event)
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return resp


def _json_error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorized(request: web.Request, api_key: str | None) -> bool:
    """The key as `Authorization: Bearer KEY` (API clients) or the `retrograd_key` cookie (the web page)."""
    if api_key is None:
        return True
    return (hmac.compare_digest(request.headers.get("Authorization", ""), f"Bearer {api_key}")
            or hmac.compare_digest(request.cookies.get("retrograd_key", ""), api_key))


def error_middleware(api_key: str | None, max_body_bytes: int, open_paths: tuple[str, ...] = (),
                     unauthorized=None):
    """API-key check (every path but `open_paths`) and every failure as an OpenAI-style JSON error."""

    @web.middleware
    async def errors(request: web.Request, handler):
        if request.path not in open_paths and not authorized(request, api_key):
            if unauthorized is not None:
                page = unauthorized(request)
                if page is not None:
                    return page
            return _json_error(ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                        code="invalid_api_key", kind="authentication_error"))
        try:
            return await handler(request)
        except ApiError as exc:
            return _json_error(exc)
        except web.HTTPRequestEntityTooLarge:
            return _json_error(ApiError(413, f"the request body exceeds {max_body_bytes} bytes", code="too_large"))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _json_error(ApiError(exc.status, exc.reason or "error", code=str(exc.status)))

    return errors


def create_app(host: ModelHost, *, api_key: str | None = None, queue: int = 8,
               max_body_bytes: int = 4 << 20) -> web.Application:
    waiting = 0
    turn = asyncio.Lock()

    async def models(_request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": host.created, "owned_by": "retrograd"} for m in host.models]
        return web.json_response({"object": "list", "data": data})

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        nonlocal waiting
        req = await read_chat_request(request)
        if req.model not in host.models:
            raise ApiError(404, f"model: no model {req.model!r}; this server has {', '.join(host.models)}",
                           param="model", code="model_not_found")
        if waiting >= queue:
            raise ApiError(429, f"the server is busy ({waiting} requests waiting)", code="queue_full")
        waiting += 1
        try:
            async with turn:
                if request.transport is None or request.transport.is_closing():
                    raise web.HTTPRequestTimeout(reason="client went away")     # nobody to answer
                answered = await asyncio.get_running_loop().run_in_executor(None, host.complete, req)
        finally:
            waiting -= 1
        return await respond(request, req, answered)

    app = web.Application(middlewares=[error_middleware(api_key, max_body_bytes)], client_max_size=max_body_bytes)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
