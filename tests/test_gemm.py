"""native/gemm.c, the packed product of the frozen weights (BF16 on AVX512-BF16 or AMX, F16 weights
times F32 activations on AVX2: every kernel this CPU runs): against a numpy oracle on its own (every
orientation, odd shapes, several weight types), and inside the engine against ggml's own product of
the same 16-bit type (the matmul mode "ggml-bf16" or "ggml-f16") on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS
from gradcheck import adapted, token_batch

from retrograd import native
from retrograd.engine import Trainable

pytestmark = pytest.mark.skipif(not native.packed_kernels(),
                                reason="the packed product needs AVX512-BF16, or AVX2 with FMA and F16C")


@pytest.fixture(params=list(native.PACKED_KERNELS))
def kernel(request):
    """Each of the product's kernels this CPU runs, forced by name (AVX512-BF16 on an AMX CPU too, the
    AVX2 F16 kernel on a BF16 one too)."""
    if request.param not in native.packed_kernels():
        pytest.skip(f"this CPU does not run the {request.param} kernel")
    return request.param


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to BF16 (nearest, ties to even), as float32"""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def f16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to F16 (nearest, ties to even, as ggml's conversion), as float32"""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def rounding(kernel: str):
    """What a kernel does to the weight and to the activations before multiplying: BF16 both, or F16
    weights and F32 activations kept as they are (avx2-f16)"""
    if kernel == "avx2-f16":
        return f16, lambda a: np.asarray(a, np.float32)
    return bf16, bf16


@pytest.mark.parametrize(("qtype", "n_out", "n_in", "tokens", "transposed"), [
    ("q4_1", 64, 64, 5, False),       # one row block, a partial token block
    ("q4_1", 70, 96, 13, True),       # padding rows in the last block, 13 = 12 + 1 tokens (6 + 6 + 1)
    ("q8_0", 33, 32, 1, False),       # one token
    ("f32", 7, 3, 25, False),         # an odd contraction: its last pair is half padding
    ("f32", 5, 9, 12, True),          # an odd contraction transposed
    ("q4_k", 40, 256, 30, True),      # a 256-value block type
    ("q4_1", 576, 576, 256, False),   # the default model's shapes
    ("q4_1", 192, 576, 256, True),
])
def test_packed_product_matches_the_oracle(kernel, qtype, n_out, n_in, tokens, transposed):
    """Every output is the rounded weight times the (rounded) input, each product exact in F32, summed
    in F32: within a few F32 roundings of the float64 sum, relative to the sum of the terms' magnitudes."""
    rng = np.random.default_rng(n_out * 1000 + n_in)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    x = rng.standard_normal((tokens, n_out if transposed else n_in)).astype(np.float32)
    out, deq = native.gemm_check(qtype, w, x, kernel=kernel, transposed=transposed, threads=THREADS)
    round_w, round_x = rounding(kernel)
    wm = round_w(deq).astype(np.float64)
    xm = round_x(x).astype(np.float64)
    m = wm if transposed else wm.T
    ref, scale = xm @ m, np.abs(xm) @ np.abs(m)
    assert out.shape == ref.shape
    err = np.max(np.abs(out - ref) / scale)
    assert err < 1e-6
    if kernel == "avx2-f16":    # the activations really stay F32: rounded to F16 they miss by far more
        assert np.max(np.abs(out - f16(x).astype(np.float64) @ m) / scale) > 10 * err
    if qtype != "f32":       # the quantizer really ran: the oracle's weight is not the input
        assert not np.array_equal(deq, w)


@pytest.mark.parametrize(("n_out", "tokens", "rank", "transposed"), [(70, 13, 4, False), (64, 256, 16, False),
                                                                     (40, 25, 3, True)])
def test_low_rank_epilogue_matches_the_oracle(kernel, n_out, tokens, rank, transposed):
    """The product plus a low-rank term V Z (LoRA's B (s A x), added inside the tiles): the term in
    F32, unrounded, on top of the 16-bit product; partial row and token blocks included."""
    rng = np.random.default_rng(n_out + rank)
    n_in = 96
    rows = n_in if transposed else n_out
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    x = rng.standard_normal((tokens, n_out if transposed else n_in)).astype(np.float32)
    v = rng.standard_normal((rank, rows)).astype(np.float32)
    z = rng.standard_normal((tokens, rank)).astype(np.float32)
    out, deq = native.gemm_check("q4_1", w, x, kernel=kernel, transposed=transposed, lowrank=(v, z), threads=THREADS)
    round_w, round_x = rounding(kernel)
    wm = round_w(deq).astype(np.float64)
    m = wm if transposed else wm.T
    xm = round_x(x).astype(np.float64)
    ref = xm @ m + z.astype(np.float64) @ v.astype(np.float64)
    scale = np.abs(xm) @ np.abs(m) + np.abs(z.astype(np.float64)) @ np.abs(v.astype(np.float64))
    assert np.max(np.abs(out - ref) / scale) < 1e-6
    plain, _ = native.gemm_check("q4_1", w, x, kernel=kernel, transposed=transposed, threads=THREADS)
    assert np.max(np.abs(out - plain)) > 0.1      # the term was really added


@pytest.mark.parametrize(("qtype", "transposed"), [("q4_1", False), ("q4_1", True), ("q8_0", False),
                                                  ("q8_0", True), ("q4_k", True), ("f32", False)])
def test_packed_weight_is_ggmls_values_rounded(kernel, qtype, transposed):
    """The packing reads Q4_1 and Q8_0 blocks with its own vector code: it must give exactly ggml's
    dequantized value rounded to the kernel's type (BF16, or F16 as the F16 route's converted copy;
    nearest, ties to even). Multiplying by one-hot tokens makes each output one weight times 1.0 plus
    zeros, which is exact, so the product shows the packed weight itself; 70 rows leave a partial row
    block as stored and padding pairs (BF16) or padding rows (F16) transposed."""
    rng = np.random.default_rng(7)
    n_out, n_in = 70, 256
    w = (rng.standard_normal((n_out, n_in)) * rng.uniform(0.01, 3.0, (n_out, 1))).astype(np.float32)
    k = n_out if transposed else n_in
    out, deq = native.gemm_check(qtype, w, np.eye(k, dtype=np.float32), kernel=kernel, transposed=transposed,
                                 threads=THREADS)
    round_w, _ = rounding(kernel)
    want = round_w(deq) if transposed else round_w(deq).T
    np.testing.assert_array_equal(out, want)


def _run(tr: Trainable, b: native.Batch, coeff: np.ndarray):
    seen = {}

    def loss(inp):
        seen["logp"] = np.array(inp.logp)
        return native.LossOutputs(coeff)

    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(b, loss)
    grads = tr.lora.state(native.SLOT_GRAD)
    return tr.logprobs(b).logp, seen["logp"], np.concatenate([grads[k].ravel() for k in sorted(grads)])


@pytest.mark.parametrize(("variant", "recompute"), [("lora", False), ("dora", False), ("lora", True)])
def test_engine_rounds_like_ggmls_product(kernel, tiny, variant, recompute):
    """The same step through the packed product and through ggml's product of the same 16-bit type
    (bf16 mode for the BF16 kernels, f16 for avx2-f16), both against the F32 mode. A 16-bit route is
    defined only up to its rounding: a last-bit change in one sum moves some activations across a
    rounding step, and by the top of the model the two routes differ by a fraction of their distance
    from F32. So the check is that the packed route is about as close to F32 as ggml's (scoring and
    training log-probs, LoRA gradients), and that it really ran (something differs); the product
    itself is checked exactly above. DoRA and activation checkpointing take it too.
    BF16 rounds weights and activations on both routes: within 1.5 times ggml's distance. ggml's F16
    route rounds the activations to F16 as well as the weights, avx2-f16 the weights only, and a Q4_1
    value (q d + m, d and m F16) is often exact or nearly so in F16: clearly closer (0.14 of ggml's
    distance in the log-probs, 0.3-0.4 in the gradients when written)."""
    tr = adapted(tiny("llama", qtype="Q4_1"), variant, recompute, THREADS)
    b, coeff = token_batch(3)
    tr.engine.set_matmul_mode("f32")
    exact = _run(tr, b, coeff)
    tr.engine.set_matmul_mode("ggml-f16" if kernel == "avx2-f16" else "ggml-bf16")
    ggml = _run(tr, b, coeff)
    tr.engine.set_matmul_mode(kernel)
    packed = _run(tr, b, coeff)
    bound = 0.75 if kernel == "avx2-f16" else 1.5
    changed = False
    for what, e, g, p in zip(("scoring log-probs", "training log-probs", "gradients"), exact, ggml, packed):
        d_ggml, d_packed = np.linalg.norm(g - e), np.linalg.norm(p - e)
        assert 0 < d_ggml and d_packed < bound * d_ggml, (what, d_packed, d_ggml)
        changed |= not np.array_equal(p, g)
    # BF16 times BF16 is exact in F32 and sums over this tiny model's 64 values often are too, so
    # the log-probs may come out bit-equal; the gradients' longer sums do not
    assert changed


def test_routes_are_settings_of_the_engine(tiny):
    """The kernel is the engine's setting, decided once: each route names the kernel it takes, a forced
    kernel the CPU lacks is refused with the engine left as it was, and two engines in one process
    keep their own routes (each computes what it computes alone)."""
    for k in native.packed_kernels():
        assert native.matmul_kernel(k) == k
    for route in ("ggml-f16", "ggml-bf16", "native", "f32"):
        assert native.matmul_kernel(route) == "ggml"
    assert native.matmul_kernel("auto") in native.packed_kernels()
    tr = adapted(tiny("llama", qtype="Q4_1"), "lora", False, THREADS)
    b, coeff = token_batch(3)
    kernel = native.matmul_kernel("auto")
    tr.engine.set_matmul_mode(kernel)
    packed = _run(tr, b, coeff)
    missing = [k for k in native.PACKED_KERNELS if k not in native.packed_kernels()]
    for k in missing:
        with pytest.raises(native.NativeError, match=f"the {k} kernel does not run on this CPU") as err:
            tr.engine.set_matmul_mode(k)
        assert err.value.status == native.STATUS_UNSUPPORTED
    ggml_route = "ggml-f16" if kernel == "avx2-f16" else "ggml-bf16"
    other = adapted(tiny("llama", qtype="Q4_1"), "lora", False, THREADS)
    other.engine.set_matmul_mode(ggml_route)
    ggml = _run(other, b, coeff)
    again = _run(tr, b, coeff)        # the refused settings changed nothing, the other engine neither
    for p, a in zip(packed, again):
        assert np.array_equal(p, a)
    assert not np.array_equal(packed[2], ggml[2])
