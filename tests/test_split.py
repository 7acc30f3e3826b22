"""The generator's split weights (retrograd/generation/split.py): a Q4_1 model's block weights as
Q4_0 plus an adapter of their offsets, which together are the file's own weights, and what "auto"
picks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS

from retrograd import native
from retrograd.engine import LoraSpec, Trainable
from retrograd.errors import RetrogradError
from retrograd.generation import split
from retrograd.generation.llama import GenerationError, Generator
from retrograd.generation.weights import generator_model, resolve


def _tensors(path):
    import gguf

    r = gguf.GGUFReader(str(path))
    return r, {t.name: t for t in r.tensors}


def test_the_split_copy_and_its_offsets_are_the_q4_1_weights(tiny, tmp_path):
    src = tiny("llama", n_layer=2, qtype="Q4_1", n_ff=96)
    out = tmp_path / "m.split.gguf"
    split.write_split(src, out)
    r_src, before = _tensors(src)
    r_out, after = _tensors(out)
    _, offs = _tensors(split.offsets_path(out))
    assert r_out.fields[split.OFFSETS_KEY].contents() == split.offsets_path(out).name
    names = split.split_names(r_src)
    assert len(names) == 2 * 7
    for name, t in before.items():
        if name not in names:       # embeddings, norms: byte for byte
            assert after[name].tensor_type == t.tensor_type and bytes(after[name].data) == bytes(t.data), name
            continue
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        assert int(after[name].tensor_type) == 2                                  # Q4_0
        want = native.dequantize_rows(3, np.asarray(t.data), n_out, n_in)        # Q4_1, as the trainer reads it
        q4_0 = native.dequantize_rows(2, np.asarray(after[name].data), n_out, n_in)
        a = np.asarray(offs[name + ".lora_a"].data, np.float32).reshape(-1, n_in)          # [r, n_in]
        b = np.asarray(offs[name + ".lora_b"].data, np.float32).reshape(n_out, -1)         # [n_out, r]
        assert a.shape[0] % 16 == 0 and a.shape[0] >= n_in // 32
        np.testing.assert_allclose(q4_0 + b @ a, want, rtol=0, atol=1e-6 * np.abs(want).max())
        assert np.abs(q4_0 - want).max() > 0.01          # the offsets are needed: Q4_0 alone is not it


def _next_token_logprobs(gen: Generator, toks: list[int]) -> np.ndarray:
    import llama_cpp.llama_cpp as lc

    lc.llama_memory_seq_rm(gen._mem, -1, -1, -1)
    gen._cache = []
    gen._decode(toks, range(len(toks)), [0] * len(toks), [True] * len(toks))
    x = gen._step_logits(len(toks)).astype(np.float64)
    x -= x.max(1, keepdims=True)
    x -= np.log(np.exp(x).sum(1, keepdims=True))
    return x[np.arange(len(toks) - 1), toks[1:]]


def _compare(model, tmp_path, monkeypatch) -> tuple[float, float, float]:
    """Mean |log-prob difference| to the trainer of the file's own generator, the split one, and
    the split copy without its offsets; the adapter a trained one (non-zero B)."""
    monkeypatch.setenv("RETROGRAD_CACHE", str(tmp_path / "cache"))
    tr = Trainable(model, LoraSpec(8, 16.0), threads=THREADS)
    rng = np.random.default_rng(0)
    for t in tr.lora.tensors:
        if t.name.endswith("lora_b"):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.02)
    own = Generator(model, n_ctx=256, threads=THREADS)
    copy = generator_model(model, "auto", THREADS)
    assert copy.name.endswith(".split.gguf")
    cut = Generator(copy, n_ctx=256, threads=THREADS)
    toks = own.tokenizer.encode("The quick brown fox jumps over the lazy dog; " * 6)[:200]
    ours = tr.logprobs(native.Batch.next_token(np.array(toks, np.int32))).logp
    own.set_adapter(tr.adapter_bytes())
    cut.set_adapter(tr.adapter_bytes())
    gaps = [np.abs(_next_token_logprobs(own, toks) - ours).mean(), np.abs(_next_token_logprobs(cut, toks) - ours).mean()]
    cut._joint = None                   # the Q4_0 weights alone, under the same adapter
    cut.set_adapter(tr.adapter_bytes())
    gaps.append(np.abs(_next_token_logprobs(cut, toks) - ours).mean())
    return tuple(float(g) for g in gaps)


def test_the_split_generator_scores_as_the_files_own_does(tiny, tmp_path, monkeypatch):
    own, cut, bare = _compare(tiny("llama", n_layer=2, qtype="Q4_1", n_ff=96), tmp_path, monkeypatch)
    assert cut < 1.5 * own + 0.005, (own, cut)
    assert bare > 5 * cut, (bare, cut)


def test_the_split_generator_scores_smollm_as_the_files_own_does(smollm, tmp_path, monkeypatch):
    """On the default model the two differ by how their products round the activations (the file's
    own kernels round each block's sum of inputs too): as close to the trainer either way."""
    own, cut, bare = _compare(smollm, tmp_path, monkeypatch)
    assert cut < 1.5 * own, (own, cut)
    assert bare > 1.0, bare


def test_a_split_copy_without_its_offsets_is_refused(tiny, tmp_path):
    out = tmp_path / "m.split.gguf"
    split.write_split(tiny("llama", n_layer=1, qtype="Q4_1"), out)
    split.offsets_path(out).unlink()
    with pytest.raises(GenerationError, match="offsets adapter"):
        Generator(out, n_ctx=64, threads=THREADS)


def test_auto_splits_small_q4_1_models_on_the_cpu(tiny, monkeypatch):
    from retrograd.generation import weights

    q41, f32 = tiny("llama", n_layer=1, qtype="Q4_1"), tiny("llama", n_layer=1)
    assert resolve(q41, "auto") == "split"
    assert resolve(f32, "auto") == "native"
    assert resolve(q41, "auto", on_cpu=False) == "native"
    assert resolve(q41, "auto", dora=True) == "native"       # the generator loads a merged model then
    monkeypatch.setattr(weights, "AUTO_SPLIT_MAX", q41.stat().st_size - 1)
    assert resolve(q41, "auto") == "native"                  # a large model: the memory of its offsets
    monkeypatch.undo()
    assert resolve(q41, "bf16") == "bf16"
    with pytest.raises(RetrogradError, match="DoRA"):
        resolve(q41, "split", dora=True)
    with pytest.raises(RetrogradError, match="no Q4_1 block weights"):
        split.write_split(f32, f32.with_name("x.split.gguf"))


def test_adapter_bytes_parse_back_in_place():
    from retrograd import adapter as adapter_io

    rng = np.random.default_rng(0)
    tensors = {"blk.0.attn_q.weight.lora_a": rng.standard_normal((4, 64)).astype(np.float32),
               "blk.0.attn_q.weight.lora_b": rng.standard_normal((64, 4)).astype(np.float32),
               "blk.0.ffn_up.weight.lora_a": rng.standard_normal((4, 64)).astype(np.float16)}
    data = adapter_io.to_bytes("llama", 8.0, tensors)
    f = adapter_io.parse(data)
    assert (f.arch, f.alpha, f.rank, f.kind) == ("llama", 8.0, 4, "lora")
    for name, a in tensors.items():
        assert f.tensors[name].dtype == a.dtype and np.array_equal(f.tensors[name], a)
        assert f.tensors[name].base is not None          # a view of the bytes, not a copy


def _q8_0_adapter(tr: Trainable) -> bytes:
    """The training adapter as the joint one holds it: A, and B times alpha / r, in Q8_0, the rank
    padded to 32; alpha 0, so that llama.cpp scales it by 1."""
    from retrograd import adapter as adapter_io
    from retrograd.generation import joint

    state, r = tr.lora.state(), tr.spec.rank
    r0, s = -(-r // 32) * 32, tr.spec.effective_alpha / r
    infos, blobs = [], []
    for w in dict.fromkeys(n.rsplit(".", 1)[0] for n in state):
        a, b = state[w + ".lora_a"], state[w + ".lora_b"]
        pa, pb = np.zeros((r0, a.shape[1]), np.float32), np.zeros((b.shape[0], r0), np.float32)
        pa[:r], pb[:, :r] = a, b * s
        infos += [(w + ".lora_a", pa.shape, adapter_io.GGML_Q8_0), (w + ".lora_b", pb.shape, adapter_io.GGML_Q8_0)]
        blobs += [joint.q8_0(pa).tobytes(), joint.q8_0(pb).tobytes()]
    head, offsets = adapter_io.header(tr.info.arch, 0.0, infos)
    out = bytearray(head)
    for off, blob in zip(offsets, blobs):
        out += b"\0" * (len(head) + off - len(out)) + blob
    return bytes(out)


def test_q8_0_blocks_are_what_ggml_makes(tiny):
    """joint.q8_0 gives the bytes ggml's own quantizer gives (through gguf-py's copy of it)."""
    import gguf

    from retrograd.generation import joint

    x = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    x[1] = 0.0
    x[2, :32] = np.linspace(-1, 1, 32)
    assert joint.q8_0(x).tobytes() == gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).tobytes()
    ones = np.frombuffer(joint._ONES.tobytes(), np.uint8)
    assert np.array_equal(gguf.quants.dequantize(ones, gguf.GGMLQuantizationType.Q8_0), np.ones(32))


def test_the_joint_adapter_is_the_offsets_and_the_training_adapter(tiny, tmp_path):
    """One adapter (joint.py) computes what the two would: the offsets and the training adapter each
    held as the joint one holds them (Q8_0, the training part padded to 32 columns, so that the two
    round the activations in the same blocks). A swap leaves no reference to the adapter's bytes."""
    import ctypes
    import sys

    import llama_cpp.llama_cpp as lc

    model = tiny("llama", n_layer=2, qtype="Q4_1", n_ff=96)
    copy = tmp_path / "m.split.gguf"
    split.write_split(model, copy)
    tr = Trainable(model, LoraSpec(8, 16.0), threads=THREADS)
    rng = np.random.default_rng(1)
    for t in tr.lora.tensors:
        if t.name.endswith("lora_b"):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.05)
    data = tr.adapter_bytes()
    joint = Generator(copy, n_ctx=256, threads=THREADS)
    refs = sys.getrefcount(data)
    joint.set_adapter(data)
    assert sys.getrefcount(data) == refs and joint.has_adapter
    two = Generator(copy, n_ctx=256, threads=THREADS)
    two._joint = None
    offsets = two._adapter                              # the offsets alone, loaded when the copy opened
    two._adapter = None
    two.set_adapter(_q8_0_adapter(tr))
    pair = (lc.llama_adapter_lora_p_ctypes * 2)(offsets, two._adapter)
    assert lc.llama_set_adapters_lora(two._ctx, pair, 2, (ctypes.c_float * 2)(1.0, 1.0)) == 0
    toks = joint.tokenizer.encode("The quick brown fox jumps over the lazy dog; " * 4)[:120]
    a, b = _next_token_logprobs(joint, toks), _next_token_logprobs(two, toks)
    joint.set_adapter(None)
    assert not joint.has_adapter
    c = _next_token_logprobs(joint, toks)
    # equal but for the order of float sums, which this random model's large logits amplify; the
    # training adapter's own effect is far larger
    gap, effect = np.abs(a - b).mean(), np.abs(c - a).mean()
    # (0.0 on Zen 4; 0.013 against an effect of 1.66 on an AVX2-only EPYC, where llama.cpp's kernels
    # for the two shapes sum in different orders)
    assert gap < effect / 50 and effect > 0.5, (gap, effect)


def test_a_rejected_adapter_leaves_the_split_generator_with_its_offsets(tiny, tmp_path):
    from retrograd import adapter as adapter_io

    model = tiny("llama", n_layer=2, qtype="Q4_1", n_ff=96)
    copy = tmp_path / "m.split.gguf"
    split.write_split(model, copy)
    gen = Generator(copy, n_ctx=128, threads=THREADS)
    toks = gen.tokenizer.encode("The quick brown fox jumps over the lazy dog; " * 2)[:60]
    before = _next_token_logprobs(gen, toks)
    wrong = adapter_io.to_bytes("llama", 8.0, {"blk.0.attn_q.weight.lora_a": np.ones((4, 32), np.float32),
                                                "blk.0.attn_q.weight.lora_b": np.ones((64, 4), np.float32)})
    with pytest.raises(GenerationError):
        gen.set_adapter(wrong)
    assert not gen.has_adapter
    np.testing.assert_allclose(_next_token_logprobs(gen, toks), before, atol=1e-5)
