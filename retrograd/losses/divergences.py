"""Distillation losses on the teacher's top-k tokens, as (loss, d(loss)/d(student log-prob)).

Per trained position the teacher gives its k most likely next tokens and their log-probs (full-
vocabulary normalised, temperature 1). Both models' distributions are compared on k + 1 outcomes:
the k tokens and "any other token" (the tail, 1 minus the k probabilities). On those outcomes
both are proper distributions, so every divergence is zero exactly when the student gives each
of the k tokens, and the rest of the vocabulary as a whole, the teacher's probability (a student
is not pushed to drop the tail the teacher keeps).

A temperature T softens both (k+1)-outcome distributions alike: p_T = softmax(log p / T). Then

  forward_kl  KL(p_T || q_T)                   mean seeking (the default)
  reverse_kl  KL(q_T || p_T)                   mode seeking
  jsd         (KL(p_T || m) + KL(q_T || m)) / 2,  m = (p_T + q_T) / 2

each times T^2 (so gradients keep their size across temperatures, as in Hinton et al. 2015),
summed over positions and divided by `norm`. The student's inputs are its temperature-1 log-probs
of the k tokens, which the engine's LM head gives directly; the coefficients are the derivatives
with respect to those, the tail's dependence included. The tests check them against numerical
derivatives and check the whole chain through the engine against finite differences.
"""

from __future__ import annotations

import numpy as np

KINDS = ("forward_kl", "reverse_kl", "jsd")
TAIL_FLOOR = 1e-7      # float32 log-probs can sum to a hair above 1; the tail never goes below this


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def with_tail(logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, k] log-probs -> [n, k+1] with the tail's log-mass last, and whether the tail was floored."""
    mass = np.exp(logp).sum(axis=1)
    tail = 1.0 - mass
    floored = tail < TAIL_FLOOR
    return np.concatenate([logp, np.log(np.maximum(tail, TAIL_FLOOR))[:, None]], axis=1), floored


def topk_divergence(student_logp: np.ndarray, teacher_logp: np.ndarray, kind: str = "forward_kl",
                    temperature: float = 1.0, norm: float = 1.0) -> tuple[float, np.ndarray, np.ndarray]:
    """student_logp, teacher_logp: [n, k] at temperature 1. Returns (loss, coeff [n, k] float32,
    per-position divergence [n] without the T^2 and norm factors)."""
    if kind not in KINDS:
        raise ValueError(f"divergence must be one of {', '.join(KINDS)}, got {kind!r}")
    T = float(temperature)
    s = student_logp.astype(np.float64)
    u, floored = with_tail(s)
    a, _ = with_tail(teacher_logp.astype(np.float64))
    lp = log_softmax(a / T)
    lq = log_softmax(u / T)
    p, q = np.exp(lp), np.exp(lq)
    if kind == "forward_kl":
        rows = (p * (lp - lq)).sum(axis=1)
        dz = q - p                                     # d/d(u/T) of KL(p || softmax(u/T))
    else:
        if kind == "reverse_kl":
            rows = (q * (lq - lp)).sum(axis=1)
            g = lq - lp                                # d/dq, up to a constant that cancels below
        else:
            lm = np.logaddexp(lp, lq) - np.log(2.0)
            rows = 0.5 * ((p * (lp - lm)).sum(axis=1) + (q * (lq - lm)).sum(axis=1))
            g = 0.5 * (lq - lm)
        dz = q * (g - (q * g).sum(axis=1, keepdims=True))
    du = dz / T
    # the tail u_k = log(1 - sum_i exp(s_i)):  d u_k / d s_i = -exp(s_i) / exp(u_k)
    dtail = np.where(floored, 0.0, du[:, -1])
    grad = du[:, :-1] - dtail[:, None] * np.exp(s - u[:, -1:])
    scale = T * T / norm
    return float(rows.sum() * scale), (grad * scale).astype(np.float32), rows
