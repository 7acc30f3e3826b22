"""The generators retrograd-server loads itself to answer for saved weights (RUN@final, @best,
@step-N, @latest, @base): one llama.cpp generator per (model, context, device, chat template and
the run's [serving] parallel, queue and wait_seconds), each driven by a scheduler
(serve/scheduler.py) that decodes its requests together, grouped by adapter file with fair turns
between the groups. A generator is released after the run's idle_seconds
without requests, or as soon as a training run takes the device (after finishing what it admitted).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from retrograd.config import Config
from retrograd.serve.openai_api import ChatRequest
from retrograd.serve.scheduler import Scheduler

if TYPE_CHECKING:
    from retrograd.data.chat import ChatFormat


@dataclass
class Loaded:
    sched: Scheduler
    chat: ChatFormat
    idle_seconds: float
    seed: int = 0

    def idle_for(self, now: float) -> float:
        return now - self.sched.last_used if self.sched.idle else 0.0


def _adapter_bytes(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None else None


class ModelPool:
    def __init__(self) -> None:
        self.loaded: dict[tuple, Loaded] = {}
        self._lock = threading.Lock()

    def stats(self) -> dict:
        """Requests decoding and waiting over every loaded generator (/health)."""
        s = [h.sched.stats() for h in list(self.loaded.values())]
        return {"decoding": sum(x["decoding"] for x in s), "waiting": sum(x["waiting"] for x in s)}

    async def serve(self, request: web.Request, cfg: Config, adapter: Path | None, req: ChatRequest,
                    headers: dict) -> web.StreamResponse:
        """Answer `req` with `adapter` (None: the base model), loading the generator first if needed
        (in an executor: loading blocks). RetrogradError when it cannot be loaded."""
        from retrograd.serve.app import serve_chat

        while True:
            host = await asyncio.get_running_loop().run_in_executor(None, self._host, cfg)
            if not host.sched.closing:      # not let go while this request waited for it: no await below
                break
        host.seed += 1
        return await serve_chat(request, host.sched, host.chat, req, adapter, host.seed, headers)

    def _host(self, cfg: Config) -> Loaded:
        from retrograd.data.chat import format_for
        from retrograd.generation.batching import auto_parallel, serving_generator
        from retrograd.run_setup import resolve_model, resolve_threads

        model = resolve_model(cfg)
        s = cfg.serving
        key = (str(model), cfg.model.ctx, cfg.model.device, cfg.model.chat_template, s.parallel, s.queue,
               s.wait_seconds, s.generator_weights, cfg.lora.variant)
        with self._lock:
            host = self.loaded.get(key)
            if host is None or host.sched.closing:      # closing here: its thread failed
                parallel = s.parallel or auto_parallel(cfg.model.ctx)
                gen = serving_generator(model, n_ctx=cfg.model.ctx, parallel=parallel, threads=resolve_threads(cfg),
                                        device=cfg.model.device, weights=s.generator_weights,
                                        dora=cfg.lora.variant == "dora")
                sched = Scheduler(gen, parallel=parallel, queue=s.queue, wait_seconds=s.wait_seconds,
                                  adapter_of=_adapter_bytes, name=f"pool-{model.name}")
                host = Loaded(sched, format_for(gen.tokenizer, cfg.model.chat_template), s.idle_seconds)
                self.loaded[key] = host
            host.idle_seconds = cfg.serving.idle_seconds
            return host

    def release(self, only_idle: bool = False) -> int:
        """Let the generators go (only those idle past their run's idle_seconds when `only_idle`): a
        scheduler finishes the requests it admitted, then frees its generator. Never blocks. Returns
        how many were let go."""
        now, n = time.monotonic(), 0
        with self._lock:
            for key, host in list(self.loaded.items()):
                if only_idle and host.idle_for(now) < host.idle_seconds:
                    continue
                del self.loaded[key]
                host.sched.close()
                n += 1
        return n
