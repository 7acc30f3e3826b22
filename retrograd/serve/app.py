"""An OpenAI-compatible HTTP server (aiohttp) over one llama.cpp generator: /v1/chat/completions,
/v1/models and /health. Requests are decoded together by a scheduler thread (serve/scheduler.py,
continuous batching); a handler prepares the prompt, hands the job over, streams its text as it is
decoded and cancels it when the client goes away. Every error is an OpenAI-style JSON object, never
a 500 for bad input."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from retrograd.data.chat import ChatFormat
from retrograd.generation.conversation import encode_prompt, read_reply
from retrograd.generation.llama import Generator, SamplingParams
from retrograd.generation.sampling import Completion
from retrograd.serve.openai_api import (
    ApiError,
    ChatRequest,
    completion_body,
    completion_id,
    message_payload,
    parse_chat_request,
    stream_chunk,
    stream_events,
)
from retrograd.serve.scheduler import Job, Scheduler

BASE_ID = "base"


@dataclass
class ServedModel:
    id: str
    adapter: bytes | None      # None: the base model


class ModelHost:
    """The generator's scheduler and the models it can answer as (each model id is an adapter group)."""

    def __init__(self, sched: Scheduler, chat: ChatFormat, models: list[ServedModel]) -> None:
        self.sched = sched
        self.chat = chat
        self.models = {m.id: m for m in models}
        self.created = int(time.time())
        self.seed = 0

    def adapter_of(self, model_id: str) -> bytes | None:
        return self.models[model_id].adapter


def prepare(gen: Generator, chat: ChatFormat, req: ChatRequest, seed: int) -> tuple[list[int], SamplingParams]:
    """The prompt and sampling settings of a request (ApiError 400 when the prompt fills the context)."""
    prompt = encode_prompt(gen.tokenizer, chat, req.messages, req.tools)
    room = gen.n_ctx - len(prompt) - 1
    if room < 1:
        raise ApiError(400, f"messages: the prompt has {len(prompt)} tokens, the context holds "
                            f"{gen.n_ctx}", param="messages", code="context_length_exceeded")
    max_new = min(req.max_tokens or room, room)
    return prompt, SamplingParams(req.temperature, req.top_p, 0, max_new,
                                  req.seed if req.seed is not None else seed, tuple(req.stop))


def finish(out: Completion, prompt: list[int], req: ChatRequest) -> tuple[dict, str, dict]:
    """A completion as (message, finish reason, usage)."""
    finish = "stop" if out.finish_reason == "stop" else "length"
    msg = read_reply(out.text, req.tools).message()
    content, calls = msg["content"], msg.get("tool_calls", [])
    if calls:
        finish = "tool_calls"
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out.tokens),
             "total_tokens": len(prompt) + len(out.tokens)}
    return message_payload(content, calls), finish, usage


def answer(gen: Generator, chat: ChatFormat, req: ChatRequest, seed: int) -> tuple[dict, str, dict]:
    """One chat completion decoded alone with whatever adapter `gen` holds (retrograd-server's live
    weights, at a step callback): (message, finish reason, usage)."""
    prompt, params = prepare(gen, chat, req, seed)
    return finish(gen.generate(prompt, [params])[0], prompt, req)


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def _until(request: web.Request, job: Job, waiter: asyncio.Future) -> None:
    """Wait for `waiter`; a client that goes away meanwhile cancels the job (its slot frees at the next step)."""
    while not waiter.done():
        await asyncio.wait([waiter, job.done], timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
        if job.done.done() and not waiter.done():
            return
        if _gone(request):
            job.cancel()
            raise web.HTTPRequestTimeout(reason="client went away")


async def serve_chat(request: web.Request, sched: Scheduler, chat: ChatFormat, req: ChatRequest, key, seed: int,
                     headers: dict | None = None) -> web.StreamResponse:
    """Answer a validated request through `sched` with the adapter group `key`. A streaming request
    without tools gets its text as it is decoded; with tools, in one piece once the calls are read."""
    prompt, params = prepare(sched.gen, chat, req, seed)
    live = req.stream and not req.tools
    job = sched.submit(key, prompt, params, stream=live)
    try:
        if job.pieces is None:              # not live
            await _until(request, job, job.done)
            return await respond(request, req, finish(job.done.result(), prompt, req), headers)
        pieces = job.pieces
        first = asyncio.ensure_future(pieces.get())
        try:
            await _until(request, job, first)
        finally:
            if not first.done():
                first.cancel()
        if job.done.done() and (exc := job.done.exception()) is not None:
            raise exc
        return await _stream(request, req, job, pieces, first.result() if first.done() else "", prompt, headers)
    finally:
        if not job.done.done():
            job.cancel()


async def _stream(request: web.Request, req: ChatRequest, job: Job, pieces: asyncio.Queue, piece: str,
                  prompt: list[int], headers: dict | None) -> web.StreamResponse:
    cid, created = completion_id(), int(time.time())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **(headers or {})})
    await resp.prepare(request)
    try:
        await resp.write(stream_chunk(cid, req.model, created, {"role": "assistant", "content": piece}))
        while True:
            get = asyncio.ensure_future(pieces.get())
            await _until(request, job, get)
            if not get.done():          # finished: what is left in the queue, then the end
                get.cancel()
                break
            await resp.write(stream_chunk(cid, req.model, created, {"content": get.result()}))
        while not pieces.empty():
            await resp.write(stream_chunk(cid, req.model, created, {"content": pieces.get_nowait()}))
        if (exc := job.done.exception()) is not None:
            raise exc
        _, reason, usage = finish(job.done.result(), prompt, req)
        await resp.write(stream_chunk(cid, req.model, created, {}, reason, {"usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError, web.HTTPRequestTimeout, ApiError):
        job.cancel()
    return resp


async def read_json(request: web.Request) -> tuple[bytes, Any]:
    """The raw body and its JSON value, as json.loads gives it (ApiError 400 when it is not JSON)."""
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


def create_app(host: ModelHost, *, api_key: str | None = None, max_body_bytes: int = 4 << 20) -> web.Application:
    async def models(_request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": host.created, "owned_by": "retrograd"} for m in host.models]
        return web.json_response({"object": "list", "data": data})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "models": list(host.models), **host.sched.stats()})

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        req = await read_chat_request(request)
        if req.model not in host.models:
            raise ApiError(404, f"model: no model {req.model!r}; this server has {', '.join(host.models)}",
                           param="model", code="model_not_found")
        host.seed += 1
        return await serve_chat(request, host.sched, host.chat, req, req.model, host.seed)

    app = web.Application(middlewares=[error_middleware(api_key, max_body_bytes, open_paths=("/health",))],
                          client_max_size=max_body_bytes)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
