"""One training run of retrograd-server, in a process of its own (a crash or an out-of-memory kill
takes this process down, never the server).

    python -m retrograd.serve.worker STATE/runs/RUN_ID

The server talks to it over two pipes. stdin carries one JSON object per line: {"type": "stop"}
(checkpoint at the next step and exit) or {"type": "chat", "id": N, "request": {...}} (answer with
the weights of the next step). stdout carries one JSON header line per message, followed, for the
ones that say "size", by that many raw bytes:
  {"type": "step", "record": {...}, "total": T}   after every optimizer step
  {"type": "chat", "id": N, "step": S, "answer": [message, finish, usage]} or {..., "error": {...}}
  {"type": "finished" | "stopped" | "failed", ...}  the end of the run
Whatever the training code prints goes to stderr, which the server points at the run's log.txt.
When stdin closes (the server is gone, even by SIGKILL) the process exits at once: the
checkpoints on disk are atomic, so the run resumes from the latest one.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from retrograd.errors import RetrogradError

if TYPE_CHECKING:
    from retrograd.data.chat import ChatFormat
    from retrograd.generation.llama import Generator


class Channel:
    """The framed messages to the server (a lock: the reader thread and the trainer both write)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, msg: dict, payload: bytes | None = None) -> None:
        if payload is not None:
            msg = {**msg, "size": len(payload)}
        line = json.dumps(msg, default=float).encode() + b"\n"
        with self.lock:
            self.stream.write(line)
            if payload is not None:
                self.stream.write(payload)
            self.stream.flush()


class LiveChat:
    """Answers chat requests with the adapter as it is at the moment of the step callback, with a
    generator of the run's own model loaded on first use (the run already holds the device)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.gen: Generator | None = None
        self.chat: ChatFormat | None = None
        self.seed = 0
        self.last_used = 0.0

    def answer(self, trainable, body: dict) -> tuple:
        from retrograd.data.chat import format_for
        from retrograd.generation.llama import Generator
        from retrograd.run_setup import resolve_model, resolve_threads
        from retrograd.serve.app import answer
        from retrograd.serve.openai_api import parse_chat_request

        req = parse_chat_request(body)
        if self.gen is None:
            self.gen = Generator(resolve_model(self.cfg), n_ctx=self.cfg.model.ctx, threads=resolve_threads(self.cfg),
                                 device=self.cfg.model.device)
            self.chat = format_for(self.gen.tokenizer, self.cfg.model.chat_template)
        assert self.chat is not None, "set with the generator"
        self.gen.set_adapter(trainable.adapter_bytes())
        self.seed += 1
        self.last_used = time.monotonic()
        return answer(self.gen, self.chat, req, self.seed)

    def release_if_idle(self, idle_seconds: float) -> None:
        if self.gen is not None and time.monotonic() - self.last_used > idle_seconds:
            self.gen.close()
            self.gen = None

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()
            self.gen = None


def read_commands(stop: threading.Event, chats: queue.Queue) -> None:
    for line in sys.stdin.buffer:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("type") == "stop":
            stop.set()
        elif msg.get("type") == "chat":
            chats.put(msg)
    os._exit(4)         # the server is gone: stop now (the checkpoints on disk are whole)


def main(argv: list[str]) -> int:
    run_dir = Path(argv[1])
    chan = Channel(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)                       # stray prints go to the log, never into the message stream
    from retrograd import logs

    logs.setup()
    from retrograd.serve.openai_api import error_body
    from retrograd.serve.runs import RunRecord, RunStore
    from retrograd.trainer import RunStopped, StepRecord, train

    store = RunStore(run_dir.parent.parent)
    rec = RunRecord(**json.loads((run_dir / "run.json").read_text()))
    stop = threading.Event()
    chats: queue.Queue[dict] = queue.Queue()
    threading.Thread(target=read_commands, args=(stop, chats), daemon=True).start()
    live = None
    try:
        from retrograd.context import open_model

        cfg = store.config(rec)
        live = LiveChat(cfg)
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] run {rec.id}: {rec.algorithm}"
              + (", resuming from the latest checkpoint" if rec.resume else ""), file=sys.stderr, flush=True)
        ctx = open_model(cfg)

        def on_step(done: StepRecord) -> bool:
            chan.send({"type": "step", "record": done.metrics, "total": done.total})
            while not chats.empty():
                msg = chats.get()
                try:
                    ans = live.answer(done.trainable, msg["request"])
                    chan.send({"type": "chat", "id": msg["id"], "step": done.step, "answer": list(ans)})
                except Exception as exc:          # one bad request never stops the run
                    chan.send({"type": "chat", "id": msg["id"], "step": done.step, "error": error_body(exc)})
            live.release_if_idle(cfg.serving.idle_seconds)
            return stop.is_set()

        summary = train(ctx, resume=rec.resume, on_step=on_step)
        chan.send({"type": "finished", "summary": summary})
        return 0
    except RunStopped as exc:
        chan.send({"type": "stopped", "step": exc.step})
        return 0
    except RetrogradError as exc:
        chan.send({"type": "failed", "error": str(exc)})
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        traceback.print_exc()
        chan.send({"type": "failed", "error": f"internal error: {type(exc).__name__}: {exc} (traceback in log.txt)"})
        return 1
    finally:
        if live is not None:
            live.close()


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    os._exit(code)      # not the interpreter's shutdown: the stdin reader thread is blocked in a read
