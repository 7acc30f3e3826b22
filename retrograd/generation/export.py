"""`retrograd export`'s work: an adapter (LoRA or DoRA) merged into the base model's weights and
written as one GGUF that any llama.cpp-based runtime loads without an adapter.

Every adapted weight is dequantized (exact), merged in float (W + s B A for LoRA; DoRA's
m / ||W + s B A||_row (W + s B A) through merge.merged_weight; s = alpha / rank as the adapter file
carries it, so rsLoRA's alpha / sqrt(rank) comes along), and stored as F32. Then:

- a llama.cpp type (`q4_k_m`, `q5_k_m`, `q6_k`, `q8_0`, `f16`): that F32-merged model, its other
  tensors still in the base's types, goes through llama.cpp's own `llama_model_quantize` (the
  `llama-quantize` tool's function, with its per-tensor type mix), which dequantizes each input
  tensor and quantizes it to the target. Dequantizing is exact, so the result is what quantizing a
  full-precision merged model would give.
- `same`: each tensor keeps its own type. `llama_model_quantize` cannot express that (its ftype
  names one mix, and a base file's mix is not always llama.cpp's for that ftype), so the merged
  weights are re-quantized one by one to their original types by ggml's quantizer
  (`native.quantize_rows`, the function llama.cpp's quantizer calls per tensor), and every other
  tensor is copied byte for byte (rewrite.py).

Metadata, tokenizer and chat template are the base's (both paths copy every key). The output is
written under a temporary name and renamed when complete. llama.cpp's per-tensor warnings about
K-quant fallbacks (rows not a multiple of 256, e.g. SmolLM2's 576) are counted, not printed:
ExportResult.fallbacks carries them for a one-line summary.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from retrograd import adapter as adapter_io
from retrograd import native
from retrograd.data import tokenizer as tok_mod
from retrograd.data.tokenizer import quiet_llama_logs
from retrograd.errors import RetrogradError
from retrograd.fsutil import atomic_path, tmp_name
from retrograd.generation.merge import merged_weight, open_base
from retrograd.generation.rewrite import rewrite

TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "f16", "same")
#: rough bits per weight of each llama.cpp type, for the progress of the quantizer (polled file size)
BITS = {"q4_k_m": 4.9, "q5_k_m": 5.7, "q6_k": 6.6, "q8_0": 8.5, "f16": 16.0}
_F32 = 0

#: phase ("merge" or "quantize"), done, total
ProgressFn = Callable[[str, int, int], None]


class ExportError(RetrogradError):
    pass


@dataclass
class ExportResult:
    path: Path
    type: str
    merged: int          # weights the adapter changed
    nbytes: int
    seconds: float
    fallbacks: Fallbacks | None = None      # K-quant fallbacks llama.cpp made (None for `same`)


@dataclass
class Fallbacks:
    """What llama_model_quantize's fallback warnings said: tensors whose rows a K-quant cannot hold."""
    to: dict[str, int]                       # type written instead -> tensors
    wanted: set[str]                         # the K-quant types asked for
    widths: set[int]                         # the row lengths that did not fit
    block: int = 256
    total: int = 0                           # tensors in the model

    @property
    def count(self) -> int:
        return sum(self.to.values())

    def summary(self) -> str:
        kept = " / ".join(f"{t} ({n})" for t, n in sorted(self.to.items(), key=lambda kv: -kv[1]))
        widths = ", ".join(str(w) for w in sorted(self.widths))
        return (f"{self.count}{f' of {self.total}' if self.total else ''} tensors written as {kept} instead of "
                f"{' / '.join(sorted(self.wanted))}: their rows ({widths} wide) are not a multiple of {self.block}")


_WARN = 3
_NCOLS = re.compile(r"ncols\s+(\d+) not divisible by\s+(\d+) \(required for type\s+(\S+)\)")
_TO = re.compile(r"falling back to\s+(\S+)")
_TOTAL = re.compile(r"(\d+) of (\d+) tensor\(s\) required fallback")
_seen: list[Fallbacks] = []


def _quant_log(level: int, text: bytes, user) -> None:
    """llama.cpp's log while it quantizes: fallback warnings go into _seen[-1]; the rest takes the usual route."""
    msg = text.decode("utf-8", "replace")
    if level == _WARN and _seen:
        fb = _seen[-1]
        if m := _NCOLS.search(msg):
            fb.widths.add(int(m[1]))
            fb.block = int(m[2])
            fb.wanted.add(m[3])
        if m := _TO.search(msg):
            fb.to[m[1]] = fb.to.get(m[1], 0) + 1
        if m := _TOTAL.search(msg):
            fb.total = int(m[2])
        if m or "ncols" in msg or "must use F16" in msg:
            return
    tok_mod._log_cb(level, text, user)


_quant_log_cb = None        # the ctypes callback, created once and kept alive (llama.cpp holds a pointer to it)


def ftype_of(kind: str) -> int:
    """llama.cpp's LLAMA_FTYPE_* for a --type name."""
    import llama_cpp.llama_cpp as lc

    return {"q4_k_m": lc.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q5_k_m": lc.LLAMA_FTYPE_MOSTLY_Q5_K_M,
            "q6_k": lc.LLAMA_FTYPE_MOSTLY_Q6_K, "q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0,
            "f16": lc.LLAMA_FTYPE_MOSTLY_F16}[kind]


def merged_f32(t, ad: adapter_io.AdapterFile) -> np.ndarray:
    """The weight of GGUF tensor `t` with the adapter merged in, float32 [n_out, n_in]."""
    n_out, n_in = int(t.shape[1]), int(t.shape[0])
    w = native.dequantize_rows(int(t.tensor_type), t.data, n_out, n_in)
    a, b = ad.tensors[t.name + ".lora_a"], ad.tensors[t.name + ".lora_b"]
    if ad.kind == "dora":
        return merged_weight(w, a, b, ad.tensors[t.name + ".dora_m"], ad.scale).astype(np.float32)
    return (w.astype(np.float64) + ad.scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)


def export(base: Path, ad: adapter_io.AdapterFile, out: Path, kind: str, *, threads: int = 0,
           progress: ProgressFn | None = None) -> ExportResult:
    """Write base with `ad` merged in to `out` (atomically) in `kind` (one of TYPES)."""
    if kind not in TYPES:
        raise ExportError(f"--type {kind!r}: expected one of {', '.join(TYPES)}")
    quiet_llama_logs()          # llama_model_quantize reports every tensor at info level
    t0 = time.monotonic()
    reader, names = open_base(base, ad, ExportError)
    report = progress or (lambda *_: None)
    done = [0]

    def merged(t, to_type: int) -> np.ndarray:
        w = merged_f32(t, ad)
        raw = w.view(np.uint8) if to_type == _F32 else native.quantize_rows(to_type, w)
        done[0] += 1
        report("merge", done[0], len(names))
        return raw

    if kind == "same":
        rewrite(reader, out, {t.name: (int(t.tensor_type), partial(merged, to_type=int(t.tensor_type)))
                              for t in reader.tensors if t.name in names})
    else:
        inter = tmp_name(out).with_name(out.name + ".merged-f32.tmp")
        try:
            rewrite(reader, inter, {t.name: (_F32, lambda t: merged(t, _F32)) for t in reader.tensors if t.name in names})
            del reader
            estimate = int(sum(t_n * BITS[kind] / 8 for t_n in _weight_counts(inter)))
            with atomic_path(out) as tmp:
                fallbacks = quantize(inter, tmp, kind, threads=threads,
                                     progress=lambda n: report("quantize", min(n, estimate - 1), estimate))
            report("quantize", estimate, estimate)
        finally:
            inter.unlink(missing_ok=True)
        return ExportResult(out, kind, len(names), out.stat().st_size, time.monotonic() - t0, fallbacks)
    return ExportResult(out, kind, len(names), out.stat().st_size, time.monotonic() - t0)


def _weight_counts(path: Path) -> list[int]:
    import gguf

    return [int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors]


def quantize(src: Path, dst: Path, kind: str, *, threads: int = 0,
             progress: Callable[[int], None] | None = None) -> Fallbacks:
    """llama.cpp's llama_model_quantize(src -> dst, --type kind), in a thread while `progress` sees
    the bytes written so far; returns the fallbacks it made (its per-tensor warnings, not printed)."""
    import ctypes

    import llama_cpp.llama_cpp as lc

    global _quant_log_cb
    if _quant_log_cb is None:
        _quant_log_cb = lc.llama_log_callback(_quant_log)
    _seen.append(Fallbacks({}, set(), set()))
    lc.llama_log_set(_quant_log_cb, ctypes.c_void_p())

    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype_of(kind)
    params.nthread = threads
    params.allow_requantize = True        # the tensors the adapter did not touch are still in the base's types
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(
        lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))), daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.25)
            if progress is not None and dst.exists():
                progress(dst.stat().st_size)
    finally:
        if not worker.is_alive():           # (interrupted: the worker still logs through _quant_log)
            lc.llama_log_set(tok_mod._log_cb, ctypes.c_void_p())
    fallbacks = _seen.pop()
    if not result or result[0] != 0:
        raise ExportError(f"llama.cpp could not quantize {src.name} to {kind} (llama_model_quantize returned "
                          f"{result[0] if result else 'nothing'}; RUST_LOG=info shows its messages)")
    return fallbacks
