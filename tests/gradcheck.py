"""Finite-difference helpers for gradient tests through the engine."""

from __future__ import annotations

import numpy as np

from retrograd import native


def randomize_adapter(tr, seed, scale: float = 0.3) -> None:
    """Non-zero A and B everywhere, so every path of the LoRA gradient is exercised. seed: an int
    or a numpy Generator (which then continues from where this leaves it)."""
    rng = np.random.default_rng(seed)
    for t in tr.lora.tensors:
        tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * scale)


def adapted(model, variant: str, recompute: bool, threads: int):
    """A rank-4 adapter (LoRA or DoRA, magnitudes reset to the adapted rows' norms) with non-zero
    A and B, optionally with activation checkpointing: the setup of the engine-route comparisons."""
    from retrograd.engine import LoraSpec, Trainable

    tr = Trainable(model, LoraSpec(4, 8.0, variant=variant), threads=threads)
    tr.engine.set_recompute(recompute)
    randomize_adapter(tr, 1, 0.1)
    if variant == "dora":
        tr.lora.reset_magnitude()
    return tr


def token_batch(seed: int, n: int = 40, vocab: int = 256):
    """n random next-token targets and a random coefficient for each"""
    rng = np.random.default_rng(seed)
    b = native.Batch.next_token(rng.integers(0, vocab, n).astype(np.int32))
    return b, rng.standard_normal(b.n_targets).astype(np.float32)


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


def fd_check(tr, batch: native.Batch, coeff: np.ndarray, tensors, n_entries=5, h=1e-2, seed=0):
    """Worst relative error between analytic and (Richardson-extrapolated) central differences."""
    def loss():
        return float(np.dot(coeff.astype(np.float64), tr.logprobs(batch).logp.astype(np.float64)))

    tr.lora.zero(native.SLOT_GRAD)
    tr.accumulate(batch, lambda inp: native.LossOutputs(coeff))
    rng = np.random.default_rng(seed)
    worst = 0.0
    for t in tensors:
        g = tr.lora.read(t.index, native.SLOT_GRAD).ravel()
        idx = np.argsort(-np.abs(g))[:2].tolist() + rng.choice(g.size, n_entries, replace=False).tolist()
        fd, an = np.array([richardson(tr, t, loss, i, h) for i in idx]), g[idx]
        rel = np.linalg.norm(fd - an) / max(np.linalg.norm(fd), 1e-6)
        worst = max(worst, rel)
    return worst
