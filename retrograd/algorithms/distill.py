"""Knowledge distillation: the student (the model being trained, with its adapter) learns the
teacher's next-token distribution on the teacher's top-k tokens at every trained position of the
data, optionally mixed with cross-entropy on the data's own tokens. Masks, packing and batching
are SFT's.

The teacher is either a second GGUF with the same vocabulary, run forward-only in this process
(online), or a FILE.topk written beforehand by `retrograd distill-teacher` (offline: the teacher
is never loaded). Both give the same targets, so both give the same loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from retrograd.algorithms import MicroBatch, StepWork
from retrograd.algorithms.divergences import topk_divergence
from retrograd.algorithms.sft import SFT, nll
from retrograd.data.batching import pack, to_batch
from retrograd.data.topk_file import TopkFile, TopkFileError
from retrograd.native import Batch, LossInputs, LossOutputs


class DistillError(ValueError):
    pass


def check_vocab(student_tok, teacher_tok, student: Path, teacher: Path) -> None:
    if student_tok.n_vocab != teacher_tok.n_vocab:
        raise DistillError(f"the teacher {teacher} has {teacher_tok.n_vocab} tokens and the student {student} "
                           f"{student_tok.n_vocab}: distillation needs the same vocabulary")
    if student_tok.vocab_sha256() != teacher_tok.vocab_sha256():
        raise DistillError(f"the teacher {teacher} and the student {student} have vocabularies of the same size "
                           "but different tokens: distillation needs the same vocabulary")


class OnlineTeacher:
    def __init__(self, teacher, k: int) -> None:
        self.teacher, self.k = teacher, k

    def targets(self, group, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        return self.teacher.topk(batch, self.k)


class OfflineTeacher:
    def __init__(self, files: list[TopkFile], k: int) -> None:
        for f in files:
            if f.k < k:
                raise DistillError(f"{f.path}: holds the top {f.k} tokens per position, [distill].k asks for {k}")
        self.files, self.k = files, k

    def targets(self, group, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        ids, lps = [], []
        for ex in group:
            err = None
            for f in self.files:
                try:
                    i, lp = f.get(ex.line, ex.tokens, ex.n_trained)
                    break
                except TopkFileError as exc:
                    err = err or exc
            else:
                raise err
            ids.append(i[:, :self.k])
            lps.append(lp[:, :self.k])
        return np.concatenate(ids), np.concatenate(lps)


def expand(batch: Batch, ids: np.ndarray, with_data: bool) -> Batch:
    """The student's targets: the teacher's k ids at every row, then (optionally) the data tokens."""
    rows = np.repeat(batch.target_rows, ids.shape[1])
    tid = ids.reshape(-1)
    if with_data:
        rows = np.concatenate([rows, batch.target_rows])
        tid = np.concatenate([tid, batch.target_ids])
    return Batch(batch.tokens, batch.positions, batch.seq_ids, rows, tid)


class Distill(SFT):
    def __init__(self, run) -> None:
        super().__init__(run)
        d = run.cfg.distill
        self.d = d
        if d.teacher_file:
            files = [TopkFile(Path(d.teacher_file))]
            if d.eval_teacher_file:
                files.append(TopkFile(Path(d.eval_teacher_file)))
            for f in files:
                f.check_vocab(run.tokenizer.n_vocab, run.tokenizer.vocab_sha256(), str(run.trainable.model_path))
            self.source = OfflineTeacher(files, d.k)
            self.eval_source = self.source if (d.eval_teacher_file or not run.cfg.evaluation.data) else None
            if self.eval_source is None:
                run.notes.append("offline distillation without [distill].eval_teacher_file: evaluation reports "
                                 "perplexity only (no KL or top-1 agreement for [evaluation].data)")
        else:
            self.source = self.eval_source = OnlineTeacher(load_teacher(run), d.k)

    def next_step(self) -> StepWork:
        t, dcfg, d = self.run.cfg.training, self.run.cfg.data, self.d
        examples = self._take()
        norm = float(sum(e.n_trained for e in examples))
        micro = []
        for group in pack(examples, t.micro_batch_tokens, dcfg.packing):
            batch, _ = to_batch(group)
            ids, tlp = self.source.targets(group, batch)
            n, k = ids.shape
            student = expand(batch, ids, d.ce_weight > 0)

            def loss(inp: LossInputs, tlp=tlp, n=n, k=k) -> tuple[LossOutputs, dict]:
                value, c, rows = topk_divergence(inp.logp[:n * k].reshape(n, k), tlp, d.divergence,
                                                 d.temperature, norm)
                coeff = [c.reshape(-1)]
                m = {"loss": value, "kl": float(rows.sum() / norm)}
                if d.ce_weight > 0:
                    ce, cc = nll(inp.logp[n * k:], np.full(n, d.ce_weight, np.float32), norm)
                    coeff.append(cc)
                    m["loss"] += ce
                    m["ce"] = ce / d.ce_weight
                return LossOutputs(np.concatenate(coeff)), m

            micro.append(MicroBatch(student, loss))
        return StepWork(micro, sum(len(e.tokens) for e in examples),
                        {"trained_tokens": norm, "epoch": self.stream.epoch_progress})

    def evaluate(self, adapter: bool = True) -> dict[str, float]:
        if not self.eval_examples:
            return {}
        limit = self.run.cfg.evaluation.limit or len(self.eval_examples)
        return evaluate_distill(self.run.trainable, self.eval_source, self.eval_examples[:limit],
                                self.run.cfg.training.micro_batch_tokens, adapter=adapter)


def load_teacher(run):
    """The configured teacher GGUF (default: the embedded default model), vocabulary checked."""
    from retrograd.data import tokenizer as tok_mod
    from retrograd.engine import Teacher
    from retrograd.models import default_model_path
    from retrograd.trainer import resolve_threads

    path = Path(run.cfg.distill.teacher) if run.cfg.distill.teacher else default_model_path()
    check_vocab(run.tokenizer, tok_mod.load(str(path)), run.trainable.model_path, path)
    return Teacher(path, device=run.cfg.model.device, threads=resolve_threads(run.cfg))


def evaluate_distill(trainable, source, examples, budget: int, adapter: bool = True) -> dict[str, float]:
    """At temperature 1: forward KL to the teacher on its top-k (eval_loss, eval_kl), top-1
    agreement, and the data's negative log-likelihood and perplexity. Without a teacher source,
    only the last two."""
    lora = trainable.lora if adapter else None
    kl = nll_sum = 0.0
    agree = count = 0
    for group in pack(examples, budget, True):
        batch, _ = to_batch(group)
        n = batch.n_targets
        if source is None:
            lp = trainable.engine.forward(lora, batch).logp.astype(np.float64)
            nll_sum += -lp.sum()
            count += n
            continue
        ids, tlp = source.targets(group, batch)
        k = ids.shape[1]
        # one pass: the log-probs of the teacher's tokens and of the data, and the student's top 1
        top1, _, lp = trainable.engine.topk(lora, expand(batch, ids, True), 1, targets=True)
        _, _, rows = topk_divergence(lp[:n * k].reshape(n, k), tlp, "forward_kl", 1.0)
        kl += rows.sum()
        nll_sum += -lp[n * k:].astype(np.float64).sum()
        agree += int((top1[n * k:, 0] == ids[:, 0]).sum())      # the data targets are one per row, in order
        count += n
    count = max(count, 1)
    out = {"eval_nll": nll_sum / count, "eval_ppl": math.exp(min(nll_sum / count, 50.0)),
           "eval_tokens": float(count), "eval_examples": float(len(examples))}
    if source is not None:
        out.update({"eval_loss": kl / count, "eval_kl": kl / count, "eval_top1": agree / count})
    else:
        out["eval_loss"] = out["eval_nll"]
    return out
