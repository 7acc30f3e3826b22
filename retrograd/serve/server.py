"""retrograd-server's HTTP side (aiohttp): the management API (submit, list, follow, stop and
resume runs), the OpenAI routes answering as RUN_ID[@final|@best|@step-N|@latest|@base], the web
page and the OpenAPI document. Every error is a JSON object with a message that names what is
wrong; nothing a client sends produces a 500."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path

from aiohttp import web

from retrograd import checkpoint as ckpt
from retrograd.config import Config
from retrograd.errors import RetrogradError
from retrograd.serve.app import error_middleware, read_json, respond
from retrograd.serve.follow import finite, follow
from retrograd.serve.openai_api import ApiError, parse_chat_request
from retrograd.serve.openapi import document
from retrograd.serve.pool import ModelPool
from retrograd.serve.runs import ACTIVE
from retrograd.serve.supervisor import Supervisor

RUN_WEIGHTS = ("final", "base")  # besides the checkpoints: the run's adapter.gguf and the base model alone
MAX_SUBMIT_BYTES = 1 << 20      # a configuration
HARD_LIMIT = 64 << 20           # any body; a chat request is then held to its run's [serving].max_body_bytes


def split_ref(model: str) -> tuple[str, str | None]:
    """'RUN' -> (RUN, None); 'RUN@best' -> (RUN, 'best'); 'RUN@step-12' -> (RUN, 'step-12')."""
    run_id, _, which = model.partition("@")
    if not which:
        return run_id, None
    ref = ckpt.parse_ref(which, also=RUN_WEIGHTS)
    if ref is not None:
        return run_id, ref
    raise ApiError(404, f"model: {model!r}: unknown weights @{which} (expected @final, @best, @latest, @base or "
                        "@step-N)", param="model", code="model_not_found")


class RunServer:
    def __init__(self, state_dir: Path, *, api_key: str | None = None, exclusive_cpu: bool = True) -> None:
        self.pool = ModelPool()
        self.sup = Supervisor(state_dir, on_device_change=lambda _run: self.pool.release())
        self.api_key = api_key
        self.exclusive_cpu = exclusive_cpu
        self.waiting: dict[str, int] = defaultdict(int)
        self._configs: dict[str, Config] = {}
        self.started = int(time.time())

    # ---- models ----------------------------------------------------------------------------
    def model_ids(self) -> list[str]:
        ids = []
        for rec in self.sup.runs.values():
            store = self.sup.store
            if (rec.state in ACTIVE and rec.serving.get("enabled")) or store.adapter(rec.id, "final"):
                ids.append(rec.id)
            ids += [f"{rec.id}@{w}" for w in ("final", "best", "latest") if store.adapter(rec.id, w)]
            ids += [f"{rec.id}@{ckpt.step_ref(s)}" for s in store.steps(rec.id)]
            ids.append(f"{rec.id}@base")
        return ids

    async def complete(self, request: web.Request, body: dict) -> web.StreamResponse:
        """Answer a chat body: live weights through the training process (at its next step), saved
        weights through the pool's batching scheduler. Headers say which weights answered."""
        req = parse_chat_request(body)
        run_id, which = split_ref(req.model)
        try:
            rec = self.sup.get(run_id)
        except ApiError as exc:
            raise ApiError(404, f"model: {exc.message}", param="model", code="model_not_found") from None
        if which is None and rec.state in ACTIVE:
            if not rec.serving.get("enabled"):
                raise ApiError(409, f"model: run {run_id} is training and does not serve live weights "
                                    f"([serving].enabled = false in its configuration); ask for {run_id}@latest",
                               param="model", code="live_serving_disabled")
            limit = rec.serving.get("queue", 8)
            if self.waiting[run_id] >= limit:
                raise ApiError(429, f"run {run_id} is busy: {self.waiting[run_id]} live requests are waiting for its "
                                    f"next step (its [serving].queue is {limit}); retry later", code="queue_full")
            self.waiting[run_id] += 1
            try:
                with contextlib.suppress(LookupError):       # the run ended meanwhile: its final adapter
                    answer, step = await self.sup.live_chat(run_id, body)
                    return await respond(request, req, tuple(answer), headers={
                        "X-Retrograd-Weights": f"{run_id}@live", "X-Retrograd-Step": str(step)})
            finally:
                self.waiting[run_id] -= 1
        which = which or "final"
        adapter = None
        if which != "base":
            adapter = self.sup.store.adapter(run_id, which)
            if adapter is None:
                steps = self.sup.store.steps(run_id)
                have = ", ".join(f"@{ckpt.step_ref(s)}" for s in steps) or "no checkpoints yet"
                raise ApiError(404, f"model: run {run_id} ({rec.state}, step {rec.step}) has no {which} adapter"
                                    f" (saved: {have})", param="model", code="model_not_found")
        await self.wait_for_device(rec)
        try:
            return await self.pool.serve(request, self.config(rec), adapter, req,
                                         {"X-Retrograd-Weights": f"{run_id}@{which}"})
        except RetrogradError as exc:
            raise ApiError(503, f"model: cannot load {req.model}: {exc}", param="model",
                           code="model_unavailable", kind="server_error") from None

    async def wait_for_device(self, rec) -> None:
        """Loading a model needs the device: wait the run's device_wait_seconds for a training run
        to let go of it (CPU included unless the server was started with --share-cpu)."""
        deadline = time.monotonic() + rec.serving.get("device_wait_seconds", 0)
        while True:
            holder = self.sup.holder()
            if holder is None or not self._exclusive(holder):
                return
            if time.monotonic() >= deadline:
                raise ApiError(503, f"the device is held by run {holder.id} (training, step {holder.step}); "
                                    f"loading {rec.id}'s weights is refused ([serving].device_wait_seconds = "
                                    f"{rec.serving.get('device_wait_seconds', 0)}). Ask for {holder.id} for its "
                                    "live weights, or wait for it to end", code="device_busy", kind="server_error")
            await asyncio.sleep(0.25)

    def _exclusive(self, holder) -> bool:
        return self.exclusive_cpu or self.config(holder).model.device == "gpu"

    def config(self, rec) -> Config:
        """A run's configuration, read once (its config.toml never changes after submission)."""
        if rec.id not in self._configs:
            self._configs[rec.id] = self.sup.store.config(rec)
        return self._configs[rec.id]

    # ---- the application ---------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware(self.api_key, HARD_LIMIT, open_paths=("/health",),
                                                            unauthorized=self._login_page)],
                              client_max_size=HARD_LIMIT)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/", self.page)
        r.add_get("/static/{name}", self.static)
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/api/runs", self.list_runs)
        r.add_post("/api/runs", self.submit)
        r.add_get("/api/runs/{run}", self.show_run)
        r.add_get("/api/runs/{run}/metrics", self.metrics)
        r.add_get("/api/runs/{run}/log", self.log)
        r.add_get("/api/runs/{run}/events", self.events)
        r.add_post("/api/runs/{run}/stop", self.stop)
        r.add_post("/api/runs/{run}/resume", self.resume)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._startup)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _startup(self, _app) -> None:
        await self.sup.recover()
        self._janitor = asyncio.create_task(self._release_idle())

    async def _shutdown(self, _app) -> None:
        self._janitor.cancel()
        await self.sup.shutdown()
        self.pool.release()

    async def _release_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.pool.release(only_idle=True)

    def _login_page(self, request: web.Request) -> web.Response | None:
        if request.path != "/" or request.method != "GET":
            return None
        return web.Response(status=401, content_type="text/html", text=_asset("login.html"))

    # ---- routes ------------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "runs": len(self.sup.runs), "loaded_models": len(self.pool.loaded),
                                  "device_held_by": getattr(self.sup.holder(), "id", None), **self.pool.stats(),
                                  "live_waiting": sum(self.waiting.values())})

    async def page(self, _request: web.Request) -> web.Response:
        return web.Response(content_type="text/html", text=_asset("index.html"))

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        types = {".js": "text/javascript", ".css": "text/css"}
        kind = next((t for ext, t in types.items() if name.endswith(ext)), None)
        if kind is None or "/" in name or name.startswith("."):
            raise ApiError(404, f"no static file {name!r}", code="not_found")
        try:
            return web.Response(content_type=kind, text=_asset(name))
        except FileNotFoundError:
            raise ApiError(404, f"no static file {name!r}", code="not_found") from None

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.json_response(document())

    async def list_runs(self, _request: web.Request) -> web.Response:
        return web.json_response(finite({"runs": [r.public() for r in self.sup.runs.values()]}))

    async def show_run(self, request: web.Request) -> web.Response:
        rec = self.sup.get(request.match_info["run"])
        return web.json_response(finite({**rec.public(), "checkpoints": self.sup.store.steps(rec.id)}))

    async def submit(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if len(raw) > MAX_SUBMIT_BYTES:
            raise ApiError(413, f"a submission is at most {MAX_SUBMIT_BYTES} bytes", code="too_large")
        if request.content_type in ("application/toml", "text/plain"):
            body: dict = {"toml": raw.decode("utf-8", "replace")}
        else:
            body = (await read_json(request))[1]
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object: {\"config\": PATH} or {\"toml\": TEXT}")
        for key in ("config", "toml", "name", "base_dir"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise ApiError(400, f"{key}: expected a string", param=key)
        if bool(body.get("config")) == bool(body.get("toml")):
            raise ApiError(400, "give exactly one of config (a path on the server) and toml (the text)", param="config")
        try:
            if body.get("config"):
                path = Path(body["config"]).expanduser().resolve()
                try:
                    text = path.read_text()
                except OSError as exc:
                    raise ApiError(400, f"config: {path}: cannot read: {exc.strerror}", param="config") from None
                rec = await self.sup.submit(text, config_path=path, base_dir=path.parent, name=body.get("name"))
            else:
                base = Path(body.get("base_dir") or Path.cwd()).expanduser().resolve()
                rec = await self.sup.submit(body["toml"], config_path=None, base_dir=base, name=body.get("name"))
        except RetrogradError as exc:
            raise ApiError(400, str(exc), param="config", code="invalid_config") from None
        return web.json_response(finite(rec.public()), status=201)

    async def stop(self, request: web.Request) -> web.Response:
        return web.json_response(finite((await self.sup.stop(request.match_info["run"])).public()))

    async def resume(self, request: web.Request) -> web.Response:
        return web.json_response(finite((await self.sup.resume(request.match_info["run"])).public()))

    async def metrics(self, request: web.Request) -> web.Response:
        rec = self.sup.get(request.match_info["run"])
        return web.json_response(finite({"run": rec.id, "metrics": _read_metrics(self.sup.store.out(rec.id))}))

    async def log(self, request: web.Request) -> web.Response:
        rec = self.sup.get(request.match_info["run"])
        path = self.sup.store.log_path(rec.id)
        return web.Response(text=path.read_text(errors="replace") if path.exists() else "")

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: `state` (the record), `metrics` (one per step), `log` (new lines),
        then `end` once the run has stopped, finished or failed and everything was sent."""
        rec = self.sup.get(request.match_info["run"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            await follow(self.sup, rec.id, resp)
        return resp

    async def models(self, _request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": self.started, "owned_by": "retrograd"} for m in self.model_ids()]
        return web.json_response({"object": "list", "data": data})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw, body = await read_json(request)
        req = parse_chat_request(body)
        run_id, _ = split_ref(req.model)
        rec = self.sup.runs.get(run_id)
        if rec is not None and len(raw) > rec.serving.get("max_body_bytes", 4 << 20):
            raise ApiError(413, f"the request body exceeds run {run_id}'s [serving].max_body_bytes "
                                f"({rec.serving['max_body_bytes']} bytes)", code="too_large")
        return await self.complete(request, body)


def _asset(name: str) -> str:
    return resources.files("retrograd.serve").joinpath("web").joinpath(name).read_text()


def _read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows
