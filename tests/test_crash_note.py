"""The note a fatal signal leaves (native/crash.c, issue 38): a process that dies of SIGSEGV or
SIGABRT after setting one writes it to stderr and still dies of that signal, with Python's
faulthandler (installed first) still reporting; a cleared note says nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

CHILD = """
import os, signal, sys
from retrograd import native
native.set_crash_note(sys.argv[1] or None)
native.set_crash_note("an older note, replaced")
native.set_crash_note(sys.argv[1] or None)
sys.stderr.flush()
os.kill(os.getpid(), int(sys.argv[2]))
"""


def die(note: str, sig: int, faulthandler: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1" if faulthandler else ""}
    return subprocess.run([sys.executable, "-c", CHILD, note, str(sig)], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_fatal_signal_writes_the_note_and_still_kills(sig, faulthandler):
    out = die("the run can go on: resume it", sig, faulthandler)
    assert out.returncode == -sig, (out.returncode, out.stderr)
    assert "the run can go on: resume it\n" in out.stderr, out.stderr
    assert "an older note" not in out.stderr
    # the handler that was there first still runs: faulthandler's traceback follows the note
    assert ("Fatal Python error" in out.stderr) == faulthandler, out.stderr
    if faulthandler:
        assert out.stderr.index("the run can go on") < out.stderr.index("Fatal Python error")


def test_a_cleared_note_says_nothing():
    out = die("", signal.SIGSEGV, False)
    assert out.returncode == -signal.SIGSEGV
    assert "older note" not in out.stderr and out.stderr.strip() == "", out.stderr
