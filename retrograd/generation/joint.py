"""The split copy's offsets and the training adapter, handed to llama.cpp as one adapter.

A split copy (split.py) needs its offsets applied as an adapter under the training one. As two
adapters, llama.cpp adds four graph nodes per weight for each (two products, a scale, an add):
on SmolLM2 that is 1,680 small nodes a decode step, each a barrier for the threads. As one, of
rank r + n_in/32 (padded to a multiple of 16, the inner size llamafile's GEMM takes), its A stacks
the training A over the block sums and its B puts the training B, scaled by alpha / r, beside the
offsets: the same product, and a GRPO step's rollouts decoded about 14% faster (docs/benchmarks.md).

The joint adapter is rebuilt at every swap, from the training adapter's bytes (read in place,
adapter.parse) and the offsets (kept once, F32, without the sidecar's padding). So that no
second whole copy of it sits in memory beside llama.cpp's, it is written into llama.cpp's loader
piece by piece through a FILE* whose reads are served here (glibc's fopencookie): a tensor at a
time. A is F16 (the block sums' ones are exact in it; the training A rounds to 11 bits, far below
the training noise), B F32.
"""

from __future__ import annotations

import bisect
import ctypes
from functools import partial
from pathlib import Path

import numpy as np

from retrograd import adapter as adapter_io
from retrograd.errors import GenerationError
from retrograd.generation.split import BLOCK, RANK_STEP, offsets_path

_READ = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char), ctypes.c_size_t)
_SEEK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int)
_CLOSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class _IoFunctions(ctypes.Structure):
    _fields_ = [("read", _READ), ("write", ctypes.c_void_p), ("seek", _SEEK), ("close", _CLOSE)]


_libc = ctypes.CDLL(None)
_libc.fopencookie.restype = ctypes.c_void_p
_libc.fopencookie.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _IoFunctions]
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]


def _joint_a(a_t: np.ndarray | None, blocks: int, rank: int, n_in: int) -> bytes:
    """A's bytes: the training A's rows, then one row per block of 32 inputs summing it, then zeros."""
    a = np.zeros((rank, n_in), np.float16)
    r = 0 if a_t is None else a_t.shape[0]
    if a_t is not None:
        a[:r] = a_t
    if blocks:
        a[r + np.arange(n_in) // BLOCK, np.arange(n_in)] = 1.0
    return a.tobytes()


def _joint_b(b_t: np.ndarray | None, s: float, c: np.ndarray | None, rank: int, n_out: int) -> bytes:
    """B's bytes: the training B times its scale s, then the offsets c, then zeros, column-wise."""
    b = np.zeros((n_out, rank), np.float32)
    r = 0 if b_t is None else b_t.shape[1]
    if b_t is not None:
        b[:, :r] = b_t * s
    if c is not None:
        b[:, r:r + c.shape[1]] = c
    return b.tobytes()


class JointAdapter:
    """The offsets of a split copy; `load` joins a training adapter to them inside llama.cpp."""

    def __init__(self, arch: str, offsets: dict[str, np.ndarray]) -> None:
        self.arch = arch
        self.offsets = offsets          # weight name -> [n_out, n_in / 32] F32

    @classmethod
    def of(cls, copy: Path) -> JointAdapter:
        """From the offsets adapter beside a split copy (split.write_split)."""
        side = offsets_path(copy)
        try:
            f = adapter_io.parse(side.read_bytes())
        except (OSError, adapter_io.AdapterError) as exc:
            raise GenerationError(f"{copy}: a split generator copy whose offsets adapter {side} is missing or "
                                  f"unreadable ({exc}; delete the copy, it is written again)") from None
        offsets = {}
        for name, b in f.tensors.items():
            if name.endswith(".lora_b"):
                n_in = f.tensors[name.removesuffix("_b") + "_a"].shape[1]
                offsets[name.removesuffix(".lora_b")] = np.array(b[:, : n_in // BLOCK], np.float32)
        return cls(f.arch, offsets)

    def _pieces(self, training: adapter_io.AdapterFile | None, scale: float) -> list[tuple[str, tuple, bool, object]]:
        """(tensor name, shape, F16?, a function giving its bytes) of the joint adapter, in file order."""
        tensors = {} if training is None else training.tensors
        trained = [n.removesuffix(".lora_a") for n in tensors if n.endswith(".lora_a")]
        alpha = training.alpha if training is not None else 0.0
        pieces = []
        for w in [*self.offsets, *(n for n in trained if n not in self.offsets)]:
            c = self.offsets.get(w)
            a_t, b_t = tensors.get(w + ".lora_a"), tensors.get(w + ".lora_b")
            r = 0 if a_t is None else a_t.shape[0]
            blocks = 0 if c is None else c.shape[1]
            n_in = a_t.shape[1] if a_t is not None else blocks * BLOCK
            n_out = b_t.shape[0] if b_t is not None else c.shape[0]
            rank = -(-(r + blocks) // RANK_STEP) * RANK_STEP
            s = scale * (alpha / r if alpha and r else 1.0)        # llama.cpp's scale: alpha / the weight's rank
            pieces += [(w + ".lora_a", (rank, n_in), True, partial(_joint_a, a_t, blocks, rank, n_in)),
                       (w + ".lora_b", (n_out, rank), False, partial(_joint_b, b_t, s, c, rank, n_out))]
        return pieces

    def load(self, model, data: bytes | None, scale: float = 1.0):
        """llama.cpp's adapter (to apply with scale 1) of the offsets joined with the adapter in `data`
        (GGUF bytes; None: the offsets alone)."""
        import llama_cpp.llama_cpp as lc

        training = None if data is None else adapter_io.parse(data)
        if training is not None and training.kind != "lora":
            raise GenerationError("a split generator copy takes LoRA adapters only")
        pieces = self._pieces(training, scale)
        head, offsets = adapter_io.header(self.arch, 0.0, [(n, shape, half) for n, shape, half, _ in pieces],
                                          name="training adapter and Q4_1 block offsets")
        last = pieces[-1] if pieces else None
        size = len(head) + (offsets[-1] + int(np.prod(last[1])) * (2 if last[2] else 4) if last else 0)
        stream = _Stream(head, [(len(head) + off, fn) for off, (_, _, _, fn) in zip(offsets, pieces)], size)
        fp = stream.open()
        try:
            ad = lc.llama_adapter_lora_init_from_file_ptr(model, fp)
        finally:
            _libc.fclose(fp)
            stream.release()
        if stream.error is not None:
            if ad:
                lc.llama_adapter_lora_free(ad)
            raise stream.error
        if not ad:
            raise GenerationError("llama.cpp rejected the adapter (is it for this model?)")
        return ad


class _Stream:
    """A read-only FILE* over a GGUF made of a header and tensors produced on demand, one at a time."""

    def __init__(self, head: bytes, tensors: list[tuple[int, object]], size: int) -> None:
        self.head, self.tensors, self.size = head, tensors, size
        self.starts = [start for start, _ in tensors]
        self.pos = 0
        self.current: tuple[int, bytes] = (-1, b"")
        self.error: Exception | None = None

    def _at(self, pos: int, n: int) -> bytes:
        if pos < len(self.head):
            return self.head[pos:pos + n]
        i = bisect.bisect_right(self.starts, pos) - 1
        if i < 0:
            return b""
        if self.current[0] != i:
            self.current = (i, self.tensors[i][1]())
        start, data = self.starts[i], self.current[1]
        if pos - start < len(data):
            return data[pos - start:pos - start + n]
        nxt = self.starts[i + 1] if i + 1 < len(self.starts) else self.size
        return b"\0" * min(n, max(0, nxt - pos))      # alignment padding

    def release(self) -> None:
        """Drop the callbacks and tensors: they refer back to the stream, a cycle that would keep
        the training adapter's bytes alive until the garbage collector ran."""
        self._funcs = self._buffer = None
        self.tensors, self.current = [], (-1, b"")

    def open(self):
        def read(_cookie, buf, size):
            try:
                chunk = self._at(self.pos, size)
                ctypes.memmove(buf, chunk, len(chunk))
                self.pos += len(chunk)
                return len(chunk)
            except Exception as exc:        # reported after llama.cpp gives up on the file
                self.error = exc
                return -1

        def seek(_cookie, offset, whence):
            base = {0: 0, 1: self.pos, 2: self.size}[whence]
            self.pos = base + offset[0]
            offset[0] = self.pos
            return 0

        # the callbacks must outlive the FILE*: kept on the stream, which the caller holds until fclose
        self._funcs = _IoFunctions(_READ(read), None, _SEEK(seek), _CLOSE(lambda _c: 0))
        fp = _libc.fopencookie(None, b"rb", self._funcs)
        if not fp:
            raise OSError("fopencookie failed")
        # reads of 64 KiB instead of glibc's 8 KiB (fewer calls into Python); not larger, since
        # llama.cpp seeks before each tensor and a seek throws the buffer's rest away
        self._buffer = ctypes.create_string_buffer(1 << 16)
        _libc.setvbuf(fp, self._buffer, 0, len(self._buffer))        # _IOFBF
        return fp
