"""GRPO end to end on small models: rollouts, metrics, exact resume (including between the updates
of one batch of rollouts), bench for grpo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS, slow_case

from retrograd import native
from retrograd.config import load
from retrograd.context import open_model
from retrograd.trainer import train


def make_run(d: Path, model: Path, *, steps: int, iterations: int = 1, loss: str = "grpo", every: int = 2) -> Path:
    recs = [{"prompt": f"Say {w}.", "answer": w} for w in ["apple", "pear", "plum", "kiwi", "fig", "lime"]]
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = d / "run.toml"
    cfg.write_text(f"""
[model]
path = "{model}"
ctx = 256
[lora]
rank = 4
alpha = 8.0
[run]
algorithm = "grpo"
name = "g"
seed = 3
[data]
train = "p.jsonl"
eval_split = 0.34
[training]
max_steps = {steps}
learning_rate = 5e-3
lr_schedule = "constant"
threads = {THREADS}
micro_batch_tokens = 128
[grpo]
group_size = 4
prompts_per_step = 2
max_new_tokens = 6
max_prompt_tokens = 128
beta = 0.05
loss = "{loss}"
num_iterations = {iterations}
[[grpo.rewards]]
name = "regex"
pattern = "[aeiou]"
[[grpo.rewards]]
name = "length"
target = 3
weight = 0.1
[checkpoint]
every_steps = {every}
[evaluation]
every_steps = {every}
""")
    return cfg


def metrics(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "runs/g/metrics.jsonl").read_text().splitlines() if '"loss"' in x]


# the other variants differ only in the policy loss, which test_algorithms checks variant by variant
@pytest.mark.parametrize("loss", ["grpo", slow_case("dapo"), slow_case("gspo"), slow_case("dr_grpo")])
def test_grpo_runs_and_logs(tiny, tmp_path, loss):
    cfg = load(make_run(tmp_path, tiny("llama", n_layer=2), steps=3, loss=loss))
    summary = train(open_model(cfg))
    rows = metrics(tmp_path)
    assert len(rows) == 3 and "eval_reward" in summary
    for key in ("reward_mean", "reward_std", "reward/regex", "reward/length", "kl", "clip_frac", "entropy",
                "completion_len", "logp_gap", "zero_signal_groups", "grad_norm"):
        assert key in rows[0], key
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)         # the adapter starts as the base model
    assert rows[0]["logp_gap"] < 0.05                            # llama.cpp and our graph agree on the tokens
    assert (tmp_path / "runs/g/loss.png").exists()


def test_groups_over_the_budget_are_split_without_changing_the_step(tiny, tmp_path):
    """A micro-batch budget smaller than a group cuts the group into parts that repeat the prompt
    (data.batching.split_groups): the first step's loss and gradient norm are those of the run that
    trains each group whole."""
    model = tiny("llama", n_layer=2)
    firsts = []
    for budget in (512, 16):
        d = tmp_path / str(budget)
        d.mkdir()
        cfg_path = make_run(d, model, steps=1)
        cfg_path.write_text(cfg_path.read_text().replace("micro_batch_tokens = 128", f"micro_batch_tokens = {budget}"))
        train(open_model(load(cfg_path)))
        firsts.append(metrics(d)[0])
    assert firsts[1]["loss"] == pytest.approx(firsts[0]["loss"], rel=1e-4, abs=1e-6)
    assert firsts[1]["grad_norm"] == pytest.approx(firsts[0]["grad_norm"], rel=1e-3)
    assert firsts[1]["reward_mean"] == firsts[0]["reward_mean"]


def test_grpo_with_an_f16_generator(tiny, tmp_path, monkeypatch):
    """[grpo].generator_weights = "f16": llama.cpp's quantizer writes an F16 copy once into the cache,
    the generator samples from it, the trainer keeps the quantized file, and the two still agree."""
    monkeypatch.setenv("RETROGRAD_CACHE", str(tmp_path / "cache"))
    model = tiny("llama", n_layer=2, qtype="Q4_1")     # the trainer multiplies Q4_1 weights in F16 too
    cfg_path = make_run(tmp_path, model, steps=2)
    cfg_path.write_text(cfg_path.read_text().replace("[grpo]\n", '[grpo]\ngenerator_weights = "f16"\n'))
    cfg = load(cfg_path)
    ctx = open_model(cfg)
    train(ctx)
    copies = list((tmp_path / "cache/models/generator").glob("*.f16.gguf"))
    assert len(copies) == 1 and not list((tmp_path / "cache/models/generator").glob("*.partial"))
    import gguf
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(copies[0])).tensors if len(t.shape) == 2}
    assert types == {"F16"}
    rows = metrics(tmp_path)
    assert len(rows) == 2 and rows[0]["logp_gap"] < 0.05
    before = copies[0].stat().st_mtime_ns
    from retrograd.generation.weights import generator_model
    assert generator_model(model, "f16", THREADS) == copies[0] and copies[0].stat().st_mtime_ns == before
    assert generator_model(model, "native", THREADS) == model


def test_grpo_samples_a_q4_1_model_from_its_split_copy_by_default(tiny, tmp_path, monkeypatch):
    """generator_weights = "auto" (the default): a Q4_1 model's generator loads the split copy
    (Q4_0 weights and their offsets as an adapter, written once into the cache) under the training
    adapter, and samples what the trainer scores as closely as the file's own weights do."""
    monkeypatch.setenv("RETROGRAD_CACHE", str(tmp_path / "cache"))
    model = tiny("llama", n_layer=2, qtype="Q4_1")
    gaps = {}
    for weights in ("auto", "native"):
        d = tmp_path / weights
        d.mkdir()
        cfg_path = make_run(d, model, steps=2)
        if weights == "native":
            cfg_path.write_text(cfg_path.read_text().replace("[grpo]\n", '[grpo]\ngenerator_weights = "native"\n'))
        cfg = load(cfg_path)
        train(open_model(cfg))
        gaps[weights] = [r["logp_gap"] for r in metrics(d)]
    assert cfg.grpo.generator_weights == "native" and load(tmp_path / "auto/run.toml").grpo.generator_weights == "auto"
    copies = sorted(p.name for p in (tmp_path / "cache/models/generator").iterdir())
    assert len(copies) == 2 and copies[0].endswith(".split.gguf") and copies[1].endswith(".split.offsets.gguf")
    assert len(gaps["auto"]) == 2
    assert max(gaps["auto"]) < 1.5 * max(gaps["native"]) + 0.01, gaps


@pytest.mark.slow          # three training runs per case
@pytest.mark.parametrize("iterations, stop", [(1, 2), (2, 3)])
def test_grpo_resume_matches_uninterrupted(tiny, tmp_path, iterations, stop):
    model = tiny("qwen3", n_layer=2)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    train(open_model(load(make_run(a, model, steps=4, iterations=iterations, every=1))))
    train(open_model(load(make_run(b, model, steps=stop, iterations=iterations, every=1))))
    cfg = load(make_run(b, model, steps=4, iterations=iterations, every=1))
    train(open_model(cfg), resume=True)
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3, 4][: len(rb)] and len(rb) == 4
    for x, y in zip(ra, rb):
        for k in ("loss", "reward_mean", "kl"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-6, abs=1e-9), (x["step"], k)
    assert (a / "runs/g/adapter.gguf").read_bytes() == (b / "runs/g/adapter.gguf").read_bytes()


def test_bench_grpo_reports_reward_distributions(tiny, tmp_path):
    cfg = make_run(tmp_path, tiny("llama", n_layer=2), steps=2)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "Say yes.", "answer": "yes"}) + "\n")
    train(open_model(load(cfg)))
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "bench", str(cfg), "--data", str(tmp_path / "eval.jsonl"),
                          "--adapter", str(tmp_path / "runs/g/adapter.gguf"), "--format", "jsonl"],
                         capture_output=True, text=True, env={**os.environ, "RETRO_THREADS": str(THREADS)})
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    for name in ("base", "adapter"):
        r = rep["results"][name]
        assert r["completions"] == 4 and "pass/regex" in r and r["reward_p10"] <= r["reward_p90"]
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "bench", str(cfg), "--data", str(tmp_path / "eval.jsonl"),
                          "--format", "text"], capture_output=True, text=True)
    assert out.returncode == 0 and "reward_mean" in out.stdout


def test_retrograd_profile_reports_every_phase(tiny, tmp_path):
    cfg = make_run(tmp_path, tiny("llama", n_layer=2), steps=2)
    out = subprocess.run([sys.executable, "-m", "retrograd.commands.profile", str(cfg), "--steps", "1", "--json",
                          "--threads", str(THREADS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    for phase in ("generation", "reference", "forward", "head", "backward", "optimizer", "adapter swap"):
        assert rep["median"][phase] >= 0, phase
    assert rep["median"]["total"] > 0 and rep["median"]["mem forward+head+backward"] > 0
    assert not (tmp_path / "runs").exists()           # a throw-away run directory
    out = subprocess.run([sys.executable, "-m", "retrograd.commands.profile"], capture_output=True, text=True)
    assert out.returncode == 2 and "give a run configuration" in out.stderr


def test_retrograd_profile_sft_reports_ops_kinds_and_flops(tiny, tmp_path):
    model = tiny("llama", n_layer=2, n_embd=64, n_ff=96)
    out = subprocess.run([sys.executable, "-m", "retrograd.commands.profile", "--sft", "--model", str(model),
                          "--batch", "2", "--seq", "32", "--micro-batch-tokens", "32", "--rank", "4", "--steps", "1",
                          "--threads", str(THREADS), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    cells = {(e["phase"], e["kind"]) for e in rep["entries"]}
    for phase in ("forward", "backward"):
        for kind in ("q", "k", "v", "o", "gate", "up", "down", "lora", "attention"):
            assert (phase, kind) in cells, (phase, kind)
    assert rep["tokens_s"] > 0 and rep["peak_flops"] > 0 and rep["effective_flops"] > 0
    # the packed product's own rate, where it runs, is the other yardstick
    kernel = native.matmul_kernel("auto")
    assert (rep["packed_flops"] > 0) == (kernel != "ggml") and rep["packed_kernel"] == kernel
    assert rep["graph_flops"] == pytest.approx(sum(e["flops"] for e in rep["entries"]))
    # a route forced through the setting [training].matmul_precision has too: ggml's product, no packed kernel
    forced = subprocess.run([sys.executable, "-m", "retrograd.commands.profile", "--sft", "--model", str(model),
                             "--batch", "1", "--seq", "16", "--steps", "1", "--threads", str(THREADS),
                             "--matmul-precision", "ggml-f16", "--json"], capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    rep = json.loads(forced.stdout)
    assert rep["packed_kernel"] == "ggml" and rep["packed_flops"] == 0 and rep["matmul_precision"] == "ggml-f16 (f16)"
    text = subprocess.run([sys.executable, "-m", "retrograd.commands.profile", "--sft", "--model", str(model),
                           "--batch", "1", "--seq", "16", "--steps", "1", "--threads", str(THREADS)],
                          capture_output=True, text=True)
    assert text.returncode == 0 and "by kind:" in text.stdout and "LM head" in text.stdout, text.stderr
    for argv, msg in ((["--sft", str(tmp_path / "x.toml")], "takes no configuration"),
                      ([], "give a run configuration (e.g. grpo or agent_grpo), or --sft"),
                      (["--sft", "--model", str(tmp_path / "none.gguf")], "no such file")):
        bad = subprocess.run([sys.executable, "-m", "retrograd.commands.profile", *argv], capture_output=True, text=True)
        assert bad.returncode == 2 and msg in bad.stderr, (argv, bad.stderr)



def test_generate_groups_equals_one_group_at_a_time(smollm):
    """A step's groups decoded together (one batch) sample what each group alone samples."""
    from retrograd.generation.llama import Generator, SamplingParams

    gen = Generator(smollm, n_ctx=96, n_seq=9, threads=THREADS)
    tok = gen.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("The capital of Peru is"), tok.encode("Two plus")]
    params = [[SamplingParams(0.7, 0.95, 0, 10, 10 * g + i) for i in range(3)] for g in range(3)]
    together = gen.generate_groups(prompts, params)
    alone = [gen.generate(p, ps) for p, ps in zip(prompts, params)]
    for group_t, group_a in zip(together, alone):
        for a, b in zip(group_t, group_a):
            assert a.tokens == b.tokens and a.text == b.text
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=0.05)
    assert len({tuple(o.tokens) for o in together[0]}) > 1          # the seeds differ within a group
    with pytest.raises(ValueError, match="10 sequences requested"):
        gen.generate_groups(prompts, params[:2] + [params[2] + [params[2][0]]])
    gen.close()


def test_groups_fit_a_kv_cache_sized_to_their_shared_prompts(smollm):
    """GRPO sizes the generator's KV cache to the prompts once plus every completion (rl.py): the
    groups sample the same there as in a cache of n_ctx x n_seq cells, and a cache too small for
    the work fails with its size named instead of sampling from a truncated context."""
    from retrograd.generation.llama import Generator, SamplingParams

    prompts_text = ["The capital of France is", "The capital of Peru is", "Two plus"]
    params = [[SamplingParams(0.7, 0.95, 0, 12, 10 * g + i) for i in range(3)] for g in range(3)]
    outs = {}
    for cells in (None, 3 * 96 + 9 * (12 + 8)):
        gen = Generator(smollm, n_ctx=96, n_seq=9, threads=THREADS, kv_cells=cells)
        assert gen.kv_cells == (96 * 9 if cells is None else cells)
        outs[cells] = gen.generate_groups([gen.tokenizer.encode(p) for p in prompts_text], params)
        gen.close()
    for group_full, group_sized in zip(*outs.values()):
        assert [o.tokens for o in group_full] == [o.tokens for o in group_sized]
    gen = Generator(smollm, n_ctx=96, n_seq=9, threads=THREADS, kv_cells=1)
    assert gen.kv_cells == 96                       # never below one sequence's context
    gen.tokenizer.eog_ids = frozenset()
    long = [[SamplingParams(0.7, 0.95, 0, 40, 10 * g + i) for i in range(3)] for g in range(3)]
    with pytest.raises(RuntimeError, match="KV cache of 96 cells"):
        gen.generate_groups([gen.tokenizer.encode(p) for p in prompts_text], long)
    gen.close()
