"""Distillation measured on held-out data: KL to the teacher on its top-k, top-1 agreement, and
the data's perplexity."""

from __future__ import annotations

import math

import numpy as np

from retrograd.data.batching import pack, to_batch
from retrograd.losses.divergences import topk_divergence
from retrograd.teacher import expand


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
