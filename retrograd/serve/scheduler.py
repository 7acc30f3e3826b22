"""The serving scheduler: one thread owns a Generator and runs the continuous batch
(generation/batching.py); aiohttp handlers hand it jobs and await futures (and, when they stream,
a queue of text pieces) on their event loop.

Admission: `parallel` sequences decode together; beyond them at most `queue` requests wait (more
get 429), and a request that waits longer than `wait_seconds` for a slot gets 503. llama.cpp applies
adapters to a whole context, so requests for different adapters cannot share a batch: jobs are
grouped by adapter key and take turns (take_turn): once the batch has drained, the adapter of the
oldest waiting job is swapped in and all its waiting jobs start together; while it decodes, newer
jobs of that adapter join only until the oldest waiting job is another adapter's. A cancelled job
(its client went away) leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from retrograd.generation.batching import Batch
from retrograd.generation.llama import Generator
from retrograd.generation.sampling import Completion, SamplingParams
from retrograd.logs import log
from retrograd.serve.openai_api import ApiError

_IDLE = object()       # the adapter key before any was applied


@dataclass
class Job:
    key: Hashable
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    pieces: asyncio.Queue | None = None      # streamed text, when the client streams
    holdback: int = 0                        # characters a stop string could still claim
    sent: int = 0
    since: float = field(default_factory=time.monotonic)
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def settle(self, value: Completion | BaseException) -> None:
        def put() -> None:
            if self.done.done():
                return
            if isinstance(value, BaseException):
                self.done.set_exception(value)
            else:
                self.done.set_result(value)
        self._call(put)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:            # the event loop has closed: the server is shutting down
            self.cancelled = True

    def stream(self, text: str, final: bool) -> None:
        """Send what is safe to show of `text`: not the last characters a stop string could still
        cut, nor a character whose bytes have not all arrived."""
        if self.pieces is None:
            return
        end = len(text) if final else len(text) - self.holdback
        while not final and end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        if end > self.sent:
            piece, self.sent = text[self.sent:end], end
            self._call(self.pieces.put_nowait, piece)


def take_turn(waiting: deque[Job], key: Hashable, room: int, fresh: bool) -> list[Job]:
    """Remove and return the waiting jobs of adapter `key` that start now, at most `room`.

    A fresh turn (the batch is empty, `key` was just swapped in) takes every waiting job of `key`, in
    arrival order, wherever it stands in the queue: requests for interleaved adapters would otherwise
    decode one at a time. Within a turn, later jobs of `key` join only while the oldest waiting job is
    also of `key`, so one busy adapter cannot keep the others waiting for more than its current batch.
    """
    if fresh:
        taken = [j for j in waiting if j.key == key][:max(0, room)]
        for job in taken:
            waiting.remove(job)
        return taken
    taken = []
    while waiting and waiting[0].key == key and len(taken) < room:
        taken.append(waiting.popleft())
    return taken


class Scheduler:
    def __init__(self, gen: Generator, *, parallel: int, queue: int, wait_seconds: float,
                 adapter_of: Callable[[Any], bytes | None], name: str = "serve") -> None:
        # adapter_of: the adapter bytes (None: the base model) of a key jobs are submitted with; the keys
        # are the caller's own (a model id, an adapter path), opaque here: Any, so that its function can take them
        self.gen = gen
        self.parallel, self.queue, self.wait_seconds = parallel, queue, wait_seconds
        self.adapter_of = adapter_of
        self.batch = Batch(gen, parallel)
        self.key: Hashable = _IDLE
        self.waiting: deque[Job] = deque()
        self.jobs: dict[int, Job] = {}           # slot -> job decoding there
        self.starting: list[Job] = []            # admitted, their prompt being decoded (no slot yet)
        self.last_used = time.monotonic()
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"retrograd-{name}", daemon=True)
        self._thread.start()

    # ---- the handlers' side (event loop) -------------------------------------------------------
    def stats(self) -> dict:
        return {"decoding": len(self.jobs) + len(self.starting), "waiting": len(self.waiting),
                "parallel": self.parallel, "queue": self.queue}

    @property
    def idle(self) -> bool:
        """Nothing admitted, waiting or decoding (a prompt being decoded counts: it can take a while)."""
        return not self.jobs and not self.waiting and not self.starting

    @property
    def closing(self) -> bool:
        """close() was called (or the thread failed): submit() answers 503 from now on."""
        return self._closing

    def submit(self, key: Hashable, prompt: list[int], params: SamplingParams, stream: bool = False) -> Job:
        """Admit a job (ApiError 429 when `queue` requests already wait beyond the free slots)."""
        loop = asyncio.get_running_loop()
        job = Job(key, prompt, params, loop, loop.create_future(), asyncio.Queue() if stream else None,
                  max((len(s) for s in params.stop), default=1) - 1)
        with self._cv:
            if self._closing:
                raise ApiError(503, "the model is being released; retry", code="model_unavailable", kind="server_error")
            free = max(0, self.parallel - len(self.jobs) - len(self.starting))
            if len(self.waiting) >= self.queue + free:
                raise ApiError(429, f"the server is busy: {len(self.jobs)} requests decoding ([serving].parallel = "
                                    f"{self.parallel}) and {len(self.waiting)} waiting ([serving].queue = {self.queue});"
                                    " retry later", code="queue_full")
            self.waiting.append(job)
            self._cv.notify()
        return job

    def close(self) -> None:
        """Finish what was admitted, then free the generator (returns at once)."""
        with self._cv:
            self._closing = True
            self._cv.notify()

    # ---- the scheduler thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self.jobs and not self.waiting and not self._closing:
                        self._cv.wait()
                    if self._closing and not self.jobs and not self.waiting:
                        break
                    self._expire()
                    switch = self.waiting[0].key if self.waiting and not self.jobs else self.key
                if switch != self.key:
                    self._switch(switch)       # outside the lock: a DoRA adapter reloads weights
                with self._cv:
                    admitted = take_turn(self.waiting, self.key, self.parallel - len(self.jobs), not self.jobs)
                    self.starting = list(admitted)
                for job in admitted:
                    self._start(job)
                self._step()
        except BaseException as exc:       # never leave a handler waiting on a dead thread
            log.exception("serving scheduler failed")
            self._fail_all(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", code="internal_error",
                                    kind="server_error"))
        finally:
            self.gen.close()

    def _expire(self) -> None:
        """Drop cancelled waiting jobs; answer those waiting past wait_seconds with 503 (under the lock)."""
        now = time.monotonic()
        for job in [j for j in self.waiting if j.cancelled or now - j.since > self.wait_seconds]:
            self.waiting.remove(job)
            if not job.cancelled:
                job.settle(ApiError(503, f"waited {now - job.since:.0f} s for a decoding slot ([serving].wait_seconds"
                                         f" = {self.wait_seconds:g}; {len(self.jobs)} decoding, {len(self.waiting)} "
                                         "waiting); retry later", code="wait_timeout", kind="server_error"))

    def _switch(self, key: Hashable) -> None:
        """Swap in the adapter of `key` (the batch is empty); if it cannot be applied, its jobs fail."""
        try:
            self.gen.set_adapter(self.adapter_of(key))
            self.key = key
        except Exception as exc:
            self.key = _IDLE
            err = ApiError(503, f"model: cannot apply the adapter: {exc}", code="model_unavailable",
                           kind="server_error")
            with self._cv:
                failed = [j for j in self.waiting if j.key == key]
                for job in failed:
                    self.waiting.remove(job)
            for job in failed:
                job.settle(err)
        finally:
            self.batch.reset()

    def _start(self, job: Job) -> None:
        try:
            slot = self.batch.start(job.prompt, job.params)
        except ValueError as exc:
            with self._cv:
                self.starting.remove(job)
                self.last_used = time.monotonic()
            job.settle(ApiError(400, str(exc), param="messages", code="context_length_exceeded"))
            return
        with self._cv:
            self.starting.remove(job)
            self.jobs[slot] = job

    def _step(self) -> None:
        for slot, job in list(self.jobs.items()):
            if job.cancelled:
                self.batch.leave(slot)
                self._leave(slot)
        if not self.jobs:
            return
        ended = self.batch.sample()
        tok = self.gen.tokenizer
        for slot, job in list(self.jobs.items()):
            out = self.batch.live[slot].out
            if job.pieces is not None and (slot in ended or out.tokens):
                job.stream(out.text if slot in ended or job.params.stop else tok.decode(out.tokens), slot in ended)
            if slot in ended:
                self.batch.leave(slot)
                self._leave(slot)
                job.settle(out)
        self.batch.decode()

    def _leave(self, slot: int) -> None:
        with self._cv:
            self.jobs.pop(slot, None)
            self.last_used = time.monotonic()

    def _fail_all(self, err: ApiError) -> None:
        with self._cv:
            jobs = [*self.jobs.values(), *self.starting, *self.waiting]
            self.jobs.clear()
            self.starting.clear()
            self.waiting.clear()
            self._closing = True
        for job in jobs:
            job.settle(err)
