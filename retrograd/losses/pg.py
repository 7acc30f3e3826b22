"""Policy-gradient losses over per-token log-probs, each returning (loss, d loss / d logp, stats).

All variants share the clipped importance-weighted objective of PPO/GRPO,
    o_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A),   r_t = exp(logp_t - old_t),
and differ in how tokens are weighted (or, for GSPO, in using one ratio per sequence):
    grpo     mean over each sequence's tokens, then over sequences
    dr_grpo  sum over tokens / (sequences x max_new_tokens): no length bias
    dapo     mean over all tokens of the step (token level)
    gspo     sequence ratio s_i = exp(mean_t(logp - old)), clipped per sequence
A KL penalty to the reference policy (k3 estimator, exp(ref - logp) - (ref - logp) - 1) is added
with coefficient beta and the same token weights. These functions are the loss: the engine only
backpropagates the coefficients they return.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VARIANTS = ("grpo", "dr_grpo", "dapo", "gspo")


@dataclass
class PGBatch:
    """Per-token arrays of one micro-batch (float64 is used inside)."""

    logp: np.ndarray        # current policy, per target token
    old: np.ndarray         # policy that sampled (detached)
    adv: np.ndarray         # advantage of the token's sequence
    seq: np.ndarray         # sequence index of each token (global within the step)
    ref: np.ndarray | None  # reference policy (base model), when beta > 0


@dataclass
class PGConfig:
    variant: str = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    n_seqs: int = 1                # sequences in the whole optimizer step
    n_tokens: int = 1              # completion tokens in the whole step (dapo)
    max_new_tokens: int = 1        # dr_grpo's constant
    lengths: np.ndarray | None = None   # completion length of every sequence of the step


def token_weights(b: PGBatch, c: PGConfig) -> np.ndarray:
    if c.variant in ("grpo", "gspo"):
        if c.lengths is None:
            raise ValueError(f"loss variant {c.variant} weights a token by its sequence's length: set lengths")
        return 1.0 / (c.n_seqs * c.lengths[b.seq])
    if c.variant == "dr_grpo":
        return np.full(len(b.logp), 1.0 / (c.n_seqs * c.max_new_tokens))
    if c.variant == "dapo":
        return np.full(len(b.logp), 1.0 / c.n_tokens)
    raise ValueError(f"unknown loss variant {c.variant!r}; expected one of {', '.join(VARIANTS)}")


def kl_k3(logp: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token KL estimate and its derivative with respect to logp."""
    d = ref - logp
    e = np.exp(d)
    return e - d - 1.0, 1.0 - e


def policy_loss(b: PGBatch, c: PGConfig) -> tuple[float, np.ndarray, dict]:
    logp, old, adv = (np.asarray(x, np.float64) for x in (b.logp, b.old, b.adv))
    w = token_weights(b, c)
    lo, hi = 1.0 - c.eps_low, 1.0 + c.eps_high
    if c.variant == "gspo":
        seqs, inv = np.unique(b.seq, return_inverse=True)
        mean_log_ratio = np.bincount(inv, logp - old) / np.bincount(inv)
        s = np.exp(mean_log_ratio)                       # one ratio per sequence
        a_seq = np.bincount(inv, adv) / np.bincount(inv)
        unclipped = s * a_seq
        clipped = np.clip(s, lo, hi) * a_seq
        use = unclipped <= clipped
        obj_seq = np.where(use, unclipped, clipped)
        # loss -sum_i obj_i / n_seqs; d obj_i / d logp_t = s_i A_i / |o_i| on the unclipped branch
        n_i = np.bincount(inv)
        loss = float(-(obj_seq.sum()) / c.n_seqs)
        coeff = -np.where(use, unclipped, 0.0)[inv] / n_i[inv] / c.n_seqs
        clip_frac = float((~use & (unclipped != clipped)).mean()) if len(seqs) else 0.0
    else:
        r = np.exp(logp - old)
        unclipped = r * adv
        clipped = np.clip(r, lo, hi) * adv
        use = unclipped <= clipped
        obj = np.where(use, unclipped, clipped)
        loss = float(-(w * obj).sum())
        coeff = -w * np.where(use, unclipped, 0.0)
        clip_frac = float((~use & (unclipped != clipped)).mean()) if len(r) else 0.0
    stats = {"clip_frac": clip_frac}
    if c.beta > 0 and b.ref is not None:
        kl, dkl = kl_k3(logp, np.asarray(b.ref, np.float64))
        loss += float(c.beta * (w * kl).sum())
        coeff = coeff + c.beta * w * dkl
        stats["kl"] = float(kl.mean()) if len(kl) else 0.0
    return loss, coeff.astype(np.float32), stats


def group_advantages(rewards: np.ndarray, group: np.ndarray, scale: bool = True, eps: float = 1e-4) -> np.ndarray:
    """Rewards centred on their group's mean, divided by the group's std when `scale`."""
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for g in np.unique(group):
        m = group == g
        centred = rewards[m] - rewards[m].mean()
        out[m] = centred / (rewards[m].std() + eps) if scale else centred
    return out


def ppo_loss(logp, old, adv, values, old_values, returns, cliprange: float, cliprange_value: float,
             vf_coef: float, n_tokens: int) -> tuple[float, np.ndarray, np.ndarray, dict]:
    """PPO's clipped policy loss (policy_loss with token-level weights 1/n_tokens, no KL term: PPO
    folds its KL into the rewards) plus the clipped value loss, both averaged over the step's
    n_tokens. Returns the loss, d loss/d logp, d loss/d value, and stats."""
    values, old_values, returns = (np.asarray(x, np.float64) for x in (values, old_values, returns))
    seq = np.zeros(len(values), np.int64)
    pg, d_logp, st = policy_loss(PGBatch(logp, old, adv, seq, None),
                                 PGConfig("dapo", cliprange, cliprange, 0.0, n_tokens=n_tokens))
    v_clip = old_values + np.clip(values - old_values, -cliprange_value, cliprange_value)
    l1, l2 = (values - returns) ** 2, (v_clip - returns) ** 2
    take1 = l1 >= l2
    vl = 0.5 * np.maximum(l1, l2)
    inside = np.abs(values - old_values) < cliprange_value
    d_value = vf_coef * np.where(take1, values - returns, np.where(inside, v_clip - returns, 0.0)) / n_tokens
    value_loss = float(vl.sum() / n_tokens)
    return pg + vf_coef * value_loss, d_logp, d_value, {"pg_loss": pg, "value_loss": value_loss,
                                                        "clip_frac": st["clip_frac"]}
