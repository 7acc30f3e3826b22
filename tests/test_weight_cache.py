"""The F16 weight cache ([training].weight_cache_mb): the same numbers as converting per micro-batch,
within its budget, transposed copies first, and a note in the run."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS
from gradcheck import randomize_adapter

from retrograd import native
from retrograd.engine import LoraSpec, Trainable


def _logp_and_grads(tr: Trainable, b: native.Batch, coeff: np.ndarray):
    logp = tr.logprobs(b).logp
    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(b, lambda inp: native.LossOutputs(coeff))
    return logp, tr.lora.state(native.SLOT_GRAD)


@pytest.mark.parametrize(("qtype", "variant", "recompute"), [("Q4_1", "lora", False), ("Q8_0", "lora", False),
                                                             ("Q4_1", "dora", True)])
def test_cached_weights_give_bit_equal_logprobs_and_gradients(tiny, qtype, variant, recompute):
    """Q4_1 runs its forward through F16 copies and its backward through transposed ones; Q8_0 keeps
    llama.cpp's kernel forward, so only the transposed copies exist. Either way, and with DoRA and
    activation checkpointing, the cache changes no bit."""
    tr = Trainable(tiny("llama", qtype=qtype), LoraSpec(4, 8.0, variant=variant), threads=THREADS)
    tr.engine.set_recompute(recompute)
    randomize_adapter(tr, 1, 0.1)
    if variant == "dora":
        tr.lora.reset_magnitude()
    rng = np.random.default_rng(2)
    b = native.Batch.next_token(rng.integers(0, 256, 40).astype(np.int32))
    coeff = rng.standard_normal(b.n_targets).astype(np.float32)
    logp0, g0 = _logp_and_grads(tr, b, coeff)
    assert tr.model.set_weight_cache(64) > 0
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
    ctx = open_model(cfg)
    assert any(n.startswith("weight cache: 0.2 MiB of F16 weights (budget 16 MiB)") for n in ctx.notes), ctx.notes
    assert ctx.trainable.model.set_weight_cache(0) == 0.0
