"""The generators retrograd-server loads itself to answer for saved weights (RUN@final, @best,
@step-N, @latest, @base): one llama.cpp generator per (model, context, device, chat template),
the adapter swapped in memory between requests, released after the run's idle_seconds or as soon
as a training run takes the device."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from retrograd.config import Config
from retrograd.serve.openai_api import ChatRequest


@dataclass
class Loaded:
    gen: object
    chat: object
    idle_seconds: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    adapter: Path | None = None       # the adapter the generator holds now
    doomed: bool = False              # close once the request in flight is answered
    seed: int = 0


class ModelPool:
    def __init__(self) -> None:
        self.loaded: dict[tuple, Loaded] = {}
        self._lock = threading.Lock()

    def answer(self, cfg: Config, adapter: Path | None, req: ChatRequest) -> tuple[dict, str, dict]:
        """Blocking (run it in an executor): the completion with `adapter` (None: the base model)."""
        from retrograd.serve.app import answer

        while True:
            host = self._host(cfg)
            with host.lock:
                if host.gen is None:        # released while this request waited: load again
                    continue
                try:
                    if host.adapter != adapter:
                        host.gen.set_adapter(adapter.read_bytes() if adapter else None)
                        host.adapter = adapter
                    host.seed += 1
                    return answer(host.gen, host.chat, req, host.seed)
                finally:
                    host.last_used = time.monotonic()
                    if host.doomed:
                        self._close(host)

    def _host(self, cfg: Config) -> Loaded:
        from retrograd.data.chat import format_for
        from retrograd.generation.llama import Generator
        from retrograd.run_setup import resolve_model, resolve_threads

        model = resolve_model(cfg)
        key = (str(model), cfg.model.ctx, cfg.model.device, cfg.model.chat_template)
        with self._lock:
            host = self.loaded.get(key)
            if host is None or host.doomed:
                gen = Generator(model, n_ctx=cfg.model.ctx, threads=resolve_threads(cfg), device=cfg.model.device)
                host = Loaded(gen, format_for(gen.tokenizer, cfg.model.chat_template), cfg.serving.idle_seconds)
                self.loaded[key] = host
            host.idle_seconds = cfg.serving.idle_seconds
            return host

    def release(self, only_idle: bool = False) -> int:
        """Close the generators (only those idle past their run's idle_seconds when `only_idle`);
        one answering a request closes right after. Never blocks. Returns how many were let go."""
        now, n = time.monotonic(), 0
        with self._lock:
            for key, host in list(self.loaded.items()):
                if only_idle and now - host.last_used < host.idle_seconds:
                    continue
                del self.loaded[key]
                n += 1
                if host.lock.acquire(blocking=False):
                    try:
                        self._close(host)
                    finally:
                        host.lock.release()
                else:
                    host.doomed = True
        return n

    @staticmethod
    def _close(host: Loaded) -> None:
        if host.gen is not None:
            host.gen.close()
            host.gen = None
