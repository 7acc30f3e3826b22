"""Supervised fine-tuning: masked cross-entropy on the trained tokens (assistant turns, completions,
or all text), averaged over the trained tokens of the optimizer step."""

from __future__ import annotations

import numpy as np

from retrograd.algorithms.base import DataRecipe, GeneratorFactory, MicroBatch, StepWork, Tally, micro_seed, train_batch
from retrograd.batch import LossInputs, LossOutputs
from retrograd.context import RunContext
from retrograd.data.batching import ExampleStream, pack, steps_for, take_step, to_batch
from retrograd.eval.nll import evaluate_nll
from retrograd.losses.nll import nll


def neftune_noise(seq_ids: np.ndarray, n_embd: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """NEFTune's noise for a packed batch: uniform in +-alpha / sqrt(L * d) per entry, L the length of
    the row's own sequence (packing must not shrink the noise of short examples)."""
    _, inverse, counts = np.unique(seq_ids, return_inverse=True, return_counts=True)
    scale = alpha / np.sqrt(counts[inverse].astype(np.float64) * n_embd)
    return (rng.uniform(-1.0, 1.0, (len(seq_ids), n_embd)) * scale[:, None]).astype(np.float32)


class SFT(DataRecipe):
    def __init__(self, run: RunContext, generators: GeneratorFactory | None = None) -> None:
        self.run = run
        cfg = run.cfg
        self.train_examples = run.train_examples
        self.eval_examples = run.eval_examples
        self.stream = ExampleStream(self.train_examples, cfg.run.seed, cfg.data.shuffle)

    def next_step(self) -> StepWork:
        t, d = self.run.cfg.training, self.run.cfg.data
        at = self.stream.cursor.to_dict()      # noise and dropout masks depend on where the step starts: resumable
        examples = take_step(self.stream, t)
        norm = float(sum(e.n_trained for e in examples))
        micro = []
        for i, group in enumerate(pack(examples, t.micro_batch_tokens, d.packing)):
            batch = train_batch(to_batch(group)[0], self.run.cfg, at, i)
            if t.neftune_alpha > 0:
                batch.embed_noise = neftune_noise(batch.seq_ids, self.run.trainable.info.n_embd, t.neftune_alpha,
                                                  np.random.default_rng(micro_seed(self.run.cfg, at, i)))
            w = np.ones(batch.n_targets, np.float32)

            def loss(inp: LossInputs, tally: Tally, w=w) -> LossOutputs:
                value, coeff = nll(inp.logp, w, norm)
                tally.add("loss", value)
                return LossOutputs(coeff)

            micro.append(MicroBatch(batch, loss))
        return StepWork(micro, sum(len(e.tokens) for e in examples),
                        {"trained_tokens": norm, "epoch": self.stream.epoch_progress})

    def estimate_steps(self) -> int:
        return steps_for(self.train_examples, self.run.cfg.training, lambda e: len(e.tokens))

    def evaluate(self) -> dict[str, float]:
        if not self.eval_examples:
            return {}
        limit = self.run.cfg.evaluation.limit or len(self.eval_examples)
        return evaluate_nll(self.run.trainable, self.eval_examples[:limit], self.run.cfg.training.micro_batch_tokens)
