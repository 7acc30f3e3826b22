"""Helpers of the agent tests: where the notes example and the fake server are, an HTTP notes server process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agent-notes"
SERVERS = Path(__file__).resolve().parent / "servers"
FAKE = SERVERS / "fake_server.py"


def fake_table(name: str = "fake", *args: str, **extra) -> dict:
    return {"name": name, "command": ["{python}", str(FAKE), *args], **extra}


def notes_table(name: str = "notes") -> dict:
    return {"name": name, "command": ["{python}", "notes_server.py"], "cwd": str(EXAMPLE)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the HTTP server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {seconds} s")


def start_http_notes() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLE / "notes_server.py"), "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_port(port, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"http://127.0.0.1:{port}/mcp"


def stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr:
        proc.stderr.close()


def default_sigint() -> None:
    """preexec_fn for children the tests interrupt: a job a non-interactive shell starts in the background
    inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
