"""The generator's weights in another format than the model file.

Rollouts decode a group of sequences a step. llama.cpp's Q4_1 kernel is compute-bound at 8
sequences on a 2-core CPU, while its F16, BF16 (with AVX512-BF16) and Q8_0 paths decode a batch
faster: the BF16 copy through llamafile's tiled GEMM, which reuses each weight across the batch, so
a GRPO step's four groups of 8 decode 2.2x as fast as one group at a time from Q4_1 on a Zen 4
(docs/benchmarks.md). `[grpo].generator_weights` has llama.cpp's own quantizer write such a
copy of the model once, into the model cache, and the generator loads it; the trainer keeps the
quantized file. A copy costs memory (2 bytes a weight in 16 bits) and changes what is sampled by
the rounding of its format, which the logged `logp_gap` measures: the 16-bit copies are closer to
the trainer's forward (which also multiplies in 16 bits) than the model file's own kernels are.
Re-quantizing to the 4-bit formats llama.cpp repacks for AVX2 (Q4_0, IQ4_NL) decodes faster still,
but samples from a model 0.5-0.65 nats a token away, so they are not offered; "split" (split.py)
reaches those kernels for a Q4_1 model without re-quantizing, and "auto" (the default) picks it for
a Q4_1 model on the CPU: about the BF16 copy's speed at the model file's size.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import llama_cpp.llama_cpp as lc

from retrograd.data.tokenizer import quiet_llama_logs
from retrograd.errors import RetrogradError
from retrograd.generation import split
from retrograd.logs import log
from retrograd.models import cache_dir

# llama.cpp's llama_ftype values
FORMATS = {"f16": 1, "bf16": 32, "q8_0": 7}
CHOICES = ("auto", "native", "split", *FORMATS)
# "auto" splits model files up to this size: the joint adapter the split copy decodes with
# (joint.py) holds a byte for each weight row and block of 32 (Q8_0, plus padding) and the block
# sums, about a quarter of the file's size in memory on the default model, which a small model's
# rollouts repay and a 7B model's memory may not
AUTO_SPLIT_MAX = 1 << 30


def resolve(path: Path, weights: str, *, on_cpu: bool = True, dora: bool = False) -> str:
    """The format "auto" stands for: "split" for a model of at most AUTO_SPLIT_MAX with Q4_1 block
    weights decoded on the CPU (a DoRA adapter makes the generator load a merged model instead, so
    not then), else "native"."""
    if weights == "split" and dora:
        raise RetrogradError('generator_weights = "split" cannot apply a DoRA adapter (the generator loads '
                             'the model merged with it); use "auto" or "native"')
    if weights != "auto":
        return weights
    size = path.stat().st_size
    if not on_cpu or dora or size > AUTO_SPLIT_MAX or not split.can_split(path):
        return "native"
    where = cache_dir()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < 2 * size:
        log.warning("generator_weights = auto: %.1f GB free for the split copy of %s (%.1f GB); decoding the "
                    "file's own weights", free / 1e9, path.name, size / 1e9)
        return "native"
    return "split"


def generator_model(path: Path, weights: str, threads: int, *, on_cpu: bool = True, dora: bool = False) -> Path:
    """The model file the generator should load: `path` itself for "native", else a converted copy
    in the cache (written on first use, named by the source's size and modification time, so an
    edited model gets a fresh copy). "auto" is resolved first (resolve)."""
    weights = resolve(path, weights, on_cpu=on_cpu, dora=dora)
    if weights == "native":
        return path
    if weights not in CHOICES:
        raise RetrogradError(f"generator_weights: {weights!r} is not one of {', '.join(CHOICES)}")
    st = path.stat()
    out_dir = cache_dir() / "generator"
    out = out_dir / f"{path.stem}.{st.st_size}-{st.st_mtime_ns}.{weights}.gguf"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights == "split":
        split.write_split(path, out)
        return out
    tmp = out.with_name(out.name + f".{os.getpid()}.partial")
    quiet_llama_logs()
    params = lc.llama_model_quantize_default_params()
    params.ftype = FORMATS[weights]
    params.allow_requantize = True
    params.nthread = threads
    try:
        rc = lc.llama_model_quantize(str(path).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RetrogradError(f"{path}: llama.cpp could not write a {weights} copy for the generator (code {rc})")
        os.replace(tmp, out)        # a file of this name is always complete
    finally:
        tmp.unlink(missing_ok=True)
    return out
