"""No orphan tool servers: a process holding a ToolBox that is interrupted (SIGINT: KeyboardInterrupt, then
atexit) or terminated (SIGTERM: the ToolBox's chained handler) takes its stdio servers with it. The fake server
lingers after its stdin closes, so only the ToolBox's shutdown (which kills what does not exit) stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .agent_support import EXAMPLE, FAKE, ROOT, default_sigint

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir() or sys.platform == "win32", reason="needs Linux /proc")

HOLDER = textwrap.dedent(f"""
    import os, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    from retrograd.agent.tools import ToolBox

    box = ToolBox([{{"name": "notes", "command": ["{{python}}", "notes_server.py"], "cwd": {str(EXAMPLE)!r}}},
                   {{"name": "fake", "command": ["{{python}}", {str(FAKE)!r}, "linger"]}}])
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{{entry}}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                kids.append(entry)
    print(" ".join(kids), flush=True)
    time.sleep(60)
""")


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


def _alive(pid: int, started: str) -> bool:
    st = _stat(pid)
    # a zombie is dead (its parent, gone, cannot reap it); another start time is another process (pid reuse)
    return st is not None and st[0] not in ("Z", "X") and st[1] == started


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_servers_stop_when_the_holder_is_signalled(sig):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], preexec_fn=default_sigint, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    kids: dict[int, str] = {}
    try:
        line = proc.stdout.readline()
        kids = {int(p): (_stat(int(p)) or ("?", "?"))[1] for p in line.split()}
        if len(kids) != 2:
            proc.kill()
            pytest.fail(f"the holder did not report two servers: {line!r}; stderr: {proc.stderr.read()[-3000:]}")
        assert all(_alive(p, t) for p, t in kids.items())
        os.kill(proc.pid, sig)
        rc = proc.wait(60)
        err = proc.stderr.read()[-3000:]
        assert rc == -sig if sig == signal.SIGTERM else rc != 0, (rc, err)
        deadline = time.monotonic() + 20
        while any(_alive(p, t) for p, t in kids.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p, t in kids.items() if _alive(p, t)]
        assert not left, f"orphan tool servers after {sig.name}: {left} of {list(kids)}; holder stderr: {err}"
    finally:
        for p, t in kids.items():  # leave nothing behind when the test fails
            if _alive(p, t):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
