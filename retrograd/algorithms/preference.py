"""Preference training (dpo, ipo, simpo, orpo) on pairs of answers to one prompt.

Each micro-batch holds whole pairs: the prompt once, the chosen and rejected answers both seeing
it (the engine's shared-prefix batches). A pair's loss depends on both answers' summed log-probs,
so the coefficients are computed per pair and spread over its tokens. The reference policy of
dpo/ipo is the base model (adapter off); its sums are computed the first time a pair is used and
kept on the pair, so each pair costs one reference pass per run.
"""

from __future__ import annotations

import numpy as np

from retrograd.algorithms.base import DataRecipe, GeneratorFactory, MicroBatch, StepWork, Tally
from retrograd.batch import LossInputs, LossOutputs
from retrograd.context import RunContext
from retrograd.data.batching import ExampleStream, steps_for, take_step, train_and_eval
from retrograd.data.pairs import load_pairs
from retrograd.eval.pairs import evaluate_pairs, fill_reference
from retrograd.losses.preference import REFERENCE_FREE, implicit_rewards, pair_batches, pair_loss


class Preference(DataRecipe):
    def __init__(self, run: RunContext, generators: GeneratorFactory | None = None) -> None:
        self.run = run
        cfg = run.cfg
        self.p = cfg.preference
        self.need_ref = self.p.loss not in REFERENCE_FREE
        d = cfg.data
        run.require_train_data()
        self.train, self.eval = train_and_eval(
            cfg, lambda path: load_pairs(path, run.tokenizer, run.chat, max_length=min(d.max_length, cfg.model.ctx),
                                         skip_bad=d.skip_bad_lines), "pairs", run.notes)
        self.stream = ExampleStream(self.train, cfg.run.seed, d.shuffle)

    def next_step(self) -> StepWork:
        t = self.run.cfg.training
        pairs = take_step(self.stream, t)
        if self.need_ref:
            fill_reference(self.run.trainable, pairs, t.micro_batch_tokens)
        norm = float(len(pairs))
        micro = []
        for chunk, batch, owner, w in pair_batches(pairs, t.micro_batch_tokens):
            def loss(inp: LossInputs, tally: Tally, chunk=chunk, owner=owner, w=w, p=self.p,
                     need_ref=self.need_ref) -> LossOutputs:
                value, coeff, s = pair_loss(chunk, inp.logp, owner, w, p, need_ref, norm)
                rc, rr = implicit_rewards(s, p.loss, p.beta)
                margin = rc - rr
                tally.add("loss", value)
                tally.add("reward_margin", float(margin.sum() / norm))
                tally.add("reward_accuracy", float((margin > 0).sum() / norm))
                tally.add("chosen_logp", float((s.pc / np.maximum(s.nc, 1)).sum() / norm))
                tally.add("rejected_logp", float((s.pr / np.maximum(s.nr, 1)).sum() / norm))
                return LossOutputs(coeff)

            micro.append(MicroBatch(batch, loss))
        return StepWork(micro, sum(p.n_tokens for p in pairs),
                        {"pairs": norm, "epoch": self.stream.epoch_progress})

    def estimate_steps(self) -> int:
        return steps_for(self.train, self.run.cfg.training, lambda p: p.n_tokens)

    def evaluate(self) -> dict[str, float]:
        if not self.eval:
            return {}
        limit = self.run.cfg.evaluation.limit or len(self.eval)
        return evaluate_pairs(self.run.trainable, self.eval[:limit], self.run.cfg.training.micro_batch_tokens,
                              self.p)
