"""Tiled attention (native/attention.c) against the dense ggml ops it replaces and finite differences,
and the memory it saves on a long sequence."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import THREADS
from gradcheck import fd_check, randomize_adapter

from retrograd import native
from retrograd.data.batching import Group, group_batch
from retrograd.engine import LoraSpec, Trainable

# shapes that cross the tiles (32 queries by 64 keys) with partial tiles at the edges, grouped-query
# heads, and for gemma3 a window that ends inside a tile and one that spans several
SHAPES = {
    "llama": dict(n_layer=2, n_embd=48, n_head=6, n_head_kv=2, n_ff=64),
    "qwen2": dict(n_layer=2, n_embd=32, n_head=4, n_head_kv=1, n_ff=48),
    "qwen3": dict(n_layer=2, n_embd=32, n_head=4, n_head_kv=2, n_ff=48),
    "gemma3": dict(n_layer=6, n_embd=32, n_head=4, n_head_kv=2, n_ff=48, n_swa=70),
}


def mixed_batch(seed: int) -> native.Batch:
    """Two packed sequences, then a prompt shared by three continuations: 150 tokens."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 256, 61).astype(np.int32), rng.integers(0, 256, 40).astype(np.int32)
    prompt = rng.integers(0, 256, 21).astype(np.int32)
    comps = [rng.integers(0, 256, n).astype(np.int32) for n in (9, 14, 5)]
    shared, _ = group_batch([Group(prompt, comps)])
    prefix = np.where(shared.prefix_ids == native.NO_PREFIX, native.NO_PREFIX, shared.prefix_ids + 2)
    return native.Batch(
        tokens=np.concatenate([a, b, shared.tokens]).astype(np.int32),
        positions=np.concatenate([np.arange(61), np.arange(40), shared.positions]).astype(np.int32),
        seq_ids=np.concatenate([np.zeros(61), np.ones(40), shared.seq_ids + 2]).astype(np.int32),
        target_rows=np.concatenate([np.arange(60), 61 + np.arange(39), 101 + shared.target_rows]).astype(np.int32),
        target_ids=np.concatenate([a[1:], b[1:], shared.target_ids]).astype(np.int32),
        prefix_ids=np.concatenate([np.full(101, native.NO_PREFIX), prefix]).astype(np.int32),
    )


def run(path, attention: str, batch: native.Batch, coeff: np.ndarray, *, recompute: bool = False, exact: bool = False):
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS, seed=1)
    tr.engine.set_attention(attention)
    tr.engine.set_recompute(recompute)
    tr.engine.set_exact_ops(exact)
    tr.engine.set_matmul_mode("f32")     # compare the math, not F16 rounding of activations
    randomize_adapter(tr, 5, 0.1)
    logp = tr.accumulate(batch, lambda inp: native.LossOutputs(coeff))
    grads = {t.name: tr.lora.read(t.index, native.SLOT_GRAD) for t in tr.lora.tensors}
    tr.close()
    return logp, grads


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("recompute", [False, True])
def test_tiled_attention_matches_the_dense_ops(tiny, arch, recompute):
    """Log-probs and every LoRA gradient of the tiled path equal the dense path's (ggml's softmax over
    whole score matrices) up to the order of float sums: packed sequences, a shared prefix, causal
    masks across tiles, grouped-query heads, gemma3's sliding window."""
    path = tiny(arch, n_vocab=270, **SHAPES[arch])
    batch = mixed_batch(3)
    coeff = np.random.default_rng(4).standard_normal(batch.n_targets).astype(np.float32)
    # exact ops: gemma's GELU from llama.cpp's F16 table would turn last-bit differences into table steps
    lp_dense, g_dense = run(path, "dense", batch, coeff, recompute=recompute, exact=True)
    lp_tiled, g_tiled = run(path, "tiled", batch, coeff, recompute=recompute, exact=True)
    np.testing.assert_allclose(lp_tiled, lp_dense, atol=2e-5)
    for name, g in g_dense.items():
        err = np.linalg.norm(g_tiled[name] - g) / max(np.linalg.norm(g), 1e-12)
        assert err < 1e-4, f"{arch} {name}: relative difference {err:.2e}"


@pytest.mark.slow          # finite differences over every attention input: a minute on gemma3
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiled_attention_gradients_match_finite_differences(tiny, arch):
    """The tiled backward (dQ, dK, dV from recomputed probabilities) is the gradient of the tiled
    forward: central differences through the whole model on a batch that spans several tiles."""
    path = tiny(arch, n_vocab=270, **SHAPES[arch])
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS, seed=2)
    tr.engine.set_exact_ops(True)           # exact GELU: the forward is the function differentiated
    tr.engine.set_matmul_mode("f32")
    randomize_adapter(tr, 7)
    batch = mixed_batch(9)
    coeff = np.random.default_rng(10).standard_normal(batch.n_targets).astype(np.float32)
    # q, k and v's adapters carry the attention's three gradients
    tensors = [t for t in tr.lora.tensors if any(f"attn_{x}" in t.name for x in "qkv")]
    assert tensors
    worst = fd_check(tr, batch, coeff, tensors, n_entries=3, h=3e-3)   # dense ops: same error at each h
    tr.close()
    assert worst < 5e-3, f"{arch}: worst relative gradient error {worst}"


def test_attention_mode_is_validated(tiny):
    e = native.Engine(native.Model(tiny("llama"), "cpu", THREADS))
    with pytest.raises(ValueError, match="tiled"):
        e.set_attention("flash")


LONG = r"""
import json, sys
import numpy as np
from retrograd import native
from retrograd.engine import LoraSpec, Trainable
path, attention, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tr = Trainable(path, LoraSpec(16, 32.0), threads=2)
tr.engine.set_attention(attention)
toks = np.random.default_rng(0).integers(0, 40000, n).astype(np.int32)
batch = native.Batch.next_token(toks)
coeff = np.full(batch.n_targets, -1.0 / batch.n_targets, np.float32)
logp = tr.accumulate(batch, lambda inp: native.LossOutputs(coeff))
from retrograd.memory import peak_rss_mib   # this process's own peak, not the forking parent's
print(json.dumps({"rss_mib": peak_rss_mib(), "finite": bool(np.isfinite(logp).all())}))
"""


@pytest.mark.slow
def test_a_long_sequence_trains_in_linear_memory(smollm):
    """One 2,048-token training step of the default model, LoRA r16, no activation checkpointing:
    with the dense scores it peaked at 7.2 GB (30 layers x 9 heads x 2,048^2 floats, kept for the
    backward); tiled it stays under 3 GiB."""
    out = subprocess.run([sys.executable, "-c", LONG, str(smollm), "tiled", "2048"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["finite"]
    assert res["rss_mib"] < 3 * 1024, res
