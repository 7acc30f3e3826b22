"""`retrograd export`: the merged GGUF loads in llama.cpp and computes what base + adapter computes
(LoRA through llama.cpp's adapter, DoRA and rsLoRA through retrograd's engine), per --type within
the stated tolerances (docs/export.md); the Ollama Modelfile; the one-line refusals."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from llama_ref import llama, next_token_logprobs
from test_trainer import make_run

from retrograd import native
from retrograd.commands.export import PPL_TOKENS, eval_examples
from retrograd.config import load
from retrograd.context import open_model
from retrograd.engine import LoraSpec, Trainable
from retrograd.eval.llama_ppl import score, take_tokens
from retrograd.generation.modelfile import translate
from retrograd.trainer import train

#: per --type on SmolLM2-135M Q4_1 with the slow test's random adapter (rank 8, size 0.06: it moves the
#: log-probs by 0.95 nats a token on average and changes 14 of the 42 next-token choices): (mean |delta
#: log-prob| at most, top-1 agreement at least) against base + adapter in llama.cpp. Measured
#: 2026-12-07 (llama.cpp of llama-cpp-python 0.3.36, 2 threads; deterministic for a build):
#:   f16 0.074 / 0.929, q8_0 0.084 / 0.929, q6_k 0.152 / 0.929, q5_k_m 0.351 / 0.881, q4_k_m 0.275 / 0.810,
#:   same 0.635 / 0.810.
#: The bounds are those plus ~30% on |delta| (3 percentage points on top-1). The same export with the
#: alpha / rank scale left out (half the update) measured 0.542, 0.555, 0.517, 0.564, 0.645 and 0.728:
#: above every bound but `same`'s, which is looser than that because re-quantizing to the base's 4-bit
#: grid snaps much of any update back (it still fails a lost adapter, 0.95); the same merge with a
#: wrong scale fails test_same_keeps_every_type_and_matches_llama_cpps_adapter (Q8_0) and the f16 tests.
TOLERANCE = {"f16": (0.10, 0.90), "q8_0": (0.11, 0.90), "q6_k": (0.20, 0.90), "q5_k_m": (0.45, 0.85),
             "q4_k_m": (0.36, 0.78), "same": (0.83, 0.78)}


def adapter(model: Path, out: Path, *, seed: int = 0, variant: str = "lora", scaling: str = "standard",
            rank: int = 4, size: float = 0.05) -> Trainable:
    """A Trainable with a random adapter (A and B random, so it changes the model), saved to `out`."""
    tr = Trainable(model, LoraSpec(rank, 2.0 * rank, variant=variant, scaling=scaling), threads=THREADS)
    rng = np.random.default_rng(seed)
    for t in tr.lora.tensors:
        if not t.name.endswith(".dora_m"):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * size)
    if variant == "dora":
        tr.lora.reset_magnitude()
        for t in tr.lora.tensors:
            if t.name.endswith(".dora_m"):
                m = tr.lora.read(t.index)
                tr.lora.write(t.index, m * rng.uniform(0.8, 1.2, m.shape).astype(np.float32))
    tr.save_adapter(out)
    return tr


def export(tmp_path: Path, model: Path, *args: str, cfg: Path | None = None) -> subprocess.CompletedProcess:
    cfg = cfg or tmp_path / "export.toml"
    if not cfg.exists():
        cfg.write_text(f'[model]\npath = "{model}"\nctx = 256\n')
    return subprocess.run([sys.executable, "-m", "retrograd.cli", "export", str(cfg), *args], capture_output=True,
                          text=True, env={**os.environ, "RETRO_THREADS": str(THREADS)}, timeout=900)


def tokens(n: int = 48, seed: int = 3, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


@pytest.mark.parametrize("variant,scaling", [("lora", "standard"), ("lora", "rslora"), ("dora", "standard")])
def test_f16_export_computes_what_the_engine_computes_with_the_adapter(tiny, tmp_path, variant, scaling):
    """The engine applies the adapter itself (rsLoRA's alpha / sqrt(r), DoRA's magnitudes): the exported
    F16 file in llama.cpp gives the same log-probs, so the merge carried the scale and the magnitudes."""
    model = tiny("llama")
    tr = adapter(model, tmp_path / "a.gguf", variant=variant, scaling=scaling, size=0.2)
    out = export(tmp_path, model, "--adapter", str(tmp_path / "a.gguf"), "--out", str(tmp_path / "m.gguf"),
                 "--type", "f16")
    assert out.returncode == 0, out.stderr
    toks = tokens()
    want = tr.logprobs(native.Batch.next_token(np.array(toks, np.int32))).logp
    got = next_token_logprobs(llama(tmp_path / "m.gguf"), toks)
    base = tr.logprobs(native.Batch.next_token(np.array(toks, np.int32)), adapter=False).logp
    change, err = np.abs(want - base).mean(), np.abs(got - want)
    assert change > 0.05                                        # the adapter changes the model
    # F16 rounding of the merged weights only: far below the adapter's own effect (a scale off by
    # sqrt(rank), or magnitudes left out, would be of the size of `change`)
    assert err.mean() < 0.01 and err.max() < 0.05 and err.mean() < 0.1 * change, (err.mean(), err.max(), change)


def test_same_keeps_every_type_and_matches_llama_cpps_adapter(tiny, tmp_path):
    """--type same on a Q8_0 model: every tensor keeps its type, untouched ones byte for byte, the
    metadata is the base's; llama.cpp on the file agrees with llama.cpp on base + adapter up to Q8_0's
    rounding of the merged weights."""
    import gguf

    model = tiny("llama", qtype="Q8_0", n_embd=64)
    adapter(model, tmp_path / "a.gguf", size=0.2)
    out = export(tmp_path, model, "--adapter", str(tmp_path / "a.gguf"), "--out", str(tmp_path / "s.gguf"),
                 "--type", "same")
    assert out.returncode == 0, out.stderr
    a, b = gguf.GGUFReader(str(model)), gguf.GGUFReader(str(tmp_path / "s.gguf"))
    assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type) for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        changed = not np.array_equal(np.asarray(ta.data), np.asarray(tb.data))
        assert changed == (".attn_" in ta.name and "norm" not in ta.name or ".ffn_" in ta.name and "norm" not in
                           ta.name), ta.name
    for key in ("tokenizer.ggml.tokens", "general.architecture", "llama.block_count"):
        assert a.fields[key].contents() == b.fields[key].contents()
    toks = tokens()
    ref = next_token_logprobs(llama(model, tmp_path / "a.gguf"), toks)
    got = next_token_logprobs(llama(tmp_path / "s.gguf"), toks)
    effect = np.abs(ref - next_token_logprobs(llama(model), toks)).mean()
    # the random tiny model is sharp (log-probs near -13), so Q8_0's rounding of the merged weights and of
    # llama.cpp's activations shows: measured 0.04 x the adapter's effect; a lost adapter would be 1 x
    assert np.abs(got - ref).mean() < 0.1 * effect, (np.abs(got - ref).mean(), effect)


def test_refusals_are_one_line(tiny, tmp_path):
    model = tiny("llama")
    adapter(model, tmp_path / "a.gguf")
    (tmp_path / "exists.gguf").write_bytes(b"x")
    cases = [
        (["--adapter", str(tmp_path / "a.gguf"), "--out", str(tmp_path / "o.gguf"), "--type", "q3_k"], 2,
         "--type 'q3_k': expected one of q4_k_m, q5_k_m, q6_k, q8_0, f16, same"),
        (["--adapter", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o.gguf")], 1, "no such adapter file"),
        (["--out", str(tmp_path / "o.gguf")], 1, "no adapter:"),
        (["--checkpoint", "best", "--out", str(tmp_path / "o.gguf")], 1, "--checkpoint best: no such checkpoint"),
        (["--checkpoint", "newest", "--out", str(tmp_path / "o.gguf")], 2, "expected best, latest or step-N"),
        (["--adapter", str(tmp_path / "a.gguf"), "--out", str(tmp_path / "exists.gguf")], 1, "--force overwrites"),
        (["--adapter", str(model), "--out", str(tmp_path / "o.gguf")], 1, "not a LoRA or DoRA adapter"),
    ]
    for args, code, text in cases:
        out = export(tmp_path, model, *args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == code and len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], \
            (args, out.returncode, out.stderr)
    assert not (tmp_path / "o.gguf").exists() and (tmp_path / "exists.gguf").read_bytes() == b"x"


@pytest.mark.slow          # a training run, then four exports
def test_checkpoint_best_latest_and_step_n_export_that_checkpoint(tiny, tmp_path):
    """A real run with checkpoints (step-4, step-6, best): --checkpoint step-N, latest and best each
    export their checkpoint's adapter (llama.cpp on the file matches llama.cpp on base + that adapter,
    and not the other checkpoint), latest is step-6 byte for byte, and the run's eval split gives the
    closing perplexity line."""
    model = tiny("llama")
    cfg = make_run(tmp_path, model, steps=6, every=2)           # keep = 2: step-4, step-6, best
    train(open_model(load(cfg)))
    ck = tmp_path / "runs" / "t" / "checkpoints"
    best = json.loads((ck / "best.state" / "state.json").read_text())["step"]
    for name in ("step-4", "step-6", "latest", "best"):
        out = export(tmp_path, model, "--checkpoint", name, "--out", str(tmp_path / f"{name}.gguf"), "--type", "f16",
                     cfg=cfg)
        assert out.returncode == 0, out.stderr
        assert re.search(r"with adapter.gguf \(lora, \d+ weights\) merged in, f16", out.stdout), out.stdout
        assert re.search(r"held-out perplexity on \d+ tokens of .*train.jsonl \(held-out split\)", out.stdout), out.stdout
    assert (tmp_path / "latest.gguf").read_bytes() == (tmp_path / "step-6.gguf").read_bytes()
    if best in (4, 6):
        assert (tmp_path / "best.gguf").read_bytes() == (tmp_path / f"step-{best}.gguf").read_bytes()
    toks = tokens()
    ref = {n: next_token_logprobs(llama(model, ck / f"{n}.state" / "adapter.gguf"), toks) for n in ("step-4", "step-6")}
    for name in ("step-4", "step-6", "best"):
        want = next_token_logprobs(llama(model, ck / f"{name}.state" / "adapter.gguf"), toks)
        got = next_token_logprobs(llama(tmp_path / f"{name}.gguf"), toks)
        other = ref["step-6" if name == "step-4" else "step-4"]
        err, apart = np.abs(got - want).mean(), np.abs(other - want).mean()
        assert err < 0.01 and err < 0.1 * apart, (name, err, apart)


def test_dora_export_prints_the_perplexity_change(tiny, tmp_path):
    """With [evaluation].data the export of a DoRA adapter ends with the held-out perplexity line: its
    token count and the base + adapter figure are what llama.cpp gives on those examples (the adapter
    moves the perplexity well away from the base's), and the f16 file keeps it within 1%."""
    model = tiny("llama")
    adapter(model, tmp_path / "a.gguf", variant="dora", size=0.2)
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": f"the pattern is abc {i % 3} xyz"}) + "\n"
                                                 for i in range(12)))
    cfg = tmp_path / "export.toml"
    cfg.write_text(f'[model]\npath = "{model}"\nctx = 256\n[evaluation]\ndata = "{tmp_path / "eval.jsonl"}"\n')
    out = export(tmp_path, model, "--adapter", str(tmp_path / "a.gguf"), "--out", str(tmp_path / "m.gguf"), "--type",
                 "f16")
    assert out.returncode == 0, out.stderr
    assert re.search(r"\(dora, \d+ weights\)", out.stdout), out.stdout
    m = re.search(r"held-out perplexity on (\d+) tokens of (\S+) \(llama.cpp\): base \+ adapter ([\d.]+), m.gguf \(f16\) "
                  r"([\d.]+) \(([-+][\d.]+)%\)", out.stdout)
    assert m and m[2] == str(tmp_path / "eval.jsonl"), out.stdout
    examples = take_tokens(eval_examples(load(cfg), model)[0], PPL_TOKENS)
    base = score(model, examples, n_ctx=256, threads=THREADS)
    ref, got = float(m[3]), float(m[4])
    assert int(m[1]) == base.tokens > 50
    assert abs(got / ref - 1) < 0.01 and abs(float(m[5])) < 1.0 and abs(base.ppl / ref - 1) > 0.05, (base.ppl, ref, got)


def test_k_quant_fallbacks_are_one_summary_line(tiny, tmp_path):
    """The tiny model's rows (64 and 96 wide) cannot be q4_K / q6_K: llama.cpp's per-tensor warnings stay
    out of the terminal and one line counts the tensors it kept in q5_0 / q8_0."""
    model = tiny("llama")
    adapter(model, tmp_path / "a.gguf")
    out = export(tmp_path, model, "--adapter", str(tmp_path / "a.gguf"), "--out", str(tmp_path / "q.gguf"), "--type",
                 "q4_k_m")
    assert out.returncode == 0, out.stderr
    assert "ncols" not in out.stderr and "fallback" not in out.stderr, out.stderr
    m = re.search(r"^(\d+) of (\d+) tensors written as (.+) instead of (.+): their rows \(64, 96 wide\) are not a "
                  r"multiple of 256", out.stdout, re.M)
    assert m, out.stdout
    import gguf

    types = [t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors]
    # every weight left the K-quants; the count is llama.cpp's own (a tensor may be q8_0 by the mix itself)
    assert int(m[2]) == len(types) and 0 < int(m[1]) <= sum(t in ("Q5_0", "Q8_0") for t in types), (m[0], types)
    assert not {"Q4_K", "Q6_K"} & set(types) and m[3] == "q5_0 (12) / q8_0 (2)" and m[4] == "q4_K / q6_K", m[0]


def test_ollama_templates():
    smol = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
            "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
    shape, go, stops, system = translate(smol)
    assert shape == "chatml" and "<|im_start|>{{ .Role }}" in go and stops[0] == "<|im_end|>"
    assert system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    shape, go, stops, _ = translate("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}...")
    assert shape == "gemma" and "<start_of_turn>model" in go and "<end_of_turn>" in stops
    assert translate("[INST] {{ m }} [/INST]")[0] is None


def _agreement(ref_llm, got_llm, toks: list[int]) -> tuple[float, float]:
    """Mean |delta log-prob| of the tokens and top-1 agreement of the next-token argmax."""
    a = next_token_logprobs(ref_llm, toks)
    ta = np.argmax(np.array(ref_llm.scores[: len(toks)]), 1)
    b = next_token_logprobs(got_llm, toks)
    tb = np.argmax(np.array(got_llm.scores[: len(toks)]), 1)
    return float(np.abs(a - b).mean()), float((ta == tb).mean())


@pytest.mark.slow
def test_every_type_on_smollm_matches_base_plus_adapter(smollm, tmp_path):
    """SmolLM2 with a LoRA adapter on every target: each exported type loads in llama.cpp, its log-probs
    and next-token choices agree with base + adapter within TOLERANCE, and f16 answers a short prompt with
    exactly the same 6 greedy tokens; the Modelfile names the file and ChatML's stop token."""
    from retrograd.data.tokenizer import Tokenizer

    tr = adapter(smollm, tmp_path / "a.gguf", rank=8, size=0.06)
    tr.close()
    tok = Tokenizer(smollm)
    text = ("<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\nThe sea is vast, "
            "deep and full of life, and sailors have told stories about it for as long as ships have sailed.")
    toks = tok.encode(text)
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ref = llama(smollm, tmp_path / "a.gguf", exact=False)
    # greedy answer of base + adapter: its first 6 tokens (measured: with this adapter the f16 file's answer
    # is the same for 7 tokens, then base + adapter ends it where the f16 file goes on, a near tie that the
    # Q4_1 base's 8-bit activation rounding in llama.cpp decides)
    want = [t for _, t in zip(range(6), ref.generate(prompt, temp=0.0))]
    for kind in TOLERANCE:
        out_path = tmp_path / f"{kind}.gguf"
        extra = ["--ollama", "smol"] if kind == "q4_k_m" else []
        out = export(tmp_path, smollm, "--adapter", str(tmp_path / "a.gguf"), "--out", str(out_path), "--type", kind,
                     *extra)
        assert out.returncode == 0, out.stderr
        assert "ncols" not in out.stderr and "fallback" not in out.stderr, out.stderr
        if extra:
            assert "ollama create smol -f" in out.stdout, out.stdout
        if kind in ("q4_k_m", "q5_k_m", "q6_k"):        # SmolLM2's 576-wide rows: one summary line
            assert re.search(r"^\d+ of \d+ tensors written as .*\(576 wide\) are not a multiple of 256", out.stdout,
                             re.M), out.stdout
        got = llama(out_path, exact=False)
        mad, top1 = _agreement(ref, got, toks)
        print(f"{kind}: mean |dlogp| {mad:.4f}, top-1 agreement {top1:.3f}")
        assert mad <= TOLERANCE[kind][0] and top1 >= TOLERANCE[kind][1], (kind, mad, top1)
        if kind == "f16":
            got.reset()
            assert [t for _, t in zip(range(6), got.generate(prompt, temp=0.0))] == want
        got.close()
    mf = (tmp_path / "q4_k_m.Modelfile").read_text()
    assert f"FROM {tmp_path / 'q4_k_m.gguf'}" in mf and 'PARAMETER stop "<|im_end|>"' in mf and "SYSTEM" in mf
