"""The weight cache ([training].weight_cache_mb): the same numbers as converting per micro-batch,
in the 16-bit type of the engine's matmul mode, within its budget, transposed copies first, and a
note in the run. Also the two 16-bit routes themselves: BF16 and F16 agree to their rounding."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS
from gradcheck import adapted, randomize_adapter, token_batch

from retrograd import native
from retrograd.engine import LoraSpec, Trainable


def _logp_and_grads(tr: Trainable, b: native.Batch, coeff: np.ndarray):
    logp = tr.logprobs(b).logp
    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(b, lambda inp: native.LossOutputs(coeff))
    return logp, tr.lora.state(native.SLOT_GRAD)


@pytest.mark.parametrize(("qtype", "variant", "recompute", "mode"),
                         [("Q4_1", "lora", False, "f16"), ("Q8_0", "lora", False, "f16"),
                          ("Q4_1", "dora", True, "f16"), ("Q4_1", "lora", False, "bf16"),
                          ("Q4_1", "dora", False, "bf16"), ("Q4_1", "lora", False, "ggml-f16"),
                          ("Q4_1", "lora", False, "ggml-bf16")])
def test_cached_weights_give_bit_equal_logprobs_and_gradients(tiny, qtype, variant, recompute, mode):
    """Q4_1 runs its forward through 16-bit copies and its backward through transposed ones; Q8_0
    keeps llama.cpp's kernel forward, so only the transposed copies exist. Either way, in F16 and in
    BF16, packed for the CPU's kernel or not (ggml's product forced), and with DoRA and activation
    checkpointing, the cache changes no bit."""
    tr = adapted(tiny("llama", qtype=qtype), variant, recompute, THREADS)
    tr.engine.set_matmul_mode(mode)
    b, coeff = token_batch(2)
    logp0, g0 = _logp_and_grads(tr, b, coeff)
    assert tr.model.set_weight_cache(64, mode) > 0
    logp1, g1 = _logp_and_grads(tr, b, coeff)
    assert np.array_equal(logp0, logp1)
    for name, g in g0.items():
        assert np.array_equal(g, g1[name]), name
    assert tr.model.set_weight_cache(0) == 0.0
    assert np.array_equal(_logp_and_grads(tr, b, coeff)[0], logp0)


def test_the_cache_stays_within_its_budget(smollm):
    """Every quantized target weight is cached transposed (the backward's copy) and, where the default
    route computes in F16, as stored too: all of them within a large budget, a subset within a small
    one, never more than the budget."""
    tr = Trainable(smollm, LoraSpec(4, 8.0), threads=THREADS)
    targets = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    full = 0
    for name, typ, shape in tr.model.tensors():
        if name.split(".")[-2] in targets and typ not in ("f32", "f16"):
            full += 2 * shape[0] * shape[1] * (1 if typ in ("q8_0", "q4_0") else 2)
    assert tr.model.set_weight_cache(4096) == pytest.approx(full / 2**20)
    part = tr.model.set_weight_cache(100)
    assert 90 < part <= 100
    assert tr.model.set_weight_cache(0) == 0.0


def test_weight_cache_mb_in_a_run_is_noted(tiny, tmp_path):
    from test_trainer import make_run

    from retrograd.config import load
    from retrograd.context import open_model

    cfg = load(make_run(tmp_path, tiny("llama", qtype="Q4_1")))
    cfg.training.weight_cache_mb = 16
    for precision, kind in (("f16", "f16"), ("bf16", "bf16"), ("auto", native.conv_type("auto"))):
        cfg.training.matmul_precision = precision
        ctx = open_model(cfg)
        assert f"weight cache: 0.2 MiB of {kind} weights (budget 16 MiB)" in ctx.notes, ctx.notes
        assert ctx.trainable.model.set_weight_cache(0) == 0.0
        ctx.trainable.close()


def test_a_forced_route_is_a_setting_and_checked(tiny, tmp_path):
    """[training].matmul_precision forces a route by its kernel's name; one this CPU cannot run is a
    configuration error naming what the CPU lacks, before any training."""
    from test_trainer import make_run

    from retrograd.config import ConfigError, load
    from retrograd.context import open_model

    cfg = load(make_run(tmp_path, tiny("llama", qtype="Q4_1")))
    cfg.training.weight_cache_mb = 16
    cfg.training.matmul_precision = "ggml-f16"
    ctx = open_model(cfg)
    assert "weight cache: 0.2 MiB of f16 weights (budget 16 MiB)" in ctx.notes, ctx.notes
    ctx.trainable.close()
    missing = [k for k in native.PACKED_KERNELS if k not in native.packed_kernels()]
    if not missing:
        pytest.skip("this CPU runs every packed kernel")
    cfg.training.matmul_precision = missing[0]
    with pytest.raises(ConfigError, match=rf"matmul_precision = '{missing[0]}': the {missing[0]} kernel does not run"):
        open_model(cfg)


@pytest.mark.parametrize(("engine", "cache"), [("bf16", "f16"), ("ggml-f16", "f16"), ("f16", "ggml-f16")])
def test_a_cache_of_other_settings_is_not_read(tiny, engine, cache):
    """An engine beside a cache made for other settings (BF16 mode beside F16 copies; ggml's product
    beside copies packed for the CPU's kernel, and the other way round, where a packed kernel runs)
    converts for itself: its numbers are its own route's, not the cache's."""
    tr = Trainable(tiny("llama", qtype="Q4_1"), LoraSpec(4, 8.0), threads=THREADS)
    randomize_adapter(tr, 1, 0.1)
    rng = np.random.default_rng(3)
    b = native.Batch.next_token(rng.integers(0, 256, 40).astype(np.int32))
    coeff = rng.standard_normal(b.n_targets).astype(np.float32)
    tr.engine.set_matmul_mode(engine)
    logp_bf, g_bf = _logp_and_grads(tr, b, coeff)
    assert tr.model.set_weight_cache(64, cache) > 0
    logp, g = _logp_and_grads(tr, b, coeff)
    assert np.array_equal(logp, logp_bf)
    for name in g:
        assert np.array_equal(g[name], g_bf[name]), name


def test_bf16_and_f16_products_agree_to_their_rounding(tiny):
    """The 16-bit routes compute the same function as the unrounded F32 route, to their rounding:
    F16 (11-bit mantissa) nearer than BF16 (8-bit), and both nearer than llama.cpp's own kernels
    (8-bit activations), which the default route was accepted at. They are not equal to each other,
    so BF16 is really used. The tiny model's random weights give large logits, which is why the
    absolute differences are larger than on a trained model (docs/numerics.md has those)."""
    tr = Trainable(tiny("llama", qtype="Q4_1"), LoraSpec(4, 8.0), threads=THREADS)
    randomize_adapter(tr, 1, 0.1)
    rng = np.random.default_rng(4)
    b = native.Batch.next_token(rng.integers(0, 256, 64).astype(np.int32))
    coeff = rng.standard_normal(b.n_targets).astype(np.float32)
    out = {}
    for mode in ("f32", "f16", "bf16", "native"):
        tr.engine.set_matmul_mode(mode)
        out[mode] = _logp_and_grads(tr, b, coeff)
    lp32, g32 = out["f32"]
    assert not np.array_equal(out["bf16"][0], out["f16"][0])

    def gap(mode: str) -> tuple[float, float]:
        lp, g = out[mode]
        grad = max(float(np.abs(g[n] - g32[n]).max() / np.abs(g32[n]).max()) for n in g32)
        return float(np.abs(lp - lp32).mean()), grad

    f16, bf16, q8 = gap("f16"), gap("bf16"), gap("native")
    assert 0 < f16[0] < bf16[0] < q8[0], (f16, bf16, q8)
    assert 0 < f16[1] < bf16[1] < q8[1], (f16, bf16, q8)
