"""Preference pairs measured on held-out data: the loss, how often the model prefers the chosen
answer, and the implicit reward margin; and the reference policy's sums that dpo/ipo need."""

from __future__ import annotations

import numpy as np

from retrograd.data.pairs import Pair
from retrograd.losses.preference import REFERENCE_FREE, implicit_rewards, pair_batches, preference_loss, stats_for, sums


def fill_reference(trainable, pairs: list[Pair], budget: int) -> None:
    todo = [p for p in pairs if p.ref is None]
    for chunk, batch, owner, w in pair_batches(todo, budget):
        rc, rr = sums(trainable.reference_logprobs(batch).logp, owner, w, len(chunk))
        for p, a, b in zip(chunk, rc, rr):
            p.ref = (float(a), float(b))


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
