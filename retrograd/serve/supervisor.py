"""retrograd-server's runs in motion: each run trains in a worker process (retrograd.serve.worker);
at most one holds the device at a time and the others wait in submission order. The supervisor
reads the workers' messages (steps, live chat answers, the end of the run), keeps every run's
record on disk up to date, and hands live chat requests to the training process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from retrograd.logs import log
from retrograd.serve.openai_api import ApiError
from retrograd.serve.runs import ACTIVE, RESUMABLE, RunRecord, RunStore

INTERRUPTED = "the server stopped while this run trained; resume continues from the latest checkpoint"


class Supervisor:
    def __init__(self, state_dir: Path, *, on_device_change: Callable[[str | None], object] | None = None) -> None:
        self.store = RunStore(state_dir)
        self.runs: dict[str, RunRecord] = {}
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self.pending_run: dict[int, str] = {}
        self.next_chat = 0
        self.changed = asyncio.Condition()     # notified on every record change (event streams wait on it)
        self.on_device_change = on_device_change
        self._kicking = asyncio.Lock()

    # ---- start-up ----------------------------------------------------------------------------
    async def recover(self) -> None:
        """Load every run from disk. One the records call active was cut off when the server
        stopped (its worker exits when the server's pipe closes): it is marked crashed, resumable."""
        for rec in self.store.load_all():
            if rec.state in ACTIVE:
                _reap(rec.pid)
                rec.state, rec.ended, rec.pid = "crashed", rec.ended or time.time(), None
                rec.error = rec.error or INTERRUPTED
                self.store.save(rec)
            self.runs[rec.id] = rec
        await self.kick()

    # ---- queries -----------------------------------------------------------------------------
    def get(self, run_id: str) -> RunRecord:
        rec = self.runs.get(run_id)
        if rec is None:
            known = ", ".join(self.runs) or "none yet"
            raise ApiError(404, f"no run {run_id!r} (runs: {known})", param="run", code="run_not_found")
        return rec

    def holder(self) -> RunRecord | None:
        """The run that holds the device, if any."""
        return next((r for r in self.runs.values() if r.state in ACTIVE), None)

    # ---- commands ----------------------------------------------------------------------------
    async def submit(self, toml_text: str, *, config_path: Path | None, base_dir: Path, name: str | None) -> RunRecord:
        seq = max((r.seq for r in self.runs.values()), default=0) + 1
        rec = self.store.create(toml_text, config_path=config_path, base_dir=base_dir, name=name, seq=seq)
        self.runs[rec.id] = rec
        await self.notify()
        await self.kick()
        return rec

    async def stop(self, run_id: str) -> RunRecord:
        rec = self.get(run_id)
        if rec.state == "queued":
            rec.state, rec.ended = "stopped", time.time()
            self._save(rec)
        elif rec.state == "running":
            rec.state = "stopping"          # the worker checkpoints at its next step and exits
            self._save(rec)
            with contextlib.suppress(LookupError, ConnectionError):     # already ending: nothing to stop
                await self._send(run_id, {"type": "stop"})
        elif rec.state != "stopping":
            raise ApiError(409, f"run {run_id} is {rec.state}; only a queued or running run can be stopped",
                           code="invalid_state")
        await self.notify()
        return rec

    async def resume(self, run_id: str) -> RunRecord:
        rec = self.get(run_id)
        if rec.state not in RESUMABLE:
            raise ApiError(409, f"run {run_id} is {rec.state}; only a {', '.join(RESUMABLE)} run can be resumed",
                           code="invalid_state")
        rec.state, rec.error, rec.ended = "queued", None, None
        rec.resume = bool(self.store.steps(run_id)) or rec.resume
        rec.seq = max(r.seq for r in self.runs.values()) + 1       # back of the queue
        self._save(rec)
        await self.notify()
        await self.kick()
        return rec

    async def live_chat(self, run_id: str, body: dict) -> tuple[tuple, int]:
        """Send a chat request to the training process; it answers at its next step with that
        step's weights. Returns (answer, step). Raises LookupError when the run ends first."""
        self.next_chat += 1
        cid = self.next_chat
        fut = asyncio.get_running_loop().create_future()
        self.pending[cid], self.pending_run[cid] = fut, run_id
        try:
            await self._send(run_id, {"type": "chat", "id": cid, "request": body})
            return await fut
        finally:
            self.pending.pop(cid, None)
            self.pending_run.pop(cid, None)

    async def shutdown(self) -> None:
        """Server exit: close the workers' pipes (they stop at once; the run resumes later)."""
        for run_id, proc in list(self.procs.items()):
            with contextlib.suppress(Exception):
                if proc.stdin is not None:
                    proc.stdin.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 10)
            rec = self.runs[run_id]
            if rec.state in ACTIVE:
                rec.state, rec.ended, rec.pid = "crashed", time.time(), None
                rec.error = INTERRUPTED
                self._save(rec)

    # ---- the queue -------------------------------------------------------------------------
    async def kick(self) -> None:
        """Start the next queued run when the device is free."""
        async with self._kicking:
            if self.holder() is not None:
                return
            queued = sorted((r for r in self.runs.values() if r.state == "queued"), key=lambda r: r.seq)
            if not queued:
                return
            rec = queued[0]
            if self.on_device_change:
                self.on_device_change(rec.id)       # served models let go of the device first
            logfile = open(self.store.log_path(rec.id), "ab")
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "retrograd.serve.worker", str(self.store.dir(rec.id)),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=logfile,
                    start_new_session=True, limit=1 << 20)
            finally:
                logfile.close()
            rec.state, rec.pid, rec.started, rec.error = "running", proc.pid, time.time(), None
            self.procs[rec.id] = proc
            self._save(rec)
            log.info("run %s started (pid %d%s)", rec.id, proc.pid, ", resuming" if rec.resume else "")
            asyncio.create_task(self._pump(rec.id, proc))
        await self.notify()

    async def _pump(self, run_id: str, proc: asyncio.subprocess.Process) -> None:
        rec = self.runs[run_id]
        ended = None
        out = proc.stdout
        assert out is not None, "the worker is started with stdout=PIPE"
        try:
            while True:
                line = await out.readline()
                if not line:
                    break
                msg = json.loads(line)
                if "size" in msg:
                    msg["payload"] = await out.readexactly(msg["size"])
                ended = self._handle(rec, msg) or ended
                await self.notify()
        except (json.JSONDecodeError, asyncio.IncompleteReadError, ValueError) as exc:
            ended = ended or ("crashed", f"the worker's messages broke off: {exc}")
        code = await proc.wait()
        self.procs.pop(run_id, None)
        if ended is None:
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            hint = " (killed: out of memory?)" if code == -signal.SIGKILL else ""
            ended = ("crashed", f"the training process ended with {how}{hint}; see log.txt")
        rec.state, rec.error = ended
        rec.ended, rec.pid = time.time(), None
        log.info("run %s %s%s", run_id, rec.state, f": {rec.error}" if rec.error else "")
        if rec.state == "finished":
            rec.resume = False
        self._save(rec)
        for cid, owner in list(self.pending_run.items()):
            fut = self.pending.get(cid)
            if owner == run_id and fut is not None and not fut.done():
                fut.set_exception(LookupError(run_id))
        await self.notify()
        await self.kick()

    def _handle(self, rec: RunRecord, msg: dict) -> tuple[str, str | None] | None:
        kind = msg.get("type")
        if kind == "step":
            rec.step, rec.total = int(msg["record"]["step"]), msg.get("total") or rec.total
            rec.last = {k: v for k, v in msg["record"].items() if isinstance(v, (int, float))}
            self._save(rec)
        elif kind == "chat":
            fut = self.pending.get(msg["id"])
            if fut is not None and not fut.done():
                if "error" in msg:
                    err = msg["error"]
                    body = err["body"]["error"]
                    fut.set_exception(ApiError(err["status"], body["message"], param=body.get("param"),
                                               code=body.get("code"), kind=body.get("type", "invalid_request_error")))
                else:
                    fut.set_result((tuple(msg["answer"]), int(msg["step"])))
        elif kind == "finished":
            return ("finished", None)
        elif kind == "stopped":
            rec.resume = True
            return ("stopped", None)
        elif kind == "failed":
            return ("failed", msg.get("error") or "failed")
        return None

    async def _send(self, run_id: str, msg: dict) -> None:
        proc = self.procs.get(run_id)
        if proc is None or proc.stdin is None:
            raise LookupError(run_id)
        proc.stdin.write(json.dumps(msg).encode() + b"\n")
        await proc.stdin.drain()

    def _save(self, rec: RunRecord) -> None:
        self.store.save(rec)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


def _reap(pid: int | None) -> None:
    """A worker left from before a restart (normally gone already: its pipe closed): stop it."""
    if not pid:
        return
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"retrograd.serve.worker" in cmd:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
