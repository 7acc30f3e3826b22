"""Masked cross-entropy: the SFT loss, and the data term that distillation can mix in."""

from __future__ import annotations

import numpy as np


def nll(logp: np.ndarray, weights: np.ndarray, norm: float) -> tuple[float, np.ndarray]:
    """Loss sum(-w * logp) / norm and its coefficients d(loss)/d(logp)."""
    coeff = (-weights / norm).astype(np.float32)
    return float(np.dot(coeff.astype(np.float64), logp.astype(np.float64))), coeff
