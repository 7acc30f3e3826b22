"""Supervised fine-tuning: masked cross-entropy on the trained tokens (assistant turns, completions,
or all text), averaged over the trained tokens of the optimizer step."""

from __future__ import annotations

import math

import numpy as np

from retrograd.algorithms import MicroBatch, StepWork
from retrograd.data.batching import ExampleStream, pack, to_batch
from retrograd.native import LossInputs, LossOutputs


def nll(logp: np.ndarray, weights: np.ndarray, norm: float) -> tuple[float, np.ndarray]:
    """Loss sum(-w * logp) / norm and its coefficients d(loss)/d(logp)."""
    coeff = (-weights / norm).astype(np.float32)
    return float(np.dot(coeff.astype(np.float64), logp.astype(np.float64))), coeff


class SFT:
    def __init__(self, run) -> None:
        self.run = run
        cfg = run.cfg
        self.train_examples = run.train_examples
        self.eval_examples = run.eval_examples
        self.stream = ExampleStream(self.train_examples, cfg.run.seed, cfg.data.shuffle)

    # ---- the step ------------------------------------------------------------------------------
    def _take(self):
        t = self.run.cfg.training
        if t.batch_tokens:
            return self.stream.take(tokens=t.batch_tokens * t.grad_accum)
        return self.stream.take(n=t.batch_size * t.grad_accum)

    def next_step(self) -> StepWork:
        t, d = self.run.cfg.training, self.run.cfg.data
        examples = self._take()
        norm = float(sum(e.n_trained for e in examples))
        micro = []
        for group in pack(examples, t.micro_batch_tokens, d.packing):
            batch, _ = to_batch(group)
            w = np.ones(batch.n_targets, np.float32)

            def loss(inp: LossInputs, w=w) -> tuple[LossOutputs, dict]:
                value, coeff = nll(inp.logp, w, norm)
                return LossOutputs(coeff), {"loss": value}

            micro.append(MicroBatch(batch, loss))
        return StepWork(micro, sum(len(e.tokens) for e in examples),
                        {"trained_tokens": norm, "epoch": self.stream.epoch_progress})

    def estimate_steps(self) -> int:
        t = self.run.cfg.training
        if t.batch_tokens:
            total = sum(len(e.tokens) for e in self.train_examples)
            per_step = t.batch_tokens * t.grad_accum
        else:
            total, per_step = len(self.train_examples), t.batch_size * t.grad_accum
        return max(1, math.ceil(t.epochs * total / per_step))

    # ---- evaluation ----------------------------------------------------------------------------
    def evaluate(self, adapter: bool = True) -> dict[str, float]:
        if not self.eval_examples:
            return {}
        limit = self.run.cfg.evaluation.limit or len(self.eval_examples)
        return evaluate_nll(self.run.trainable, self.eval_examples[:limit], self.run.cfg.training.micro_batch_tokens,
                            adapter=adapter)

    # ---- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"cursor": self.stream.cursor.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.seek(state.get("cursor", {}))


def evaluate_nll(trainable, examples, budget: int, adapter: bool = True) -> dict[str, float]:
    """Mean negative log-likelihood per trained token and perplexity."""
    total, count = 0.0, 0
    for group in pack(examples, budget, True):
        batch, _ = to_batch(group)
        lp = trainable.logprobs(batch, adapter=adapter).logp.astype(np.float64)
        total += -lp.sum()
        count += len(lp)
    mean = total / max(count, 1)
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_tokens": float(count),
            "eval_examples": float(len(examples))}
