"""Following a run as server-sent events: its record when it changes, each new metrics line, each
new log line, and `end` once the run is no longer queued or training and all of it was sent. The
files are the source (metrics.jsonl, log.txt), so a client sees the same thing after a restart."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

from aiohttp import web

from retrograd.serve.runs import ACTIVE


def finite(obj):
    """JSON for browsers: NaN and infinities become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


class Tail:
    """New complete lines of a file that grows (and may be rewritten shorter on resume)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""

    def lines(self) -> tuple[list[str], bool]:
        """(new lines, whether the file was rewritten from the start)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return [], False
        reset = size < self.offset
        if reset:
            self.offset, self.rest = 0, b""
        if size == self.offset:
            return [], reset
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset = size
        *done, self.rest = (self.rest + data).split(b"\n")
        return [d.decode("utf-8", "replace") for d in done], reset


def event(kind: str, data) -> bytes:
    text = data if isinstance(data, str) else json.dumps(finite(data))
    return f"event: {kind}\n".encode() + b"".join(f"data: {line}\n".encode() for line in text.split("\n")) + b"\n"


async def follow(sup, run_id: str, resp: web.StreamResponse) -> None:
    metrics = Tail(sup.store.out(run_id) / "metrics.jsonl")
    log = Tail(sup.store.log_path(run_id))
    last_state = None
    while True:
        rec = sup.runs[run_id]
        sent = False
        public = rec.public()
        if public != last_state:
            await resp.write(event("state", public))
            last_state, sent = public, True
        new, reset = metrics.lines()
        if reset:
            await resp.write(event("reset", {"run": run_id}))
        for line in new:
            try:
                await resp.write(event("metrics", json.loads(line)))
                sent = True
            except json.JSONDecodeError:
                continue
        for line in log.lines()[0]:
            await resp.write(event("log", line.rstrip("\r").split("\r")[-1]))   # a progress bar's last redraw
            sent = True
        if not sent and rec.state not in ACTIVE and rec.state != "queued":
            await resp.write(event("end", {"state": rec.state}))
            await resp.write_eof()
            return
        async with sup.changed:
            try:
                await asyncio.wait_for(sup.changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
