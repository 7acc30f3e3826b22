"""PPO end to end on a small model: metrics, the value head learning, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import THREADS

from retrograd.config import load
from retrograd.context import open_model
from retrograd.trainer import train


def make_run(d: Path, model: Path, *, steps: int, every: int = 1) -> Path:
    recs = [{"prompt": f"Say {w}.", "answer": w} for w in ["apple", "pear", "plum", "kiwi", "fig", "lime"]]
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = d / "run.toml"
    cfg.write_text(f"""
[model]
path = "{model}"
[lora]
rank = 4
alpha = 8.0
[run]
algorithm = "ppo"
name = "p"
seed = 5
[data]
train = "p.jsonl"
eval_split = 0.34
[training]
max_steps = {steps}
learning_rate = 5e-3
lr_schedule = "constant"
threads = {THREADS}
micro_batch_tokens = 128
[ppo]
batch_prompts = 3
max_new_tokens = 6
max_prompt_tokens = 128
ppo_epochs = 2
value_lr = 1e-2
[[ppo.rewards]]
name = "length"
target = 4
[checkpoint]
every_steps = {every}
[evaluation]
every_steps = 2
""")
    return cfg


def rows(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "runs/p/metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_ppo_runs_and_the_value_head_learns(tiny, tmp_path):
    summary = train(open_model(load(make_run(tmp_path, tiny("gemma3", n_layer=2), steps=6))))
    r = rows(tmp_path)
    assert len(r) == 6 and "eval_reward" in summary
    for key in ("reward_mean", "kl", "pg_loss", "value_loss", "clip_frac", "completion_len", "grad_norm"):
        assert any(key in x for x in r), key
    state = json.loads((tmp_path / "runs/p/checkpoints/step-6.state/state.json").read_text())
    head = state["trainer"]["recipe"]["value_head"]
    assert head["t"] == 6 and any(abs(x) > 0 for x in head["u"])


@pytest.mark.slow          # three training runs
def test_ppo_resume_matches_uninterrupted(tiny, tmp_path):
    model = tiny("llama", n_layer=2)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    train(open_model(load(make_run(a, model, steps=4))))
    train(open_model(load(make_run(b, model, steps=3))))          # stops between the two updates of a batch
    train(open_model(load(make_run(b, model, steps=4))), resume=True)
    ra, rb = rows(a), rows(b)
    assert len(rb) == 4
    for x, y in zip(ra, rb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6, abs=1e-9), x["step"]
    assert (a / "runs/p/adapter.gguf").read_bytes() == (b / "runs/p/adapter.gguf").read_bytes()
