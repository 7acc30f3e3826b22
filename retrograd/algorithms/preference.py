"""Preference training (dpo, ipo, simpo, orpo) on pairs of answers to one prompt.

Each micro-batch holds whole pairs: the prompt once, the chosen and rejected answers both seeing
it (the engine's shared-prefix batches). A pair's loss depends on both answers' summed log-probs,
so the coefficients are computed per pair and spread over its tokens. The reference policy of
dpo/ipo is the base model (adapter off); its sums are computed the first time a pair is used and
kept on the pair, so each pair costs one reference pass per run.
"""

from __future__ import annotations

import math

import numpy as np

from retrograd.algorithms import MicroBatch, StepWork
from retrograd.algorithms.preference_losses import REFERENCE_FREE, PairStats, implicit_rewards, preference_loss
from retrograd.data.batching import ExampleStream, group_batch, pack_groups, train_and_eval
from retrograd.data.formats import DataError
from retrograd.data.pairs import Pair, load_pairs
from retrograd.native import LossInputs, LossOutputs


def pair_batches(pairs: list[Pair], budget: int):
    """(pairs of the micro-batch, batch, owner, weights) with owner 2j / 2j+1 = pair j's chosen / rejected."""
    for idx in pack_groups([p.group for p in pairs], budget):
        chunk = [pairs[i] for i in idx]
        batch, owner = group_batch([p.group for p in chunk])
        w = np.concatenate([x for p in chunk for x in (p.chosen_w, p.rejected_w)])
        yield chunk, batch, owner, w


def sums(logp: np.ndarray, owner: np.ndarray, w: np.ndarray, n_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    s = np.bincount(owner, weights=w * logp.astype(np.float64), minlength=2 * n_pairs)
    return s[0::2], s[1::2]


def fill_reference(trainable, pairs: list[Pair], budget: int) -> None:
    todo = [p for p in pairs if p.ref is None]
    for chunk, batch, owner, w in pair_batches(todo, budget):
        rc, rr = sums(trainable.logprobs(batch, adapter=False).logp, owner, w, len(chunk))
        for p, a, b in zip(chunk, rc, rr):
            p.ref = (float(a), float(b))


def stats_for(chunk: list[Pair], logp: np.ndarray, owner: np.ndarray, w: np.ndarray, need_ref: bool) -> PairStats:
    pc, pr = sums(logp, owner, w, len(chunk))
    nc = np.array([p.chosen_w.sum() for p in chunk])
    nr = np.array([p.rejected_w.sum() for p in chunk])
    if not need_ref:
        return PairStats(pc, pr, nc, nr)
    return PairStats(pc, pr, nc, nr, np.array([p.ref[0] for p in chunk]), np.array([p.ref[1] for p in chunk]))


def pair_loss(chunk: list[Pair], logp: np.ndarray, owner: np.ndarray, w: np.ndarray, p, need_ref: bool,
              norm: float = 1.0) -> tuple[float, np.ndarray, PairStats]:
    """One micro-batch of pairs: the loss, d(loss)/d(logp) per target (each answer's coefficient
    on each of its trained tokens) and the pairs' statistics. p is the [preference] section."""
    s = stats_for(chunk, logp, owner, w, need_ref)
    value, gc, gr, _ = preference_loss(s, p.loss, p.beta, gamma=p.simpo_gamma, lam=p.orpo_lambda, norm=norm)
    per_seq = np.empty(2 * len(chunk))
    per_seq[0::2], per_seq[1::2] = gc, gr
    return value, (per_seq[owner] * w).astype(np.float32), s


class Preference:
    def __init__(self, run) -> None:
        self.run = run
        cfg = run.cfg
        self.p = cfg.preference
        self.need_ref = self.p.loss not in REFERENCE_FREE
        d = cfg.data
        if d.train is None:
            raise DataError(f"{cfg.source or '<config>'}: [data].train is required for preference")
        self.train, self.eval = train_and_eval(
            cfg, lambda path: load_pairs(path, run.tokenizer, run.chat, max_length=min(d.max_length, cfg.model.ctx),
                                         skip_bad=d.skip_bad_lines), "pairs", run.notes)
        self.stream = ExampleStream(self.train, cfg.run.seed, d.shuffle)

    def next_step(self) -> StepWork:
        t = self.run.cfg.training
        if t.batch_tokens:
            pairs = self.stream.take(tokens=t.batch_tokens * t.grad_accum)
        else:
            pairs = self.stream.take(n=t.batch_size * t.grad_accum)
        if self.need_ref:
            fill_reference(self.run.trainable, pairs, t.micro_batch_tokens)
        norm = float(len(pairs))
        micro = []
        for chunk, batch, owner, w in pair_batches(pairs, t.micro_batch_tokens):
            def loss(inp: LossInputs, chunk=chunk, owner=owner, w=w) -> tuple[LossOutputs, dict]:
                value, coeff, s = pair_loss(chunk, inp.logp, owner, w, self.p, self.need_ref, norm)
                rc, rr = implicit_rewards(s, self.p.loss, self.p.beta)
                margin = rc - rr
                return LossOutputs(coeff), {
                    "loss": value, "reward_margin": float(margin.sum() / norm),
                    "reward_accuracy": float((margin > 0).sum() / norm),
                    "chosen_logp": float((s.pc / np.maximum(s.nc, 1)).sum() / norm),
                    "rejected_logp": float((s.pr / np.maximum(s.nr, 1)).sum() / norm)}

            micro.append(MicroBatch(batch, loss))
        return StepWork(micro, sum(p.n_tokens for p in pairs),
                        {"pairs": norm, "epoch": self.stream.epoch_progress})

    def estimate_steps(self) -> int:
        t = self.run.cfg.training
        if t.batch_tokens:
            total = sum(p.n_tokens for p in self.train)
            return max(1, math.ceil(t.epochs * total / (t.batch_tokens * t.grad_accum)))
        return max(1, math.ceil(t.epochs * len(self.train) / (t.batch_size * t.grad_accum)))

    def evaluate(self, adapter: bool = True) -> dict[str, float]:
        if not self.eval:
            return {}
        limit = self.run.cfg.evaluation.limit or len(self.eval)
        return evaluate_pairs(self.run.trainable, self.eval[:limit], self.run.cfg.training.micro_batch_tokens,
                              self.p, adapter=adapter)

    def state_dict(self) -> dict:
        return {"cursor": self.stream.cursor.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.seek(state.get("cursor", {}))


def evaluate_pairs(trainable, pairs: list[Pair], budget: int, p, adapter: bool = True) -> dict[str, float]:
    """Held-out pairs: the loss; preference accuracy (the model gives the chosen answer a higher mean
    log-prob per token than the rejected one; meaningful for the base model too); and the implicit
    reward margin and how often it is positive."""
    need_ref = p.loss not in REFERENCE_FREE
    if need_ref:
        fill_reference(trainable, pairs, budget)
    total = margin = acc = racc = 0.0
    for chunk, batch, owner, w in pair_batches(pairs, budget):
        s = stats_for(chunk, trainable.logprobs(batch, adapter=adapter).logp, owner, w, need_ref)
        value, _, _, per = preference_loss(s, p.loss, p.beta, gamma=p.simpo_gamma, lam=p.orpo_lambda)
        rc, rr = implicit_rewards(s, p.loss, p.beta)
        total += per.sum()
        margin += (rc - rr).sum()
        racc += ((rc - rr) > 0).sum()
        acc += (s.pc / np.maximum(s.nc, 1) > s.pr / np.maximum(s.nr, 1)).sum()
    n = max(len(pairs), 1)
    return {"eval_loss": total / n, "eval_pref_accuracy": acc / n, "eval_reward_margin": margin / n,
            "eval_reward_accuracy": racc / n, "eval_examples": float(len(pairs))}
