"""Held-out negative log-likelihood and perplexity of the trained tokens."""

from __future__ import annotations

import math

import numpy as np

from retrograd.data.batching import pack, to_batch


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
