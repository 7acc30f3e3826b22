"""Knowledge distillation: the student (the model being trained, with its adapter) learns the
teacher's next-token distribution on the teacher's top-k tokens at every trained position of the
data, optionally mixed with cross-entropy on the data's own tokens. Masks, packing and batching
are SFT's.

The teacher is either a second GGUF with the same vocabulary, run forward-only in this process
(online), or a FILE.topk written beforehand by `retrograd distill-teacher` (offline: the teacher
is never loaded). Both give the same targets, so both give the same loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from retrograd.algorithms.base import GeneratorFactory, MicroBatch, StepWork, Tally, train_batch
from retrograd.algorithms.sft import SFT
from retrograd.batch import LossInputs, LossOutputs
from retrograd.context import RunContext
from retrograd.data.batching import pack, take_step, to_batch
from retrograd.data.topk_file import TopkFile
from retrograd.eval.distill import evaluate_distill
from retrograd.losses.divergences import topk_divergence
from retrograd.losses.nll import nll
from retrograd.teacher import OfflineTeacher, OnlineTeacher, expand, load_teacher


class Distill(SFT):
    def __init__(self, run: RunContext, generators: GeneratorFactory | None = None) -> None:
        super().__init__(run, generators)
        d = run.cfg.distill
        self.d = d
        self.source: OfflineTeacher | OnlineTeacher
        self.eval_source: OfflineTeacher | OnlineTeacher | None
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
            self.source = self.eval_source = OnlineTeacher(
                load_teacher(run.cfg, run.tokenizer, run.trainable.model_path), d.k)

    def next_step(self) -> StepWork:
        t, dcfg, d = self.run.cfg.training, self.run.cfg.data, self.d
        at = self.stream.cursor.to_dict()
        examples = take_step(self.stream, t)
        norm = float(sum(e.n_trained for e in examples))
        micro = []
        for i, group in enumerate(pack(examples, t.micro_batch_tokens, dcfg.packing)):
            batch, _ = to_batch(group)
            ids, tlp = self.source.targets(group, batch)
            n, k = ids.shape
            student = train_batch(expand(batch, ids, d.ce_weight > 0), self.run.cfg, at, i)

            def loss(inp: LossInputs, tally: Tally, tlp=tlp, n=n, k=k) -> LossOutputs:
                value, c, rows = topk_divergence(inp.logp[:n * k].reshape(n, k), tlp, d.divergence,
                                                 d.temperature, norm)
                coeff = [c.reshape(-1)]
                tally.add("loss", value)
                tally.add("kl", float(rows.sum() / norm))
                if d.ce_weight > 0:
                    ce, cc = nll(inp.logp[n * k:], np.full(n, d.ce_weight, np.float32), norm)
                    coeff.append(cc)
                    tally.add("loss", ce)
                    tally.add("ce", ce / d.ce_weight)
                return LossOutputs(np.concatenate(coeff))

            micro.append(MicroBatch(student, loss))
        return StepWork(micro, sum(len(e.tokens) for e in examples),
                        {"trained_tokens": norm, "epoch": self.stream.epoch_progress})

    def close(self) -> None:
        if isinstance(self.source, OnlineTeacher):
            self.source.teacher.close()

    def evaluate(self) -> dict[str, float]:
        if not self.eval_examples:
            return {}
        limit = self.run.cfg.evaluation.limit or len(self.eval_examples)
        return evaluate_distill(self.run.trainable, self.eval_source, self.eval_examples[:limit],
                                self.run.cfg.training.micro_batch_tokens)


