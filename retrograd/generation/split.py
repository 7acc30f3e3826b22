"""The generator's "split" weights: a Q4_1 model decoded through llama.cpp's Q4_0 kernels, exactly.

A Q4_1 block holds 32 weights as w = d*q + m (q in 0..15; d, m in F16). llama.cpp multiplies Q4_1
with one dot product per weight row and token, so a batch of 32 sequences costs four times a
batch of 8; its Q4_0 weights (w = d*(q - 8)) go through tiled GEMMs that reuse each weight across
the batch (repacked for AVX2/AVX-512 and ARM, or llamafile's). The same nibbles and scale read as
Q4_0 are each weight less its block's offset c = m + 8d, so for a row n of W and an input x

    (W x)_n = (Q4_0 W x)_n + sum over blocks b of c[n, b] * S_b(x),   S_b(x) = the sum of x over block b

The second term is a product of rank n_in/32. llama.cpp applies it as a LoRA adapter written
beside the copy (A sums the blocks, F16 ones; B holds the offsets, F32) and loaded once with the
model, under the training adapter swapped in every step. Nothing is re-quantized: the generator
samples from the file's own weights, up to how the products round their activations (the
activations are rounded to 8 bits per block either way). Re-quantizing to Q4_0 instead would put
the generator 0.5-0.65 nats a token away from the trainer (docs/benchmarks.md).

Only the block weights every dense architecture multiplies through llama.cpp's adapter-aware
product are split (TARGETS); the embeddings and the rest are copied as they are.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np

from retrograd import adapter as adapter_io
from retrograd.errors import RetrogradError
from retrograd.generation.rewrite import rewrite

OFFSETS_KEY = "retrograd.split.offsets"     # the copy's metadata: the file name of its offsets adapter
TARGETS = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
_Q4_0, _Q4_1 = 2, 3                          # ggml type numbers
BLOCK = 32
RANK_STEP = 16     # llamafile's GEMM takes inner sizes in multiples of 16 (AVX-512) or 8; else ggml's slow dot


def up(n: int, step: int) -> int:
    """n rounded up to a multiple of step."""
    return -(-n // step) * step


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:
        raise RetrogradError(f"{path}: not a readable GGUF file ({exc})") from None


def split_names(reader) -> list[str]:
    """The weights of `reader`'s model the split copy rewrites: the Q4_1 block weights."""
    return [t.name for t in reader.tensors
            if int(t.tensor_type) == _Q4_1 and len(t.shape) == 2 and TARGETS.fullmatch(t.name)]


def can_split(path: Path) -> bool:
    return bool(split_names(_reader(path)))


def is_split(path: Path) -> bool:
    """Whether `path` is a split copy (its offsets adapter is beside it)."""
    return path.name.endswith(".split.gguf") and offsets_path(path).exists()


def offsets_path(copy: Path) -> Path:
    return copy.with_name(copy.name.removesuffix(".gguf") + ".offsets.gguf")


def _blocks(t) -> np.ndarray:
    """A Q4_1 tensor's blocks as rows of 20 bytes: d, m (F16), then 16 bytes of nibbles."""
    return np.asarray(t.data).reshape(-1, 20)


def as_q4_0(t) -> np.ndarray:
    """The Q4_0 bytes of a Q4_1 tensor: each block's d and nibbles, its m dropped (same nibble order)."""
    b = _blocks(t)
    return np.concatenate([b[:, 0:2], b[:, 4:20]], axis=1).reshape(-1)


def offsets(t) -> tuple[np.ndarray, np.ndarray]:
    """The adapter (A [r, n_in] F16, B [n_out, r] F32) adding each block's offset m + 8d back, r
    being n_in/32 rounded up to a multiple of 16 (the padding is zeros)."""
    n_in, n_out = int(t.shape[0]), int(t.shape[1])
    b = _blocks(t)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n_out, n_in // BLOCK)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n_out, n_in // BLOCK)
    blocks = n_in // BLOCK
    rank = up(blocks, RANK_STEP)
    a = np.zeros((rank, n_in), np.float16)
    a[np.arange(n_in) // BLOCK, np.arange(n_in)] = 1.0
    lb = np.zeros((n_out, rank), np.float32)
    lb[:, :blocks] = m + 8.0 * d
    return a, lb


def write_split(src: Path, out: Path) -> None:
    """Write the split copy of `src` to `out` and its offsets adapter beside it (offsets_path), the
    adapter first: a copy that exists always has its adapter."""
    reader = _reader(src)
    names = split_names(reader)
    if not names:
        raise RetrogradError(f"{src}: no Q4_1 block weights to split")
    arch = str(reader.fields["general.architecture"].contents())
    tensors = {}
    for t in reader.tensors:
        if t.name in names:
            a, b = offsets(t)
            tensors[t.name + ".lora_a"], tensors[t.name + ".lora_b"] = a, b
    side = offsets_path(out)
    # alpha 0: llama.cpp scales the product by the adapter's scale alone (1), not alpha / rank
    adapter_io.write(side, adapter_io.to_bytes(arch, 0.0, tensors, name="Q4_1 block offsets"))
    rewrite(reader, out, {n: (_Q4_0, as_q4_0) for n in names}, extra={OFFSETS_KEY: side.name})


def marked(model) -> bool:
    """Whether llama.cpp's loaded model is a split copy (its metadata names the offsets adapter)."""
    import llama_cpp.llama_cpp as lc

    buf = ctypes.create_string_buffer(512)
    return lc.llama_model_meta_val_str(model, OFFSETS_KEY.encode(), buf, len(buf)) >= 0
