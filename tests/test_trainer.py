"""The training loop: SFT end to end, checkpoints, exact resume after SIGKILL, refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS

from retrograd import checkpoint as ckpt
from retrograd.config import load
from retrograd.context import open_model
from retrograd.trainer import learning_rate, train


def make_run(tmp_path: Path, model: Path, *, steps=12, every=4, rank=4, lr=1e-2, records=None, extra="") -> Path:
    records = records or [{"text": f"the pattern is abc {i % 3} xyz"} for i in range(24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[model]
path = "{model}"
ctx = 256
[lora]
rank = {rank}
alpha = {2 * rank}
[run]
name = "t"
seed = 1
[data]
train = "train.jsonl"
eval_split = 0.2
[training]
max_steps = {steps}
batch_size = 4
micro_batch_tokens = 64
learning_rate = {lr}
warmup_steps = 2
threads = {THREADS}
[checkpoint]
every_steps = {every}
keep = 2
[evaluation]
every_steps = {every}
{extra}
""")
    return cfg


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def test_sft_end_to_end_on_tiny_model(tiny, tmp_path):
    cfg = load(make_run(tmp_path, tiny("llama")))
    summary = train(open_model(cfg))
    run = tmp_path / "runs" / "t"
    ls = losses(run)
    assert len(ls) == 12 and ls[12] < ls[1] * 0.7
    for name in ("adapter.gguf", "loss.png", "config.json", "checkpoints/best.state/state.json",
                 "checkpoints/latest", "checkpoints/step-12.gguf"):
        assert (run / name).exists(), name
    assert not (run / "checkpoints/step-4.state").exists()          # keep = 2
    assert summary["steps"] == 12 and "eval_loss" in summary
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
    assert evals[0]["step"] == 0 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]


def test_learning_rate_schedule(tmp_path, tiny):
    cfg = load(make_run(tmp_path, tiny("llama")))
    lrs = [learning_rate(cfg, s, 12) for s in range(12)]
    assert lrs[0] == pytest.approx(0.005) and lrs[1] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and lrs[-1] < 0.001


def _run_cli(cfg: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "RETRO_THREADS": str(THREADS)}
    return subprocess.Popen([sys.executable, "-m", "retrograd.cli", "train", str(cfg), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_sigkill_and_resume_follow_the_same_trajectory(smollm, tmp_path):
    records = [{"messages": [{"role": "user", "content": f"Say the word number {i}."},
                             {"role": "assistant", "content": f"Word {i}: {'alpha beta gamma delta'.split()[i % 4]}"}]}
               for i in range(40)]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    cfg_a = make_run(a, smollm, steps=6, every=2, rank=4, lr=2e-3, records=records)
    cfg_b = make_run(b, smollm, steps=6, every=2, rank=4, lr=2e-3, records=records)
    p = _run_cli(cfg_a)
    assert p.wait(timeout=900) == 0, p.stderr.read()
    p = _run_cli(cfg_b)
    metrics = b / "runs" / "t" / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline:
        if metrics.exists() and '"step": 3' in metrics.read_text():
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert ckpt.latest(b / "runs" / "t" / "checkpoints").name == "step-2.state"
    p = _run_cli(cfg_b, "--resume")
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err
    assert "resumed at step 2" in err
    la, lb = losses(a / "runs" / "t"), losses(b / "runs" / "t")
    assert sorted(lb) == list(range(1, 7))
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-6, abs=1e-7), step
    ga = (a / "runs/t/adapter.gguf").read_bytes()
    gb = (b / "runs/t/adapter.gguf").read_bytes()
    assert ga == gb


@pytest.mark.slow          # three training runs, one of 8 steps
def test_a_fresh_run_sets_the_earlier_run_aside(tiny, tmp_path):
    """Training again into a run directory (without --resume) starts a new record: the earlier run's
    metrics, adapter and checkpoints move to previous/1/, so its higher-step checkpoints neither get
    the new run's pruned nor get resumed in its place, and its metrics are not appended to."""
    train(open_model(load(make_run(tmp_path, tiny("llama"), steps=8, every=2))))
    run = tmp_path / "runs" / "t"
    old_metrics = (run / "metrics.jsonl").read_text()
    ctx = open_model(load(make_run(tmp_path, tiny("llama"), steps=2, every=2)))
    train(ctx)
    assert any("held an earlier run" in n and "previous/1" in n for n in ctx.notes)
    prev = run / "previous" / "1"
    assert (prev / "metrics.jsonl").read_text() == old_metrics
    assert json.loads((prev / "config.json").read_text())["training"]["max_steps"] == 8
    assert {p.name for p in (prev / "checkpoints").glob("step-*.state")} == {"step-6.state", "step-8.state"}
    assert sorted(losses(run)) == [1, 2]                               # only the new run's steps
    assert {p.name for p in (run / "checkpoints").glob("step-*.state")} == {"step-2.state"}
    assert ckpt.latest(run / "checkpoints").name == "step-2.state"
    train(open_model(load(make_run(tmp_path, tiny("llama"), steps=2, every=2))), True)   # a resume moves nothing
    assert not (run / "previous" / "2").exists()


def test_resume_refuses_an_incompatible_checkpoint(tiny, tmp_path):
    cfg = load(make_run(tmp_path, tiny("llama"), steps=4, every=2))
    train(open_model(cfg))
    state = tmp_path / "runs/t/checkpoints/step-4.state"
    other = load(make_run(tmp_path, tiny("llama"), steps=4, every=2, rank=8))
    with pytest.raises(ckpt.CheckpointError, match=r"incompatible \[lora\].rank: checkpoint has 4"):
        train(open_model(other), state)
    other_model = load(make_run(tmp_path, tiny("qwen2"), steps=4, every=2))
    with pytest.raises(ckpt.CheckpointError, match="checkpoint is for another model"):
        train(open_model(other_model), state)


def test_checkpoint_writes_are_atomic(tiny, tmp_path):
    cfg = load(make_run(tmp_path, tiny("llama"), steps=4, every=2))
    train(open_model(cfg))
    d = tmp_path / "runs/t/checkpoints"
    assert not list(d.glob(".*tmp*")) and not list(d.glob("*.tmp"))
    state = json.loads((d / "step-4.state/state.json").read_text())
    assert state["step"] == 4 and state["trainer"]["recipe"]["cursor"]["index"] >= 0
    opt = np.load(d / "step-4.state/optimizer.npz")
    assert any(k.startswith("m:") for k in opt.files)


@pytest.mark.slow          # three training runs
def test_neftune_noise_scale_and_exact_resume(tiny, tmp_path):
    from retrograd.algorithms.sft import neftune_noise

    seq = np.array([0] * 30 + [1] * 10, np.int32)
    noise = neftune_noise(seq, 64, 5.0, np.random.default_rng(0))
    assert np.abs(noise[:30]).max() <= 5.0 / np.sqrt(30 * 64) and np.abs(noise[30:]).max() <= 5.0 / np.sqrt(10 * 64)
    assert np.abs(noise[30:]).max() > 0.9 * 5.0 / np.sqrt(10 * 64)      # each row scaled by its own sequence
    (tmp_path / "noisy").mkdir()
    (tmp_path / "plain").mkdir()
    cfg = load(make_run(tmp_path / "noisy", tiny("llama"), steps=4, every=2))
    cfg.training.neftune_alpha = 5.0
    train(open_model(cfg))
    run = tmp_path / "noisy" / "runs" / "t"
    whole = (run / "adapter.gguf").read_bytes()
    train(open_model(load(make_run(tmp_path / "plain", tiny("llama"), steps=4, every=2))))
    assert (tmp_path / "plain" / "runs" / "t" / "adapter.gguf").read_bytes() != whole     # the noise trains differently
    train(open_model(cfg), resume=run / "checkpoints" / "step-2.state")
    assert (run / "adapter.gguf").read_bytes() == whole                                   # and resumes exactly


@pytest.mark.slow          # three training runs
def test_lora_dropout_trains_resumes_exactly_and_stays_out_of_evaluation(tiny, tmp_path):
    from retrograd.eval.nll import evaluate_nll

    (tmp_path / "drop").mkdir()
    (tmp_path / "plain").mkdir()
    model = tiny("llama")
    cfg = load(make_run(tmp_path / "drop", model, steps=4, every=2))
    cfg.lora.dropout = 0.2
    ctx = open_model(cfg)
    summary = train(ctx)
    run = tmp_path / "drop" / "runs" / "t"
    whole = (run / "adapter.gguf").read_bytes()
    train(open_model(load(make_run(tmp_path / "plain", model, steps=4, every=2))))
    assert (tmp_path / "plain" / "runs" / "t" / "adapter.gguf").read_bytes() != whole     # the masks train differently
    # the final evaluation sees the adapter without dropout: a fresh model with the exported adapter agrees
    fresh = open_model(load(make_run(tmp_path / "drop", model, steps=4, every=2)))
    fresh.trainable.load_adapter(run / "adapter.gguf")
    again = evaluate_nll(fresh.trainable, fresh.eval_examples, cfg.training.micro_batch_tokens)
    assert again["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6)
    train(open_model(cfg), resume=run / "checkpoints" / "step-2.state")
    assert (run / "adapter.gguf").read_bytes() == whole                                   # resumes exactly


def test_lora_dropout_is_sft_and_distill_only(tiny, tmp_path):
    from test_grpo import make_run as grpo_run

    cfg = load(grpo_run(tmp_path, tiny("llama", n_layer=2), steps=1))
    cfg.lora.dropout = 0.1
    ctx = open_model(cfg)
    assert any("[lora].dropout applies to sft and distill" in n for n in ctx.notes)
