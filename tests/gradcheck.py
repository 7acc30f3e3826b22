"""Finite-difference helpers for gradient tests through the engine."""

from __future__ import annotations

import numpy as np


def randomize_adapter(tr, seed, scale: float = 0.3) -> None:
    """Non-zero A and B everywhere, so every path of the LoRA gradient is exercised. seed: an int
    or a numpy Generator (which then continues from where this leaves it)."""
    rng = np.random.default_rng(seed)
    for t in tr.lora.tensors:
        tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * scale)


def richardson(tr, t, value, i: int, h: float = 1e-2) -> float:
    """d value() / d entry i of adapter tensor t: central differences at steps h and h/2,
    Richardson-extrapolated; the tensor is restored afterwards."""
    w = tr.lora.read(t.index)

    def d(step: float) -> float:
        x = w.copy().ravel()
        x[i] += step
        tr.lora.write(t.index, x.reshape(w.shape))
        up = value()
        x[i] -= 2 * step
        tr.lora.write(t.index, x.reshape(w.shape))
        down = value()
        tr.lora.write(t.index, w)
        return (up - down) / (2 * step)

    return (4 * d(h / 2) - d(h)) / 3
