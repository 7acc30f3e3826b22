"""The process's memory: the C allocator's handling of large blocks, and the peak resident size.

glibc's malloc serves a block above its mmap threshold with its own mapping and unmaps it when
freed, but it raises that threshold to the size of each such block freed (up to 32 MiB), so after
a few steps the logits, log-prob and hidden-state arrays that RL allocates and frees every step
come from the heap instead, and freed heap memory stays resident: about 40 MiB of a GRPO step's
peak on the default model (docs/benchmarks.md). Fixing the threshold keeps it where it starts.
"""

from __future__ import annotations

import ctypes
import resource
import sys

_M_MMAP_THRESHOLD = -3          # mallopt's parameter numbers (malloc.h)
_THRESHOLD = 1 << 20            # blocks of 1 MiB and more get their own mapping, returned on free
_done = False


def return_large_blocks() -> bool:
    """Have malloc map (and on free, unmap) every block of 1 MiB or more, for the rest of the process.
    Once per process; False where the C library has no mallopt (not glibc)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    except (OSError, AttributeError):      # musl and other C libraries without mallopt
        return False
    _done = ok
    return ok


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB. On Linux /proc's VmHWM: ru_maxrss of a
    process started by a large parent (a test run) includes the parent's resident memory at fork."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 2**10
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10      # bytes on macOS, KiB on Linux
