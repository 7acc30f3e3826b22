"""The native engine: one ggml in the process, forward parity, gradients, adapters, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS, slow_case
from gradcheck import fd_check, randomize_adapter
from llama_ref import llama, next_token_logprobs
from reference import RefModel, dropout_mask

from retrograd import native
from retrograd.engine import LoraSpec, Trainable

TEXT = ("The history of mathematics deals with the origin of discoveries in mathematics and the mathematical "
        "methods and notation of the past. Before the modern age and the worldwide spread of knowledge, written "
        "examples of new mathematical developments have come to light only in a few locales. From 3000 BC the "
        "Mesopotamian states of Sumer, Akkad and Assyria, followed closely by Ancient Egypt and the Levantine "
        "state of Ebla began using arithmetic, algebra and geometry for purposes of taxation, commerce and trade. ")


def test_config_targets_are_the_c_librarys():
    from retrograd.sections import TARGETS

    assert native.TARGETS == TARGETS


def test_config_matmul_precisions_are_the_engines_routes():
    from retrograd.sections import MATMUL_PRECISIONS

    assert set(native.MATMUL_ROUTES) == {*MATMUL_PRECISIONS, "f32"}
    assert set(native.PACKED_KERNELS) <= set(MATMUL_PRECISIONS)


def test_setters_validate_their_arguments(tiny):
    """Every setter checks its value and answers with a status (RG_ERR_ARG, the message naming the
    setting), leaving the object as it was: the next forward computes what it computed before."""
    m = native.Model(tiny("llama"), "cpu", THREADS)
    e = native.Engine(m)
    b = native.Batch.next_token(np.arange(12, dtype=np.int32))
    before = e.forward(None, b).logp
    lib = native.lib
    for call, name in ((lambda: lib.rg_engine_set_recompute(e._ptr, 2), "activation checkpointing"),
                       (lambda: lib.rg_engine_set_exact_ops(e._ptr, -1), "exact ops"),
                       (lambda: lib.rg_engine_set_profiling(e._ptr, 7), "profiling"),
                       (lambda: lib.rg_engine_set_attention(e._ptr, 9), "attention"),
                       (lambda: lib.rg_engine_set_matmul(e._ptr, 99, lib.RG_KERNEL_AUTO), "matmul mode"),
                       (lambda: lib.rg_engine_set_matmul(e._ptr, lib.RG_MATMUL_F32, 99), "matmul kernel"),
                       (lambda: lib.rg_model_set_weight_cache(m._ptr, 1 << 20, 99, lib.RG_KERNEL_AUTO, native.ffi.NULL),
                        "matmul mode")):
        assert call() == native.STATUS_ARG, name
        assert name in native.ffi.string(lib.rg_last_error()).decode(), name
    assert np.array_equal(e.forward(None, b).logp, before)
    with pytest.raises(ValueError, match="matmul mode must be one of"):
        e.set_matmul_mode("f8")
    e.set_recompute(True)
    e.set_recompute(False)


def test_running_out_of_memory_is_its_own_error(smollm):
    """An allocation that fails is RG_ERR_NOMEM, raised as NativeMemoryError (a MemoryError too) that
    says so and what it was for: here the weight cache (405 MiB) under an address-space limit 64 MiB
    above what the process holds, in a process of its own."""
    script = (
        "import resource, sys\n"
        "from retrograd import native\n"
        "m = native.Model(sys.argv[1], 'cpu', 1)\n"
        "vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    m.set_weight_cache(4096)\n"
        "except native.NativeMemoryError as exc:\n"
        "    print(exc.status == native.STATUS_NOMEM, isinstance(exc, MemoryError), exc.kind, '|', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(smollm)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True True out of memory | out of memory: could not allocate the weight cache (405 MiB)"


def test_one_ggml_in_process():
    import llama_cpp  # noqa: F401 - loads libllama and its ggml

    from retrograd import _native  # noqa: F401

    maps = Path("/proc/self/maps").read_text().splitlines()
    libs = {line.split()[-1] for line in maps if "libggml-base" in line}
    assert len(libs) == 1, f"more than one libggml-base mapped: {libs}"
    # the symbol our library calls is the one llama_cpp's library exports
    import ctypes

    mapped = libs.pop()
    assert "llama_cpp" in mapped, f"ggml is not llama-cpp-python's: {mapped}"
    theirs = ctypes.CDLL(mapped, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    ours = int(native.ffi.cast("uintptr_t", native.lib.rg_ggml_init_address()))
    assert ours == ctypes.cast(theirs.ggml_init, ctypes.c_void_p).value


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_forward_matches_float64_reference(tiny, arch):
    path = tiny(arch, n_layer=6 if arch == "gemma3" else 2)
    ref = RefModel.load(str(path))
    m = native.Model(path, "cpu", THREADS)
    e = native.Engine(m)
    e.set_exact_ops(True)
    toks = np.random.default_rng(1).integers(0, 256, 14).astype(np.int32)   # > n_swa: the window matters
    ours = e.forward(None, native.Batch.next_token(toks)).logp
    # float32 against float64: 1e-4 absolute, and 2e-5 relative for log-probs as low as -14 (AVX2's sums)
    np.testing.assert_allclose(ours, ref.logprobs(toks), atol=1e-4, rtol=2e-5)


def test_packed_sequences_do_not_see_each_other(tiny):
    m = native.Model(tiny("llama"), "cpu", THREADS)
    e = native.Engine(m)
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 256, 9).astype(np.int32), rng.integers(0, 256, 7).astype(np.int32)
    la = e.forward(None, native.Batch.next_token(a)).logp
    lb = e.forward(None, native.Batch.next_token(b)).logp
    both = e.forward(None, native.Batch.next_token(np.concatenate([a, b]), np.array([0] * 9 + [1] * 7))).logp
    np.testing.assert_allclose(both, np.concatenate([la, lb]), atol=2e-5)


@pytest.mark.slow          # the real models, requested by name (conftest marks only fixtures named in the signature)
@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_forward_parity_with_llama_cpp(request, model, tmp_path):
    path = request.getfixturevalue(model)
    tr = Trainable(path, LoraSpec(8, 16.0), threads=THREADS)
    tr.engine.set_matmul_mode("native")
    rng = np.random.default_rng(0)
    for t in tr.lora.tensors:       # a non-zero adapter, loaded into both
        if t.name.endswith("lora_b"):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.02)
    adapter = tmp_path / "a.gguf"
    tr.save_adapter(adapter)
    for lora_path in (None, adapter):
        llm = llama(path, lora_path)
        toks = llm.tokenize(TEXT.encode(), add_bos=True)
        toks = (toks * 3)[:300]
        ref = next_token_logprobs(llm, toks)
        ours = tr.logprobs(native.Batch.next_token(np.array(toks, np.int32)), adapter=lora_path is not None).logp
        diff = np.abs(ours - ref)
        assert len(toks) >= 256
        assert diff.mean() < 0.01, f"{path.name} adapter={lora_path is not None}: mean |diff| {diff.mean()}"
        del llm
    base = tr.logprobs(native.Batch.next_token(np.array(toks, np.int32)), adapter=False).logp
    assert np.abs(ours - base).mean() > 0.01, "the adapter should change the log-probs"


def test_adapter_roundtrip_bit_exact(tiny, tmp_path):
    path = tiny("qwen2")
    a = Trainable(path, LoraSpec(4, 8.0), threads=THREADS, seed=3)
    rng = np.random.default_rng(1)
    for t in a.lora.tensors:
        a.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32))
    a.save_adapter(tmp_path / "x.gguf")
    b = Trainable(path, LoraSpec(4, 8.0), threads=THREADS, seed=4)
    b.load_adapter(tmp_path / "x.gguf")
    for t in a.lora.tensors:
        assert np.array_equal(a.lora.read(t.index), b.lora.read(t.index)), t.name
    import gguf
    r = gguf.GGUFReader(str(tmp_path / "x.gguf"))
    assert r.fields["general.type"].contents() == "adapter"
    assert r.fields["adapter.type"].contents() == "lora"
    assert r.fields["adapter.lora.alpha"].contents() == 8.0


def test_a_starting_adapter_is_the_reference_policy(tiny, tmp_path):
    """A run that starts from [lora].init_adapter measures KL and preference losses against that adapter:
    the reference is a frozen copy, untouched by training, and without one the reference is the base model."""
    path = tiny("llama")
    a = Trainable(path, LoraSpec(4, 8.0), threads=THREADS, seed=3)
    rng = np.random.default_rng(1)
    for t in a.lora.tensors:
        a.lora.write(t.index, 0.3 * rng.standard_normal(t.shape).astype(np.float32))
    a.save_adapter(tmp_path / "start.gguf")
    b = native.Batch.next_token(rng.integers(0, 256, 16).astype(np.int32))
    assert np.array_equal(a.reference_logprobs(b).logp, a.logprobs(b, adapter=False).logp)
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS, seed=4)
    tr.load_adapter(tmp_path / "start.gguf", reference=True)
    start = tr.logprobs(b).logp
    np.testing.assert_array_equal(tr.reference_logprobs(b).logp, start)
    assert np.abs(start - tr.logprobs(b, adapter=False).logp).max() > 1e-3
    for t in tr.lora.tensors:       # training moves the policy, not the reference
        tr.lora.write(t.index, np.zeros(t.shape, np.float32))
    np.testing.assert_array_equal(tr.reference_logprobs(b).logp, start)
    np.testing.assert_array_equal(tr.logprobs(b).logp, tr.logprobs(b, adapter=False).logp)
    tr.close()
    tr.close()


def test_fresh_adapter_leaves_model_unchanged(tiny):
    tr = Trainable(tiny("llama"), LoraSpec(4, 8.0), threads=THREADS)
    toks = np.random.default_rng(5).integers(0, 256, 16).astype(np.int32)
    b = native.Batch.next_token(toks)
    np.testing.assert_array_equal(tr.logprobs(b).logp, tr.logprobs(b, adapter=False).logp)


# ---- gradients -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", [slow_case("llama"), slow_case("qwen2"), "qwen3", slow_case("gemma3")])
def test_lora_gradients_match_finite_differences(tiny, arch):
    path = tiny(arch, n_layer=2, n_embd=32, n_head=4, n_head_kv=2, n_ff=48, n_vocab=270)
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_exact_ops(True)
    rng = np.random.default_rng(0)
    for t in tr.lora.tensors:
        tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.3)
    toks = rng.integers(0, 256, 20).astype(np.int32)
    batch = native.Batch.next_token(toks, np.array([0] * 12 + [1] * 8, np.int32))
    coeff = rng.standard_normal(batch.n_targets).astype(np.float32)
    worst = fd_check(tr, batch, coeff, tr.lora.tensors)
    assert worst < 1e-2, f"{arch}: worst relative gradient error {worst}"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_own_kernels_match_ggml_ops(tiny, smollm, arch):
    """outer.c's products (LoRA forward and gradients, attention's V P and gradients) against the same graph
    on ggml's own ops (exact_ops): log-probs and every gradient, on shapes that leave partial tiles
    (widths not multiples of 16, token counts not multiples of 4, grouped-query heads)."""
    path = smollm if arch == "llama" else tiny(arch, n_layer=2, n_embd=40, n_head=4, n_head_kv=2, n_ff=72,
                                                  n_vocab=270)
    toks = np.random.default_rng(0).integers(0, 256, 47).astype(np.int32)
    batch = native.Batch.next_token(toks, np.array([0] * 30 + [1] * 17, np.int32))
    coeff = np.random.default_rng(3).standard_normal(batch.n_targets).astype(np.float32)
    grads, logps = [], []
    # ggml's ops on dense scores (the reference), outer.c's on dense scores, outer.c's with tiled attention
    for exact, attention in ((True, "dense"), (False, "dense"), (False, "tiled")):
        tr = Trainable(path, LoraSpec(6, 12.0), threads=THREADS, seed=1)
        tr.engine.set_exact_ops(exact)
        tr.engine.set_attention(attention)
        tr.engine.set_matmul_mode("f32")   # F16 activations would turn last-bit differences into F16 steps
        for t in tr.lora.tensors:
            tr.lora.write(t.index, np.random.default_rng(t.index).standard_normal(t.shape).astype(np.float32) * 0.05)
        tr.engine.set_profiling(True)
        logps.append(tr.accumulate(batch, lambda inp: native.LossOutputs(coeff)))
        prof = tr.engine.profile()
        custom = {(p.phase, p.kind) for p in prof if p.op == "CUSTOM" and p.flops > 0}
        # the fast graph runs outer.c's ops where ggml's would be; the exact one none of them
        assert custom == (set() if exact else {("forward", "lora"), ("backward", "lora"), ("forward", "attention"),
                                               ("backward", "attention")})
        # both of attention's forward products (K^T Q and V P) leave ggml's MUL_MAT in the fast graph
        ggml_attention = {p.phase for p in prof if p.op == "MUL_MAT" and p.kind == "attention"}
        assert ("forward" in ggml_attention) == exact
        grads.append({t.name: tr.lora.read(t.index, native.SLOT_GRAD) for t in tr.lora.tensors})
        tr.close()
    for k in (1, 2):
        np.testing.assert_allclose(logps[k], logps[0], atol=2e-3)      # float32 sums in another order, 30 layers
        for name, g in grads[0].items():
            err = np.linalg.norm(grads[k][name] - g) / max(np.linalg.norm(g), 1e-12)
            assert err < 1e-3, f"{arch} {name}: relative difference {err:.2e} between outer.c and ggml's ops"


def test_loss_head_with_several_targets_per_row(tiny):
    """The head's sparse part: several (and repeated) token ids per row, as distillation uses."""
    tr = Trainable(tiny("llama", n_embd=32, n_ff=48), LoraSpec(4, 8.0), threads=THREADS)
    rng = np.random.default_rng(1)
    for t in tr.lora.tensors:
        tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.3)
    toks = rng.integers(0, 256, 10).astype(np.int32)
    rows = np.repeat(np.arange(9), 4).astype(np.int32)
    ids = rng.integers(0, 260, len(rows)).astype(np.int32)
    ids[1] = ids[0]                                        # a repeated (row, id) pair
    batch = native.Batch(toks, np.arange(10), np.zeros(10), rows, ids)
    coeff = rng.standard_normal(len(rows)).astype(np.float32)
    worst = fd_check(tr, batch, coeff, [t for t in tr.lora.tensors if "blk.1" in t.name])
    assert worst < 1e-2


def test_gradients_on_one_layer_of_the_real_model(smollm):
    tr = Trainable(smollm, LoraSpec(4, 8.0, ("q", "v", "down")), threads=THREADS)
    tr.engine.set_matmul_mode("f32")       # no rounded activations: the forward is smooth
    rng = np.random.default_rng(0)
    for t in tr.lora.tensors:
        if t.name.startswith("blk.0."):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.05)
    toks = np.array([1, 504, 3458, 314, 1345, 30, 282, 216, 4017, 28, 330, 2012], np.int32)
    batch = native.Batch.next_token(toks)
    coeff = -np.ones(batch.n_targets, np.float32)
    worst = fd_check(tr, batch, coeff, [t for t in tr.lora.tensors if t.name.startswith("blk.0.")], n_entries=3, h=4e-2)
    assert worst < 1e-2


def test_adamw_step_and_clipping(tiny):
    tr = Trainable(tiny("llama"), LoraSpec(4, 8.0), threads=THREADS)
    toks = np.random.default_rng(0).integers(0, 256, 16).astype(np.int32)
    batch = native.Batch.next_token(toks)
    before = tr.lora.state()
    tr.accumulate(batch, lambda inp: native.LossOutputs(-np.ones(len(inp.logp), np.float32)))
    g = {t.name: tr.lora.read(t.index, native.SLOT_GRAD) for t in tr.lora.tensors}
    norm = np.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g.values()))
    reported = tr.optimizer_step(lr=1e-2, step=1, grad_clip=norm / 2)
    assert abs(reported - norm) / norm < 1e-4
    after = tr.lora.state()
    # first AdamW step moves each parameter by lr * sign(grad) (bias-corrected m/sqrt(v) = +-1)
    for name, x in g.items():
        moved = after[name] - before[name]
        nz = np.abs(x) > 1e-6
        np.testing.assert_allclose(moved[nz], -1e-2 * np.sign(x[nz]), rtol=1e-3, atol=1e-6)
    assert all(not tr.lora.read(t.index, native.SLOT_GRAD).any() for t in tr.lora.tensors)


def test_unsupported_architecture_is_named(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(native.NativeError, match="architecture 'gpt2' is not supported; supported: llama"):
        native.Model(tmp_path / "gpt2.gguf", "cpu", 1)


def test_gpu_device_fails_clearly_without_one():
    if any(d.kind in ("gpu", "igpu") for d in native.devices()):
        pytest.skip("this machine has a GPU")
    with pytest.raises(native.NativeError, match="no GPU device"):
        native.select_device("gpu")


def test_training_step_memory(smollm, tmp_path):
    """One step on 4 x 256 tokens keeps the peak RSS under 1.5 GB (measured in a fresh process)."""
    script = f"""
import json, numpy as np
from retrograd.engine import Trainable, LoraSpec
from retrograd import native
tr = Trainable({str(smollm)!r}, LoraSpec(16, 32.0), threads={THREADS})
rng = np.random.default_rng(0)
for s in range(4):
    toks = rng.integers(0, 49152, 256).astype(np.int32)
    tr.accumulate(native.Batch.next_token(toks), lambda inp: native.LossOutputs(-np.ones(len(inp.logp), np.float32) / 1020))
tr.optimizer_step(lr=1e-4, step=1)
from retrograd.memory import peak_rss_mib   # this process's own peak, not the forking parent's
print(json.dumps({{"rss_mb": peak_rss_mib()}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RETRO_THREADS": str(THREADS)})
    assert out.returncode == 0, out.stderr
    rss = json.loads(out.stdout.strip().splitlines()[-1])["rss_mb"]
    assert rss < 1500, f"peak RSS {rss:.0f} MiB"


def test_non_finite_loss_is_refused_and_leaves_the_adapter(tiny):
    tr = Trainable(tiny("llama"), LoraSpec(4, 8.0), threads=THREADS)
    before = tr.lora.state()
    batch = native.Batch.next_token(np.arange(10, dtype=np.int32))
    with pytest.raises(native.NativeError, match="non-finite loss coefficient") as exc:
        tr.accumulate(batch, lambda inp: native.LossOutputs(np.full(len(inp.logp), np.nan, np.float32)))
    assert exc.value.kind == "non-finite value"
    tr.lora.zero(native.SLOT_GRAD)
    after = tr.lora.state()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_missing_default_model_says_how_to_fetch(tmp_path):
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "inspect"], capture_output=True, text=True,
                         env={**os.environ, "RETROGRAD_CACHE": str(tmp_path)})
    assert out.returncode == 1 and "retrograd models fetch" in out.stderr and "Traceback" not in out.stderr


def test_hidden_state_gradient_reaches_the_adapter(tiny):
    """A loss on the final hidden states (a value head) backpropagates into the LoRA tensors."""
    tr = Trainable(tiny("llama", n_embd=32, n_ff=48), LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_exact_ops(True)
    rng = np.random.default_rng(2)
    for t in tr.lora.tensors:
        tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.3)
    toks = rng.integers(0, 256, 12).astype(np.int32)
    batch = native.Batch.next_token(toks)
    u = rng.standard_normal(32)

    def value_loss():
        h = tr.logprobs(batch, hidden=True).hidden.astype(np.float64)
        return float((h @ u).sum())

    def fn(inp):
        g = np.tile(u.astype(np.float32), (inp.hidden.shape[0], 1))
        return native.LossOutputs(np.zeros(len(inp.logp), np.float32), g)

    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(batch, fn, hidden=True)
    t = tr.lora.index["blk.1.attn_v.weight.lora_b"]
    g = tr.lora.read(t.index, native.SLOT_GRAD).ravel()
    w = tr.lora.read(t.index)
    for i in np.argsort(-np.abs(g))[:3]:
        x = w.copy().ravel()
        x[i] += 5e-3
        tr.lora.write(t.index, x.reshape(w.shape))
        up = value_loss()
        x[i] -= 1e-2
        tr.lora.write(t.index, x.reshape(w.shape))
        down = value_loss()
        tr.lora.write(t.index, w)
        assert (up - down) / 1e-2 == pytest.approx(g[i], rel=2e-2)


def test_shared_prefix_equals_separate_sequences(tiny):
    """A prompt stored once with several continuations gives each continuation the log-probs it
    gets as a sequence of its own, and the same gradient."""
    from retrograd.data.batching import Group, group_batch

    tr = Trainable(tiny("qwen2"), LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_matmul_mode("f32")      # no F16 rounding in the head: compare the math, not the rounding
    rng = np.random.default_rng(4)
    for t in tr.lora.tensors:
        tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.2)
    prompt = rng.integers(0, 256, 7).astype(np.int32)
    comps = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 5, 1)]
    shared, owner = group_batch([Group(prompt, comps)])
    separate = [native.Batch.next_token(np.concatenate([prompt, c])) for c in comps]
    lp_shared = tr.logprobs(shared).logp
    lp_sep = np.concatenate([tr.logprobs(b).logp[len(prompt) - 1:] for b in separate])
    np.testing.assert_allclose(lp_shared, lp_sep, atol=2e-5)
    coeff = rng.standard_normal(len(lp_shared)).astype(np.float32)
    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(shared, lambda inp: native.LossOutputs(coeff))
    g_shared = tr.lora.state(native.SLOT_GRAD)
    tr.lora.zero(native.SLOT_GRAD)
    start = 0
    for b, c in zip(separate, comps):
        k = np.zeros(b.n_targets, np.float32)
        k[len(prompt) - 1:] = coeff[start:start + len(c)]
        start += len(c)
        tr.accumulate(b, lambda inp, k=k: native.LossOutputs(k))
    g_sep = tr.lora.state(native.SLOT_GRAD)
    for name in g_sep:
        scale = np.abs(g_sep[name]).max()
        assert np.abs(g_shared[name] - g_sep[name]).max() < 1e-4 * scale, name


def test_rslora_scales_by_sqrt_rank_and_exports_the_effective_alpha(tiny, tmp_path):
    """rsLoRA is LoRA scaled by alpha / sqrt(rank): the same graph as standard LoRA with alpha * sqrt(rank),
    which is the alpha the exported adapter carries (so llama.cpp, scaling by alpha / rank, agrees)."""
    path = tiny("llama", n_layer=2, n_embd=32, n_head=4, n_head_kv=2, n_ff=48, n_vocab=270)
    rs = Trainable(path, LoraSpec(4, 8.0, scaling="rslora"), threads=THREADS)
    std = Trainable(path, LoraSpec(4, 16.0), threads=THREADS)
    rs.engine.set_exact_ops(True)
    std.engine.set_exact_ops(True)
    rng = np.random.default_rng(5)
    for t in rs.lora.tensors:
        w = rng.standard_normal(t.shape).astype(np.float32) * 0.2     # twice the scale of the other FD tests
        rs.lora.write(t.index, w)
        std.lora.write(t.index, w)
    toks = rng.integers(0, 256, 20).astype(np.int32)
    batch = native.Batch.next_token(toks)
    assert np.array_equal(rs.logprobs(batch).logp, std.logprobs(batch).logp)
    assert not np.allclose(rs.logprobs(batch).logp, Trainable(path, LoraSpec(4, 8.0), threads=THREADS).logprobs(batch).logp)
    coeff = rng.standard_normal(batch.n_targets).astype(np.float32)
    assert fd_check(rs, batch, coeff, rs.lora.tensors) < 1e-2
    rs.save_adapter(tmp_path / "rs.gguf")
    import gguf
    assert gguf.GGUFReader(str(tmp_path / "rs.gguf")).fields["adapter.lora.alpha"].contents() == 16.0
    back = Trainable(path, LoraSpec(4, 8.0, scaling="rslora"), threads=THREADS)
    back.load_adapter(tmp_path / "rs.gguf")
    back.engine.set_exact_ops(True)     # the same kernels as rs: only the adapter's round trip may differ
    assert np.array_equal(back.logprobs(batch).logp, rs.logprobs(batch).logp)
    with pytest.raises(Exception, match="rsLoRA"):
        Trainable(path, LoraSpec(4, 16.0, scaling="rslora"), threads=THREADS).load_adapter(tmp_path / "rs.gguf")


def test_lora_plus_gives_b_its_own_learning_rate(tiny):
    """LoRA+ against AdamW written out in numpy over two steps: A learns at lr, B at lr * ratio."""
    tr = Trainable(tiny("llama"), LoraSpec(4, 8.0), threads=THREADS)
    randomize_adapter(tr, 3, scale=0.2)             # non-zero A and B: both get gradients
    rng = np.random.default_rng(1)
    lr, ratio, b1, b2, eps, wd = 1e-2, 4.0, 0.9, 0.999, 1e-8, 0.01
    p = {k: v.astype(np.float64) for k, v in tr.lora.state().items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for step in (1, 2):
        batch = native.Batch.next_token(rng.integers(0, 256, 16).astype(np.int32))
        tr.accumulate(batch, lambda inp: native.LossOutputs(-np.ones(len(inp.logp), np.float32)))
        g = {t.name: tr.lora.read(t.index, native.SLOT_GRAD).astype(np.float64) for t in tr.lora.tensors}
        tr.optimizer_step(lr=lr, step=step, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, lr_b_ratio=ratio)
        for k in p:
            rate = lr * ratio if k.endswith("lora_b") else lr
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mh, vh = m[k] / (1 - b1 ** step), v[k] / (1 - b2 ** step)
            p[k] = p[k] * (1 - rate * wd) - rate * mh / (np.sqrt(vh) + eps)
        for k, x in tr.lora.state().items():
            np.testing.assert_allclose(x, p[k], rtol=1e-4, atol=1e-6, err_msg=f"{k} at step {step}")


@pytest.mark.slow          # finite differences over every adapter tensor of gemma3
def test_embedding_noise_is_a_constant_input_with_exact_gradients(tiny):
    """NEFTune's noise enters the graph as an input added to the looked-up embeddings: zero noise is the
    plain model bit for bit, other noise changes the log-probs, and the adapter's gradient with a fixed
    noise matches finite differences."""
    path = tiny("gemma3", n_layer=2, n_embd=32, n_head=4, n_head_kv=2, n_ff=48, n_vocab=270)   # scaled embeddings
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_exact_ops(True)
    rng = np.random.default_rng(7)
    randomize_adapter(tr, rng)
    toks = rng.integers(0, 256, 19).astype(np.int32)           # not a multiple of the padding: padded rows too
    plain = native.Batch.next_token(toks)
    zero = native.Batch.next_token(toks)
    zero.embed_noise = np.zeros((len(toks), 32), np.float32)
    noisy = native.Batch.next_token(toks)
    noisy.embed_noise = rng.uniform(-0.5, 0.5, (len(toks), 32)).astype(np.float32)
    assert np.array_equal(tr.logprobs(zero).logp, tr.logprobs(plain).logp)
    assert not np.allclose(tr.logprobs(noisy).logp, tr.logprobs(plain).logp)
    coeff = rng.standard_normal(noisy.n_targets).astype(np.float32)
    assert fd_check(tr, noisy, coeff, tr.lora.tensors) < 1e-2
    bad = native.Batch.next_token(toks)
    bad.embed_noise = np.zeros((len(toks), 31), np.float32)
    with pytest.raises(ValueError, match="embed_noise has shape"):
        tr.logprobs(bad)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lora_dropout_masks_equal_the_numpy_twin(tiny, arch):
    """LoRA dropout: the engine's log-probs with masks drawn in the graph equal the float64 reference
    with the numpy twin's masks; the same seed draws the same masks, another seed others, p = 0 is
    the plain model bit for bit, and the base path never sees the masks."""
    path = tiny(arch, n_layer=2)
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_exact_ops(True)
    randomize_adapter(tr, 5)
    ref = RefModel.load(str(path))
    toks = np.random.default_rng(3).integers(0, 256, 13).astype(np.int32)     # padded to 16 rows inside
    p, seed = 0.3, (7 << 40) + 12345                                            # both halves of the seed used

    def batch(p: float, seed: int) -> native.Batch:
        b = native.Batch.next_token(toks)
        b.lora_dropout, b.dropout_seed = p, seed
        return b

    ours = tr.logprobs(batch(p, seed)).logp
    ref.set_lora(tr.lora.state(), tr.lora.scale, dropout=(p, seed))
    # float32 against float64: 1e-4 absolute, and 2e-5 relative for log-probs as low as -14 (AVX2's sums)
    np.testing.assert_allclose(ours, ref.logprobs(toks), atol=1e-4, rtol=2e-5)
    ref.set_lora(tr.lora.state(), tr.lora.scale)
    plain = tr.logprobs(native.Batch.next_token(toks)).logp
    np.testing.assert_allclose(plain, ref.logprobs(toks), atol=1e-4, rtol=2e-5)
    assert np.abs(ours - plain).max() > 1e-3
    assert np.array_equal(tr.logprobs(batch(p, seed)).logp, ours)
    assert not np.allclose(tr.logprobs(batch(p, seed + 1)).logp, ours)
    assert np.array_equal(tr.logprobs(batch(0.0, seed)).logp, plain)
    base = tr.logprobs(native.Batch.next_token(toks), adapter=False).logp
    assert np.array_equal(tr.logprobs(batch(p, seed), adapter=False).logp, base)
    mask = dropout_mask(seed, p, 1, 6, 256, 64)
    assert abs((mask == 0).mean() - p) < 0.01 and set(np.unique(mask)) == {0.0, np.float32(1 / 0.7)}
    with pytest.raises(native.NativeError, match=r"dropout must be in \[0, 1\)"):
        tr.logprobs(batch(1.0, seed))


@pytest.mark.slow          # finite differences, once per dropout mask
@pytest.mark.parametrize("exact", [True, False])
def test_lora_dropout_gradients_match_finite_differences(tiny, exact):
    """With a fixed mask (a fixed seed), the adapter's gradient through dropout matches central
    differences: ggml's own ops, and the rewritten graph with retrograd's kernels."""
    path = tiny("llama", n_layer=2, n_embd=32, n_head=4, n_head_kv=2, n_ff=48, n_vocab=270)
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_exact_ops(exact)
    randomize_adapter(tr, 11)
    toks = np.random.default_rng(4).integers(0, 256, 21).astype(np.int32)
    b = native.Batch.next_token(toks)
    b.lora_dropout, b.dropout_seed = 0.25, 99
    coeff = np.random.default_rng(5).standard_normal(b.n_targets).astype(np.float32)
    # the 1 / (1 - p) scale sharpens the curvature: the default step (1e-2) leaves up to 8% of
    # Richardson error on the steepest entries, 2e-3 converges (-75.99 analytic, -75.99 at 2e-3)
    assert fd_check(tr, b, coeff, tr.lora.tensors, h=2e-3) < 1e-2


def test_adapter_trained_with_dropout_lora_plus_and_rslora_scores_the_same_in_llama_cpp(smollm, tmp_path):
    """The training-only variants leave nothing in the exported adapter but its weights and (rsLoRA)
    its effective alpha: llama.cpp, loading the file, scores as our graph does without dropout."""
    tr = Trainable(smollm, LoraSpec(8, 16.0, scaling="rslora"), threads=THREADS, seed=1)
    tr.engine.set_matmul_mode("native")
    llm = llama(smollm)
    toks = np.array((llm.tokenize(TEXT.encode(), add_bos=True) * 3)[:128], np.int32)
    del llm
    for step in range(1, 4):
        b = native.Batch.next_token(toks)
        b.lora_dropout, b.dropout_seed = 0.1, step
        tr.lora.zero(native.SLOT_GRAD)
        tr.accumulate(b, lambda inp: native.LossOutputs(np.full(len(inp.logp), -1.0 / len(inp.logp), np.float32)))
        tr.optimizer_step(lr=5e-3, step=step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_clip=1.0,
                          lr_b_ratio=16.0)
    tr.save_adapter(tmp_path / "a.gguf")
    ours = tr.logprobs(native.Batch.next_token(toks)).logp
    base = tr.logprobs(native.Batch.next_token(toks), adapter=False).logp
    llm = llama(smollm, tmp_path / "a.gguf")
    theirs = next_token_logprobs(llm, toks.tolist())
    assert np.abs(ours - base).mean() > 0.01, "three steps should move the log-probs"
    assert np.abs(ours - theirs).mean() < 0.01


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_activation_checkpointing_gives_the_same_gradients(tiny, arch):
    """Recomputing each layer in the backward (set_recompute) gives the one-graph path's log-probs and
    adapter gradients, up to the order of float sums: with dropout masks and embedding noise (both
    drawn again in the recomputation) and with a loss on the hidden states (PPO's value head)."""
    path = tiny(arch, n_layer=3, n_embd=32, n_head=4, n_head_kv=2, n_ff=48, n_vocab=270)
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    randomize_adapter(tr, 21)
    rng = np.random.default_rng(8)
    toks = rng.integers(0, 256, 45).astype(np.int32)
    b = native.Batch.next_token(toks, np.array([0] * 20 + [1] * 25, np.int32))
    b.lora_dropout, b.dropout_seed = 0.2, 5
    b.embed_noise = rng.uniform(-0.1, 0.1, (len(toks), 32)).astype(np.float32)
    coeff = rng.standard_normal(b.n_targets).astype(np.float32)
    u = rng.standard_normal(32).astype(np.float32)

    def run(recompute: bool):
        tr.engine.set_recompute(recompute)
        tr.lora.zero(native.SLOT_GRAD)
        seen = {}

        def fn(inp):
            seen["logp"] = inp.logp.copy()
            return native.LossOutputs(coeff, np.tile(u, (len(inp.hidden), 1)))

        tr.accumulate(b, fn, hidden=True)
        return seen["logp"], [tr.lora.read(t.index, native.SLOT_GRAD) for t in tr.lora.tensors]

    lp1, g1 = run(False)
    lp2, g2 = run(True)
    np.testing.assert_array_equal(lp1, lp2)          # the first pass is the training graph's forward
    scale = max(float(np.abs(g).max()) for g in g1)
    for t, a, c in zip(tr.lora.tensors, g1, g2):
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-5 * scale, err_msg=t.name)


def test_preflight_names_the_f32_route_as_a_slow_path(tiny):
    """The CPU build's default route has no slow path; the F32 matmul mode dequantizes every
    quantized base weight the gradient passes through, and preflight says so with the reason."""
    m = native.Model(tiny("llama", qtype="Q8_0"), threads=THREADS)
    e = native.Engine(m)
    lora = native.Lora(m, ["q", "v"], 4, 8.0)
    try:
        assert e.preflight(lora, 32) == {} and e.slow_paths() == []
        e.set_matmul_mode("f32")
        assert e.preflight(lora, 32) == {}
        slow = {what: (n, why) for what, n, why in e.slow_paths()}
        n, why = slow["base weight -> F32 transposed copy"]
        assert n >= 2 * 7 and "every micro-batch" in why      # 2 layers x 7 projections at least
        e.preflight(None, 32)                                  # the forward graph: no backward
        assert "base weight -> F32 transposed copy" in {w for w, _, _ in e.slow_paths()}
    finally:
        lora.close()
        e.close()
        m.close()
