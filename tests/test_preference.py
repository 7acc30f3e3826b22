"""Preference training: each loss against numerical derivatives, the pair loss through the engine
against finite differences, pair data (formats, errors), and a run whose held-out preference
accuracy rises."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from gradcheck import randomize_adapter, richardson
from test_algorithms import numeric_grad

from retrograd import native
from retrograd.config import PreferenceSection, load
from retrograd.context import open_model
from retrograd.data import chat as chat_mod
from retrograd.data import tokenizer as tok_mod
from retrograd.data.formats import DataError
from retrograd.data.pairs import load_pairs
from retrograd.engine import LoraSpec, Trainable
from retrograd.losses.preference import LOSSES, PairStats, pair_batches, pair_loss, preference_loss
from retrograd.trainer import train


def _stats(seed):
    rng = np.random.default_rng(seed)
    n = 5
    nc, nr = rng.integers(2, 9, n).astype(float), rng.integers(2, 9, n).astype(float)
    pc, pr = -rng.random(n) * nc * 2, -rng.random(n) * nr * 2
    return PairStats(pc, pr, nc, nr, pc + rng.normal(0, 1, n), pr + rng.normal(0, 1, n))


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("seed", [0, 1])
def test_pair_loss_coefficients_match_numerical_derivatives(kind, seed):
    s = _stats(seed)
    loss, gc, gr, per = preference_loss(s, kind, 0.3, gamma=0.4, lam=0.2, norm=2.0)
    assert loss == pytest.approx(per.sum() / 2.0)

    def f_c(x):
        return preference_loss(PairStats(x, s.pr, s.nc, s.nr, s.rc, s.rr), kind, 0.3, gamma=0.4, lam=0.2, norm=2.0)[0]

    def f_r(x):
        return preference_loss(PairStats(s.pc, x, s.nc, s.nr, s.rc, s.rr), kind, 0.3, gamma=0.4, lam=0.2, norm=2.0)[0]

    np.testing.assert_allclose(gc, numeric_grad(f_c, s.pc.copy()), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(gr, numeric_grad(f_r, s.pr.copy()), rtol=1e-5, atol=1e-8)


def test_dpo_at_the_reference_is_log_two():
    s = _stats(3)
    s.rc, s.rr = s.pc.copy(), s.pr.copy()
    _, _, _, per = preference_loss(s, "dpo", 0.1)
    np.testing.assert_allclose(per, np.log(2.0))


def _pairs_file(path: Path, n: int = 24) -> Path:
    rng = np.random.default_rng(0)
    recs = []
    for i in range(n):
        a, b = rng.integers(1, 9, 2)
        good = f"yes {a} {b}"
        bad = f"no {b} {a} {a}"
        if i % 3 == 0:
            recs.append({"chosen": [{"role": "user", "content": f"q {a} {b}"}, {"role": "assistant", "content": good}],
                         "rejected": [{"role": "user", "content": f"q {a} {b}"}, {"role": "assistant", "content": bad}]})
        else:
            recs.append({"prompt": f"q {a} {b}", "chosen": good, "rejected": bad})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_pair_loss_gradient_through_the_engine(tiny, tmp_path, kind):
    path = tiny("llama", n_embd=32, n_ff=48)
    tok = tok_mod.load(str(path))
    chat = chat_mod.format_for(tok, None)
    pairs, _ = load_pairs(_pairs_file(tmp_path / "p.jsonl", 4), tok, chat, max_length=128)
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_exact_ops(True)
    rng = np.random.default_rng(4)
    randomize_adapter(tr, rng)                 # the same generator then draws the references
    for p in pairs:
        p.ref = (-20.0 + rng.normal(), -22.0 + rng.normal())
    [(chunk, batch, owner, w)] = list(pair_batches(pairs, 4096))

    cfg = PreferenceSection(loss=kind, beta=0.5)

    def value():
        return pair_loss(chunk, tr.logprobs(batch).logp, owner, w, cfg, True)[0]

    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(batch, lambda inp: native.LossOutputs(pair_loss(chunk, inp.logp, owner, w, cfg, True)[1]))
    t = tr.lora.index["blk.0.ffn_up.weight.lora_b"]
    g = tr.lora.read(t.index, native.SLOT_GRAD).ravel()
    for i in np.argsort(-np.abs(g))[:3]:
        assert richardson(tr, t, value, i) == pytest.approx(g[i], rel=1e-2, abs=1e-7)


def test_pair_formats_share_the_prompt_and_errors_name_the_line(tiny, tmp_path):
    path = tiny("llama")
    tok = tok_mod.load(str(path))
    chat = chat_mod.format_for(tok, None)
    pairs, report = load_pairs(_pairs_file(tmp_path / "p.jsonl", 6), tok, chat, max_length=128)
    assert len(pairs) == 6
    for p in pairs:
        assert len(p.prompt) > 0 and p.chosen_w.sum() > 0 and p.rejected_w.sum() > 0
        assert not np.array_equal(p.chosen[:len(p.rejected)], p.rejected[:len(p.chosen)])
    # the string form and the whole-conversation form give the same tokens
    same = tmp_path / "same.jsonl"
    conv = [{"role": "user", "content": "q 1 2"}]
    same.write_text(json.dumps({"prompt": "q 1 2", "chosen": "yes", "rejected": "no no"}) + "\n"
                    + json.dumps({"chosen": conv + [{"role": "assistant", "content": "yes"}],
                                  "rejected": conv + [{"role": "assistant", "content": "no no"}]}) + "\n")
    a, b = load_pairs(same, tok, chat)[0]
    for f in ("prompt", "chosen", "rejected", "chosen_w", "rejected_w"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                   + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing \"rejected\""):
        load_pairs(bad, tok, chat)
    bad.write_text(json.dumps({"prompt": "a", "chosen": 3, "rejected": "c"}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:1: \"chosen\" must be a string"):
        load_pairs(bad, tok, chat)


def _pref_run(tmp_path: Path, model: Path, kind: str, steps: int = 12, every: int = 0) -> Path:
    _pairs_file(tmp_path / "train.jsonl", 40)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[model]
path = "{model}"
ctx = 128
[lora]
rank = 4
alpha = 8.0
[run]
algorithm = "preference"
name = "p"
[data]
train = "train.jsonl"
eval_split = 0.25
[training]
max_steps = {steps}
batch_size = 4
micro_batch_tokens = 256
learning_rate = 1e-2
lr_schedule = "constant"
threads = {THREADS}
[checkpoint]
every_steps = {every}
[evaluation]
every_steps = 6
[preference]
loss = "{kind}"
beta = 0.5
""")
    return cfg


@pytest.mark.parametrize("kind", ["dpo", "simpo"])
def test_preference_run_raises_held_out_accuracy(tiny, tmp_path, kind):
    summary = train(open_model(load(_pref_run(tmp_path, tiny("llama"), kind))))
    evals = [json.loads(x) for x in (tmp_path / "runs/p/metrics.jsonl").read_text().splitlines()
             if "eval_pref_accuracy" in x]
    assert evals[0]["step"] == 0 and evals[-1]["eval_pref_accuracy"] > evals[0]["eval_pref_accuracy"]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    if kind == "dpo":
        assert evals[0]["eval_reward_margin"] == pytest.approx(0.0, abs=1e-6)    # policy == reference
        assert evals[-1]["eval_reward_margin"] > 0
    assert summary["steps"] == 12


@pytest.mark.parametrize("algorithm", ["preference", "agent_grpo"])
def test_bench_says_plainly_that_it_is_not_supported(tmp_path, algorithm):
    import subprocess
    import sys

    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nalgorithm = "{algorithm}"\n')
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "bench", str(cfg)], capture_output=True, text=True)
    assert out.returncode == 2 and f"bench does not support {algorithm}" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow          # three training runs
def test_preference_resume_matches_uninterrupted(tiny, tmp_path):
    model = tiny("llama")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    train(open_model(load(_pref_run(a, model, "ipo", steps=4, every=1))))
    train(open_model(load(_pref_run(b, model, "ipo", steps=2, every=1))))
    train(open_model(load(_pref_run(b, model, "ipo", steps=4, every=1))), resume=True)

    def losses(d):
        rows = [json.loads(x) for x in (d / "runs/p/metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    la, lb = losses(a), losses(b)
    assert sorted(lb) == [1, 2, 3, 4]
    for step, value in la.items():
        assert lb[step] == pytest.approx(value, rel=1e-6)
    assert (a / "runs/p/adapter.gguf").read_bytes() == (b / "runs/p/adapter.gguf").read_bytes()
