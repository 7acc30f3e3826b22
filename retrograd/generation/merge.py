"""DoRA adapters merged into the base model's weights, for llama.cpp.

llama.cpp's adapter format holds A and B only, so a DoRA adapter reaches llama.cpp as a model
file in which every adapted weight W is replaced by

    W' = m / ||W + s B A||_row * (W + s B A)        (s = alpha / rank, norms over each output row)

and every other tensor is copied byte for byte. The merged weights are stored as (`FORMATS`):
- "f16": faithful to float rounding, the file grows (about 2.5x for a Q4 model with every target
  adapted). The default of `[lora].merged_format`, and what chat, serve and bench load when given a
  DoRA adapter (cached by content, `merged_model`).
- "q8_0": ggml's 8-bit format, about half of F16.
- "base": each weight re-quantized to its own type by ggml's quantizer (llama.cpp's), so the file
  keeps the base's size; but a 4-bit grid snaps most weights back to where they were: after a short
  run on SmolLM2 Q4_1 the stored weights keep about 13% of the trained change (docs/numerics.md).
`MergeReport` measures what each format kept, and `retrograd train` prints it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd import adapter as adapter_io
from retrograd import native
from retrograd.errors import RetrogradError
from retrograd.generation.rewrite import rewrite
from retrograd.logs import log
from retrograd.models import cache_dir

FORMATS = ("f16", "q8_0", "base")
KEEP_CACHED = 4                     # merged models kept in the cache (a served run may merge every step)
_F16, _Q8_0 = 1, 8                  # ggml type numbers


@dataclass
class MergeReport:
    tensors: int = 0
    change_sq: float = 0.0     # sum of ||W' - W||^2: the trained change in float
    error_sq: float = 0.0      # sum of ||stored W' - W'||^2: what the format adds
    kept_dot: float = 0.0      # sum of <stored W' - W, W' - W>

    @property
    def kept(self) -> float:
        """The fraction of the trained change the stored weights keep (projection; 1 = all)."""
        return self.kept_dot / self.change_sq if self.change_sq else 1.0

    @property
    def relative_error(self) -> float:
        """||stored - merged|| / ||merged - base||, over all merged weights."""
        return float(np.sqrt(self.error_sq / self.change_sq)) if self.change_sq else 0.0

    def line(self, fmt: str) -> str:
        return (f"{self.tensors} weights merged ({fmt}): the stored weights keep {100 * self.kept:.1f}% of the trained "
                f"change; their error is {self.relative_error:.3g}x its size")


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, m: np.ndarray, scale: float) -> np.ndarray:
    """W' for W [n_out, n_in], A [r, n_in], B [n_out, r], m [n_out, 1], in float64."""
    v = w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
    return v * (m.astype(np.float64) / np.linalg.norm(v, axis=1, keepdims=True))


def open_base(base: Path, ad: adapter_io.AdapterFile, error: type[RetrogradError] = RetrogradError):
    """The base GGUF's reader and the names of the weights the adapter adapts, after checking that
    the adapter is for this model (`error` raised otherwise)."""
    import gguf

    reader = gguf.GGUFReader(str(base))
    arch = str(reader.fields["general.architecture"].contents())
    if arch != ad.arch:
        raise error(f"{base}: the model is {arch!r}, the adapter is for {ad.arch!r}")
    names = {n.removesuffix(".lora_a") for n in ad.tensors if n.endswith(".lora_a")}
    missing = names - {t.name for t in reader.tensors}
    if missing:
        raise error(f"{base}: the adapter adapts {sorted(missing)[0]}, which the model does not have")
    return reader, names


def write_merged(base: Path, ad: adapter_io.AdapterFile, out: Path, fmt: str = FORMATS[0]) -> MergeReport:
    """Write base with ad merged in (atomically) and report what the format kept."""
    if ad.kind != "dora":
        raise RetrogradError("only a DoRA adapter is merged; llama.cpp applies a LoRA adapter itself")
    if fmt not in FORMATS:
        raise RetrogradError(f"merge format {fmt!r} is not one of {', '.join(FORMATS)}")
    reader, names = open_base(base, ad)

    def kind_of(t) -> int:
        kind = {"f16": _F16, "q8_0": _Q8_0, "base": int(t.tensor_type)}[fmt]
        return _F16 if kind == _Q8_0 and int(t.shape[0]) % 32 else kind    # rows that do not fill Q8_0's blocks

    report = MergeReport()

    def merged(t) -> np.ndarray:
        n_out, n_in, kind = int(t.shape[1]), int(t.shape[0]), kind_of(t)
        w = native.dequantize_rows(int(t.tensor_type), t.data, n_out, n_in)
        new = merged_weight(w, ad.tensors[t.name + ".lora_a"], ad.tensors[t.name + ".lora_b"],
                            ad.tensors[t.name + ".dora_m"], ad.scale)
        raw = native.quantize_rows(kind, new.astype(np.float32))
        back = native.dequantize_rows(kind, raw, n_out, n_in).astype(np.float64)
        change = new - w
        report.tensors += 1
        report.change_sq += float(np.sum(change * change))
        report.error_sq += float(np.sum((back - new) ** 2))
        report.kept_dot += float(np.sum((back - w) * change))
        return raw

    rewrite(reader, out, {t.name: (kind_of(t), merged) for t in reader.tensors if t.name in names})
    return report


def merged_model(base: Path, data: bytes) -> Path:
    """The F16-merged model for a DoRA adapter's bytes, written once into the model cache (named by
    the adapter's content and the base file's size and time) and reused; the cache keeps the
    KEEP_CACHED most recent."""
    st = base.stat()
    key = hashlib.sha256(data + f"{base.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "merged" / f"{base.stem}.dora-{key}.f16.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_name(out.name + f".{os.getpid()}.adapter")
    try:
        src.write_bytes(data)
        report = write_merged(base, adapter_io.read(src), out, "f16")
    finally:
        src.unlink(missing_ok=True)
    older = sorted((p for p in out.parent.glob("*.gguf") if p != out), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in older[KEEP_CACHED - 1:]:
        p.unlink(missing_ok=True)
    log.warning("DoRA adapter merged into %s for llama.cpp: %s", out, report.line("f16"))
    return out
