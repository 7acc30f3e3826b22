"""Distillation: the top-k divergences against numerical derivatives, the engine's top-k and head
temperature against plain log-softmax, gradients through the engine against finite differences,
the top-k file (round trip, refusals), online vs offline equality, and runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from gradcheck import randomize_adapter, richardson
from test_algorithms import numeric_grad

from retrograd import native
from retrograd.config import load
from retrograd.context import open_model
from retrograd.data import tokenizer as tok_mod
from retrograd.data.topk_file import TopkFile, TopkFileError, TopkWriter
from retrograd.engine import LoraSpec, Trainable
from retrograd.losses.divergences import KINDS, topk_divergence
from retrograd.teacher import DistillError, Teacher, check_vocab
from retrograd.trainer import train


# ---- the losses as numpy functions -----------------------------------------------------------
def _rows(seed, n=5, k=6, vocab=40):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (n, vocab))
    full = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ids = np.argsort(-full, axis=1)[:, :k]
    teacher = np.take_along_axis(full, ids, 1)
    other = logits + rng.normal(0, 0.8, logits.shape)            # the student: another full distribution
    other = other - np.log(np.exp(other).sum(1, keepdims=True))
    return np.take_along_axis(other, ids, 1), teacher


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_divergence_coefficients_match_numerical_derivatives(kind, temperature):
    s, t = _rows(0)
    loss, coeff, rows = topk_divergence(s, t, kind, temperature, norm=3.0)
    assert loss == pytest.approx(rows.sum() * temperature**2 / 3.0)
    assert (rows > -1e-12).all()

    def value(x):
        return topk_divergence(x.reshape(s.shape), t, kind, temperature, norm=3.0)[0]

    np.testing.assert_allclose(coeff.ravel(), numeric_grad(value, s.ravel().copy()), rtol=1e-4, atol=1e-7)


def test_divergences_vanish_when_student_equals_teacher():
    _, t = _rows(1)
    for kind in KINDS:
        _, _, rows = topk_divergence(t.copy(), t, kind, 1.0)
        np.testing.assert_allclose(rows, 0.0, atol=1e-12)


def test_forward_kl_is_the_kl_over_the_k_tokens_and_the_tail():
    s, t = _rows(2)
    p = np.concatenate([np.exp(t), 1 - np.exp(t).sum(1, keepdims=True)], 1)
    q = np.concatenate([np.exp(s), 1 - np.exp(s).sum(1, keepdims=True)], 1)
    _, _, rows = topk_divergence(s, t, "forward_kl", 1.0)
    np.testing.assert_allclose(rows, (p * np.log(p / q)).sum(1), rtol=1e-9)


# ---- the engine: top-k, temperature, gradients -------------------------------------------------
def _all_logp(tr, batch, lora=True):
    """log p of every vocabulary entry at every target row, via ordinary targets."""
    V = tr.info.n_vocab
    rows = np.repeat(batch.target_rows, V)
    ids = np.tile(np.arange(V, dtype=np.int32), batch.n_targets)
    b = native.Batch(batch.tokens, batch.positions, batch.seq_ids, rows, ids)
    return tr.logprobs(b, adapter=lora).logp.reshape(batch.n_targets, V).astype(np.float64)


def test_topk_matches_the_full_distribution(tiny):
    tr = Trainable(tiny("llama"), LoraSpec(4, 8.0), threads=THREADS)
    randomize_adapter(tr, 3)
    toks = np.random.default_rng(0).integers(0, 256, 14).astype(np.int32)
    batch = native.Batch.next_token(toks, np.array([0] * 8 + [1] * 6, np.int32))
    full = _all_logp(tr, batch)
    np.testing.assert_allclose(np.exp(full).sum(1), 1.0, rtol=1e-5)
    ids, lp, _ = tr.engine.topk(tr.lora, batch, 5)
    np.testing.assert_array_equal(ids, np.argsort(-full, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(lp, np.take_along_axis(full, ids, 1), atol=2e-5)
    _, _, own = tr.engine.topk(tr.lora, batch, 1, targets=True)      # the targets' log-probs, same pass
    np.testing.assert_allclose(own, tr.logprobs(batch).logp, atol=2e-5)
    base_ids, _, _ = tr.engine.topk(None, batch, 5)
    assert not np.array_equal(base_ids, ids)          # the adapter is applied, or not, as asked
    with pytest.raises(native.NativeError, match="k must be"):
        tr.engine.topk(None, batch, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_distillation_gradient_through_the_engine(tiny, kind):
    """The whole chain (divergence coefficients at temperature 2, the tail included, head and
    backward) against finite differences of the divergence computed from forward passes."""
    path = tiny("llama", n_embd=32, n_ff=48)
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    tr.engine.set_exact_ops(True)
    randomize_adapter(tr, 5)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 256, 12).astype(np.int32)
    base = native.Batch.next_token(toks)
    k = 4
    ids = np.stack([rng.choice(260, k, replace=False) for _ in range(base.n_targets)]).astype(np.int32)
    tlp = np.log(rng.dirichlet(np.ones(k), base.n_targets)) - 0.5
    batch = native.Batch(base.tokens, base.positions, base.seq_ids, np.repeat(base.target_rows, k), ids.ravel())

    def value():
        lp = tr.logprobs(batch).logp.reshape(-1, k)
        return topk_divergence(lp, tlp, kind, 2.0)[0]

    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(batch, lambda inp: native.LossOutputs(
        topk_divergence(inp.logp.reshape(-1, k), tlp, kind, 2.0)[1].ravel()))
    t = tr.lora.index["blk.1.attn_q.weight.lora_b"]
    g = tr.lora.read(t.index, native.SLOT_GRAD).ravel()
    for i in np.argsort(-np.abs(g))[:3]:
        assert richardson(tr, t, value, i) == pytest.approx(g[i], rel=1e-2, abs=1e-6)


# ---- vocabulary checks and the top-k file ---------------------------------------------------------
def test_teacher_with_another_vocabulary_is_refused(tiny):
    a, b = tiny("llama"), tiny("llama", n_vocab=270)
    with pytest.raises(DistillError, match="270 tokens") as e:
        check_vocab(tok_mod.load(str(a)), tok_mod.load(str(b)), a, b)
    assert str(a) in str(e.value) and str(b) in str(e.value)
    check_vocab(tok_mod.load(str(a)), tok_mod.load(str(tiny("qwen2"))), a, a)   # same tokens: fine


def test_topk_file_round_trip_and_refusals(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "t.topk"
    examples = [(3, rng.integers(0, 300, 9).astype(np.int32)), (5, rng.integers(0, 300, 4).astype(np.int32))]
    stored = {}
    with TopkWriter(path, {"k": 3, "n_vocab": 300, "vocab_sha256": "abc", "teacher": "t.gguf"}) as w:
        for line, toks in examples:
            ids = rng.integers(0, 300, (len(toks) - 1, 3)).astype(np.int32)
            lp = -rng.random((len(toks) - 1, 3)).astype(np.float32)
            w.add(line, toks, ids, lp)
            stored[line] = (ids, lp)
    assert not (tmp_path / "t.topk.tmp").exists()
    f = TopkFile(path)
    assert len(f) == 2 and f.k == 3 and f.dtype == np.uint16
    for line, toks in examples:
        ids, lp = f.get(line, toks, len(toks) - 1)
        np.testing.assert_array_equal(ids, stored[line][0])
        np.testing.assert_array_equal(lp, stored[line][1])
    with pytest.raises(TopkFileError, match="does not match"):
        f.get(3, examples[0][1][::-1].copy(), 8)
    with pytest.raises(TopkFileError, match="no record for line 4"):
        f.get(4, examples[0][1], 8)
    with pytest.raises(TopkFileError, match="vocabulary"):
        f.check_vocab(300, "xyz", "student.gguf")
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(TopkFileError, match="truncated"):
        TopkFile(path)


# ---- runs ----------------------------------------------------------------------------------------
def make_distill_run(tmp_path: Path, student: Path, teacher: Path, extra: str = "", steps: int = 8,
                     every: int = 0) -> Path:
    rng = np.random.default_rng(0)
    words = "red green blue cat dog sun moon tree river stone".split()
    recs = [{"text": " ".join(rng.choice(words, 6))} for _ in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[model]
path = "{student}"
ctx = 128
[lora]
rank = 4
alpha = 8.0
[run]
algorithm = "distill"
name = "d"
seed = 0
[data]
train = "train.jsonl"
eval_split = 0.2
shuffle = false
[training]
max_steps = {steps}
batch_size = 4
micro_batch_tokens = 64
learning_rate = 1e-2
lr_schedule = "constant"
threads = {THREADS}
[checkpoint]
every_steps = {every}
[evaluation]
every_steps = 4
[distill]
teacher = "{teacher}"
k = 8
{extra}
""")
    return cfg


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow          # an online run, the teacher's file, an offline run
def test_distill_run_lowers_kl_and_offline_equals_online(tiny, tmp_path):
    student, teacher = tiny("llama", seed=0), tiny("llama", seed=7)
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir()
    off.mkdir()
    cfg_on = make_distill_run(on, student, teacher, "temperature = 1.5\nce_weight = 0.3")
    train(open_model(load(cfg_on)))
    m_on = _metrics(on / "runs" / "d")
    evals = [r for r in m_on if "eval_kl" in r]
    assert evals[0]["step"] == 0 and evals[-1]["eval_kl"] < 0.8 * evals[0]["eval_kl"]
    assert evals[-1]["eval_top1"] >= evals[0]["eval_top1"]
    # offline: the teacher's file, then the same run without loading the teacher
    cfg_off = make_distill_run(off, student, teacher, 'temperature = 1.5\nce_weight = 0.3\nteacher_file = "t.topk"')
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "distill-teacher", str(cfg_off), "--k", "8"],
                         capture_output=True, text=True, env={**os.environ, "RETRO_THREADS": str(THREADS)})
    assert out.returncode == 0, out.stderr
    assert (off / "t.topk").exists() and "wrote" in out.stdout
    cfg = load(cfg_off)
    cfg.distill.teacher = None               # proves the teacher is not needed
    train(open_model(cfg))
    m_off = _metrics(off / "runs" / "d")
    loss_on = [r["loss"] for r in m_on if "loss" in r]
    loss_off = [r["loss"] for r in m_off if "loss" in r]
    np.testing.assert_allclose(loss_off, loss_on, rtol=1e-5)


def test_offline_file_for_other_data_is_refused(tiny, tmp_path):
    student = tiny("llama", seed=0)
    cfg = make_distill_run(tmp_path, student, tiny("llama", seed=7), 'teacher_file = "t.topk"')
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "distill-teacher", str(cfg)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"text": "something else entirely"})
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "train", str(cfg)], capture_output=True, text=True)
    assert out.returncode == 1 and "does not match" in out.stderr and "Traceback" not in out.stderr


def test_distill_teacher_model_is_the_student_and_teacher_names_the_teacher(tiny, tmp_path):
    """--model is the common flag: it replaces the student's [model].path. The teacher is --teacher,
    else [distill].teacher; a teacher that is the student's own file is refused before anything loads."""
    student, teacher, other = tiny("llama", seed=0), tiny("llama", seed=7), tiny("llama", seed=3)
    cfg = make_distill_run(tmp_path, student, teacher, 'teacher_file = "t.topk"')
    topk = tmp_path / "t.topk"

    def distill_teacher(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "retrograd.cli", "distill-teacher", str(cfg), *extra],
                              capture_output=True, text=True, env={**os.environ, "RETRO_THREADS": str(THREADS)})

    out = distill_teacher("--model", str(teacher))        # the student is now the configured teacher
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"the teacher {teacher} ([distill].teacher) is the student's model (--model)" in out.stderr
    assert not topk.exists()
    link = tmp_path / "same.gguf"                         # one file under another name is the same file
    link.symlink_to(student)
    out = distill_teacher("--teacher", str(link))
    assert out.returncode == 2 and "(--teacher) is the student's model ([model].path)" in out.stderr, out.stderr
    out = distill_teacher("--teacher", str(other), "--model", str(teacher))
    assert out.returncode == 0, out.stderr
    assert TopkFile(topk).header["teacher"] == other.name
    out = distill_teacher()                               # the configuration's own teacher
    assert out.returncode == 0, out.stderr
    assert TopkFile(topk).header["teacher"] == teacher.name


def test_teacher_topk_equals_student_topk_for_the_same_model(tiny):
    path = tiny("gemma3")
    tr = Trainable(path, LoraSpec(4, 8.0), threads=THREADS)
    te = Teacher(path, threads=THREADS)
    batch = native.Batch.next_token(np.random.default_rng(3).integers(0, 256, 10).astype(np.int32))
    a, b = tr.engine.topk(None, batch, 4), te.topk(batch, 4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.slow          # three training runs
def test_distill_resume_matches_uninterrupted(tiny, tmp_path):
    student, teacher = tiny("llama", seed=0), tiny("llama", seed=7)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    train(open_model(load(make_distill_run(a, student, teacher, "divergence = \"jsd\"", steps=4, every=1))))
    train(open_model(load(make_distill_run(b, student, teacher, "divergence = \"jsd\"", steps=2, every=1))))
    train(open_model(load(make_distill_run(b, student, teacher, "divergence = \"jsd\"", steps=4, every=1))),
          resume=True)
    la = {r["step"]: r["loss"] for r in _metrics(a / "runs" / "d") if "loss" in r}
    lb = {r["step"]: r["loss"] for r in _metrics(b / "runs" / "d") if "loss" in r}
    assert sorted(lb) == [1, 2, 3, 4]
    for step, value in la.items():
        assert lb[step] == pytest.approx(value, rel=1e-6)
    assert (a / "runs/d/adapter.gguf").read_bytes() == (b / "runs/d/adapter.gguf").read_bytes()


def test_offline_evaluation_reads_its_own_file(tiny, tmp_path):
    student, teacher = tiny("llama", seed=0), tiny("llama", seed=7)
    cfg = make_distill_run(tmp_path, student, teacher, 'teacher_file = "t.topk"\neval_teacher_file = "e.topk"',
                           steps=2)
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": f"moon river stone {i}"}) + "\n"
                                                 for i in range(3)))
    cfg.write_text(cfg.read_text().replace("[evaluation]", '[evaluation]\ndata = "eval.jsonl"'))
    env = {**os.environ, "RETRO_THREADS": str(THREADS)}
    for extra in ([], ["--data", str(tmp_path / "eval.jsonl"), "--out", str(tmp_path / "e.topk")]):
        out = subprocess.run([sys.executable, "-m", "retrograd.cli", "distill-teacher", str(cfg), *extra],
                             capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "train", str(cfg)], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "final evaluation:" in out.stdout and " top1 " in out.stdout and " kl " in out.stdout
    evals = [r for r in _metrics(tmp_path / "runs" / "d") if "eval_kl" in r]
    assert evals and evals[-1]["eval_examples"] == 3
