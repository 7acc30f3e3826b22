"""The split copy's offsets and the training adapter, handed to llama.cpp as one adapter.

A split copy (split.py) needs its offsets applied as an adapter under the training one. As two
adapters, llama.cpp adds four graph nodes per weight for each (two products, a scale, an add):
on SmolLM2 that is 1,680 small nodes a decode step, each a barrier for the threads. As one, its A
stacks the training A over the block sums and its B puts the training B, scaled by alpha / r,
beside the offsets: the same product, and a GRPO step's rollouts decoded about 14% faster
(docs/benchmarks.md).

Both are Q8_0, so that llama.cpp multiplies them with int8 dot products over the activations
rounded to 8 bits per block, as it does for the weights themselves (F16 A and F32 B took twice the
time: their products were an eighth of a decode step). The block sums stay exact (each one is
64 x 1/64 in Q8_0), so the offsets multiply the block sums of the 8-bit activations, which is what
llama.cpp's own Q4_1 product does. The offsets and the training B round to 8 bits per 32 of a
row; B's blocks never mix the two (the training part is padded to 32 columns), so neither is
rounded on the other's scale. Weights without offsets keep F16 A and F32 B.

The joint adapter is rebuilt at every swap, from the training adapter's bytes (read in place,
adapter.parse) and the offsets (encoded once, when the copy is opened). So that no second whole
copy of it sits in memory beside llama.cpp's, it is written into llama.cpp's loader piece by piece
through a FILE* whose reads are served here (glibc's fopencookie): a tensor at a time.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

import numpy as np

from retrograd import adapter as adapter_io
from retrograd import native
from retrograd.adapter import GGML_F16, GGML_F32, GGML_Q8_0
from retrograd.errors import GenerationError
from retrograd.generation.split import BLOCK, RANK_STEP, offsets_path, up
from retrograd.libc import Lazy

_READ = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char), ctypes.c_size_t)
_SEEK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int)
_CLOSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class _IoFunctions(ctypes.Structure):
    _fields_ = [("read", _READ), ("write", ctypes.c_void_p), ("seek", _SEEK), ("close", _CLOSE)]


# glibc's, bound at the first joint adapter built, not at import (retrograd.libc)
_fopencookie = Lazy("fopencookie", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, _IoFunctions])
_fclose = Lazy("fclose", ctypes.c_int, [ctypes.c_void_p])
_setvbuf = Lazy("setvbuf", ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t])

Q8_BYTES = 2 + BLOCK          # a Q8_0 block: its scale (F16), then 32 int8


def q8_0(x: np.ndarray) -> np.ndarray:
    """Rows of x (a multiple of 32 long) as Q8_0 blocks, [rows, n / 32, 34] bytes, by ggml's quantizer."""
    x = np.asarray(x, np.float32)
    return native.quantize_rows(GGML_Q8_0, x.reshape(len(x), -1)).reshape(len(x), -1, Q8_BYTES)


# a block of 32 ones, exactly: scale 1/64 (a power of two), every value 64
_ONES = np.concatenate([np.array([1 / 64], np.float16).view(np.uint8), np.full(BLOCK, 64, np.uint8)])


def _split_a(train, blocks: int, r0: int, rank: int, n_in: int) -> bytes:
    """A's Q8_0 bytes: the training A's rows (train() gives both parts encoded), zeros to row r0,
    then row r0 + j summing block j of the inputs, then zeros."""
    a = np.zeros((rank, n_in // BLOCK, Q8_BYTES), np.uint8)
    if r0:
        a_q = train()[0]
        a[:len(a_q)] = a_q
    j = np.arange(blocks)
    a[r0 + j, j] = _ONES
    return a.tobytes()


def _split_b(train, c: np.ndarray, r0: int, n_out: int) -> bytes:
    """B's Q8_0 bytes: the training B (scaled, r0 columns) then the offsets' blocks c ([n_out,
    blocks / 32 rounded up, 34], encoded once)."""
    b = np.empty((n_out, r0 // BLOCK + c.shape[1], Q8_BYTES), np.uint8)
    if r0:
        b[:, :r0 // BLOCK] = train()[1]
    b[:, r0 // BLOCK:] = c
    return b.tobytes()


def _training_q8_0(a_t: np.ndarray, b_t: np.ndarray, s: float, r0: int) -> tuple[np.ndarray, np.ndarray]:
    """A training weight's A and B times s, in Q8_0; B's columns padded with zeros to r0."""
    t = np.zeros((len(b_t), r0), np.float32)
    t[:, :b_t.shape[1]] = b_t * s
    return q8_0(a_t), q8_0(t)


def _padded(x: np.ndarray, rows: int, cols: int, dtype, s: float = 1.0) -> bytes:
    """x times s in the top-left corner of a zero [rows, cols] array of dtype, as bytes."""
    out = np.zeros((rows, cols), dtype)
    out[:x.shape[0], :x.shape[1]] = x * s if s != 1.0 else x
    return out.tobytes()


class JointAdapter:
    """The offsets of a split copy; `load` joins a training adapter to them inside llama.cpp."""

    def __init__(self, arch: str, offsets: dict[str, np.ndarray]) -> None:
        """offsets: weight name -> [n_out, n_in / 32] F32, each block's offset."""
        self.arch = arch
        self.blocks = {w: c.shape[1] for w, c in offsets.items()}
        # Q8_0, its blocks of 32 offsets padded with zeros: 2.1 bytes an offset instead of 4
        self.encoded = {w: q8_0(np.pad(c, ((0, 0), (0, up(c.shape[1], BLOCK) - c.shape[1]))))
                        for w, c in offsets.items()}

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

    def _pieces(self, training: adapter_io.AdapterFile | None,
                scale: float) -> list[tuple[str, tuple[int, ...], int, Callable[[], bytes]]]:
        """(tensor name, shape, ggml type, a function giving its bytes) of the joint adapter, in file order."""
        tensors = {} if training is None else training.tensors
        trained = [n.removesuffix(".lora_a") for n in tensors if n.endswith(".lora_a")]
        alpha = training.alpha if training is not None else 0.0
        pieces: list[tuple[str, tuple[int, ...], int, Callable[[], bytes]]] = []
        for w in [*self.encoded, *(n for n in trained if n not in self.encoded)]:
            a_t, b_t = tensors.get(w + ".lora_a"), tensors.get(w + ".lora_b")
            r = 0 if a_t is None else a_t.shape[0]
            s = scale * (alpha / r if alpha and r else 1.0)        # llama.cpp's scale: alpha / the weight's rank
            if w in self.encoded:
                c = self.encoded[w]
                n_out, n_in, r0 = len(c), self.blocks[w] * BLOCK, up(r, BLOCK)
                rank = r0 + c.shape[1] * BLOCK
                if a_t is not None and (b_t is None or a_t.shape[1] != n_in or b_t.shape != (n_out, r)):
                    raise GenerationError(f"adapter tensors {w}.lora_a/b are not for this model's {w} "
                                          f"({n_out} x {n_in}): is the adapter for another model?")
                # encoded when first asked for, once: llama.cpp's reads may come back to a tensor
                train = None
                if r0 and a_t is not None and b_t is not None:   # r0 > 0 only with A, and then B (checked above)
                    train = cache(partial(_training_q8_0, a_t, b_t, s, r0))
                a_fn = partial(_split_a, train, self.blocks[w], r0, rank, n_in)
                pieces += [(w + ".lora_a", (rank, n_in), GGML_Q8_0, a_fn),
                           (w + ".lora_b", (n_out, rank), GGML_Q8_0, partial(_split_b, train, c, r0, n_out))]
            else:
                if a_t is None or b_t is None:                  # trained: A exists; B may be missing
                    raise GenerationError(f"adapter tensor {w}.lora_b is missing beside {w}.lora_a")
                rank, (n_out, n_in) = up(r, RANK_STEP), (b_t.shape[0], a_t.shape[1])
                pieces += [(w + ".lora_a", (rank, n_in), GGML_F16, partial(_padded, a_t, rank, n_in, np.float16)),
                           (w + ".lora_b", (n_out, rank), GGML_F32, partial(_padded, b_t, n_out, rank, np.float32, s))]
        return pieces

    def load(self, model, data: bytes | None, scale: float = 1.0):
        """llama.cpp's adapter (to apply with scale 1) of the offsets joined with the adapter in `data`
        (GGUF bytes; None: the offsets alone)."""
        import llama_cpp.llama_cpp as lc

        training = None if data is None else adapter_io.parse(data)
        if training is not None and training.kind != "lora":
            raise GenerationError("a split generator copy takes LoRA adapters only")
        pieces = self._pieces(training, scale)
        head, offsets = adapter_io.header(self.arch, 0.0, [(n, shape, typ) for n, shape, typ, _ in pieces],
                                          name="training adapter and Q4_1 block offsets")
        last = pieces[-1] if pieces else None
        size = len(head) + (offsets[-1] + adapter_io.tensor_nbytes(last[2], last[1]) if last else 0)
        stream = _Stream(head, [(len(head) + off, fn) for off, (_, _, _, fn) in zip(offsets, pieces)], size)
        fp = stream.open()
        try:
            ad = lc.llama_adapter_lora_init_from_file_ptr(model, fp)
        finally:
            _fclose(fp)
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

    def __init__(self, head: bytes, tensors: list[tuple[int, Callable[[], bytes]]], size: int) -> None:
        self.head, self.tensors, self.size = head, tensors, size
        self.starts = [start for start, _ in tensors]
        self.pos = 0
        self.recent: dict[int, bytes] = {}     # the tensors last produced, at most two
        self.error: Exception | None = None

    def _at(self, pos: int, n: int) -> bytes:
        if pos < len(self.head):
            return self.head[pos:pos + n]
        i = bisect.bisect_right(self.starts, pos) - 1
        if i < 0:
            return b""
        if i not in self.recent:
            # glibc's buffer reads ahead into the next tensor of the file, which llama.cpp (going
            # through its own map of the weights) may ask for after one more: two kept
            if len(self.recent) == 2:
                del self.recent[next(iter(self.recent))]
            self.recent[i] = self.tensors[i][1]()
        start, data = self.starts[i], self.recent[i]
        if pos - start < len(data):
            return data[pos - start:pos - start + n]
        nxt = self.starts[i + 1] if i + 1 < len(self.starts) else self.size
        return b"\0" * min(n, max(0, nxt - pos))      # alignment padding

    def release(self) -> None:
        """Drop the callbacks and tensors: they refer back to the stream, a cycle that would keep
        the training adapter's bytes alive until the garbage collector ran."""
        self._funcs = self._buffer = None
        self.tensors, self.recent = [], {}

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
        fp = _fopencookie(None, b"rb", self._funcs)
        if not fp:
            raise OSError("fopencookie failed")
        # reads of 64 KiB instead of glibc's 8 KiB (fewer calls into Python); not larger, since
        # llama.cpp seeks before each tensor and a seek throws the buffer's rest away
        self._buffer = ctypes.create_string_buffer(1 << 16)
        _setvbuf(fp, self._buffer, 0, len(self._buffer))        # _IOFBF
        return fp
