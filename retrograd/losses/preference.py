"""Preference losses over pairs, as (loss, d(loss)/d(sequence log-prob)).

Inputs per pair: the policy's summed log-probs of the chosen and rejected responses (pc, pr),
their trained-token counts (nc, nr) and, for the losses that have one, the reference policy's
sums (rc, rr; the base model, adapter off). With sigma the logistic function:

  dpo    -log sigma(beta ((pc - rc) - (pr - rr)))                       Rafailov et al. 2023
  ipo    (h - 1/(2 beta))^2, h = (pc - rc)/nc - (pr - rr)/nr            Azar et al. 2023, on the
         per-token mean log-ratios (the sums make the target depend on the lengths)
  simpo  -log sigma(beta (pc/nc - pr/nr) - gamma)                       Meng et al. 2024, no reference
  orpo   -pc/nc + lam * -log sigma(lo_c - lo_r),                        Hong et al. 2024, no reference
         lo = log(P / (1 - P)) with log P = p/n (mean log-prob)

The loss is summed over pairs and divided by `norm`. Because every token of a response enters
its sum with weight 1, d(loss)/d(token log-prob) is the sequence's coefficient for each of its
tokens. `implicit_rewards` gives what evaluation reports as the reward margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from retrograd.data.batching import group_batch, pack_groups
from retrograd.data.pairs import Pair

LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass
class PairStats:
    pc: np.ndarray
    pr: np.ndarray
    nc: np.ndarray
    nr: np.ndarray
    rc: np.ndarray | None = None
    rr: np.ndarray | None = None

    def reference(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(rc, rr), which the losses measured against the reference policy need."""
        if self.rc is None or self.rr is None:
            raise ValueError(f"{kind} needs the reference log-probs")
        return self.rc, self.rr


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))


def _log1mexp(x: np.ndarray) -> np.ndarray:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it."""
    x = np.minimum(x, -1e-12)
    return np.where(x > -np.log(2.0), np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def preference_loss(s: PairStats, kind: str, beta: float, *, gamma: float = 0.5, lam: float = 0.1,
                    norm: float = 1.0) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (loss, d/d pc, d/d pr, per-pair loss)."""
    if kind not in LOSSES:
        raise ValueError(f"preference loss must be one of {', '.join(LOSSES)}, got {kind!r}")
    pc, pr = s.pc.astype(np.float64), s.pr.astype(np.float64)
    nc, nr = np.maximum(s.nc, 1).astype(np.float64), np.maximum(s.nr, 1).astype(np.float64)
    if kind == "dpo":
        rc, rr = s.reference(kind)
        z = beta * ((pc - rc) - (pr - rr))
        per = np.logaddexp(0.0, -z)
        d = -beta * _sigmoid(-z)
        gc, gr = d, -d
    elif kind == "ipo":
        rc, rr = s.reference(kind)
        h = (pc - rc) / nc - (pr - rr) / nr
        e = h - 1.0 / (2.0 * beta)
        per = e * e
        gc, gr = 2.0 * e / nc, -2.0 * e / nr
    elif kind == "simpo":
        z = beta * (pc / nc - pr / nr) - gamma
        per = np.logaddexp(0.0, -z)
        d = -beta * _sigmoid(-z)
        gc, gr = d / nc, -d / nr
    else:
        mc, mr = pc / nc, pr / nr
        lo_c, lo_r = mc - _log1mexp(mc), mr - _log1mexp(mr)
        z = lo_c - lo_r
        per = -mc + lam * np.logaddexp(0.0, -z)
        d = -lam * _sigmoid(-z)
        # d lo / d m = 1 / (1 - P)
        gc = (-1.0 + d / -np.expm1(np.minimum(mc, -1e-12))) / nc
        gr = (-d / -np.expm1(np.minimum(mr, -1e-12))) / nr
    return float(per.sum() / norm), gc / norm, gr / norm, per


def implicit_rewards(s: PairStats, kind: str, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """The rewards each loss implicitly assigns to chosen and rejected responses: beta times the
    log-ratio to the reference (dpo), its per-token mean (ipo), beta times the mean log-prob
    (simpo), the log-odds (orpo)."""
    pc, pr = s.pc.astype(np.float64), s.pr.astype(np.float64)
    nc, nr = np.maximum(s.nc, 1), np.maximum(s.nr, 1)
    if kind == "dpo":
        rc, rr = s.reference(kind)
        return beta * (pc - rc), beta * (pr - rr)
    if kind == "ipo":
        rc, rr = s.reference(kind)
        return (pc - rc) / nc, (pr - rr) / nr
    if kind == "simpo":
        return beta * pc / nc, beta * pr / nr
    mc, mr = pc / nc, pr / nr
    return mc - _log1mexp(mc), mr - _log1mexp(mr)


# ---- pairs in micro-batches ----------------------------------------------------------------
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


def stats_for(chunk: list[Pair], logp: np.ndarray, owner: np.ndarray, w: np.ndarray, need_ref: bool) -> PairStats:
    pc, pr = sums(logp, owner, w, len(chunk))
    nc = np.array([p.chosen_w.sum() for p in chunk])
    nr = np.array([p.rejected_w.sum() for p in chunk])
    if not need_ref:
        return PairStats(pc, pr, nc, nr)
    refs = [p.known_ref() for p in chunk]
    return PairStats(pc, pr, nc, nr, np.array([r[0] for r in refs]), np.array([r[1] for r in refs]))


def pair_loss(chunk: list[Pair], logp: np.ndarray, owner: np.ndarray, w: np.ndarray, p, need_ref: bool,
              norm: float = 1.0) -> tuple[float, np.ndarray, PairStats]:
    """One micro-batch of pairs: the loss, d(loss)/d(logp) per target (each answer's coefficient
    on each of its trained tokens) and the pairs' statistics. p is the [preference] section."""
    s = stats_for(chunk, logp, owner, w, need_ref)
    value, gc, gr, _ = preference_loss(s, p.loss, p.beta, gamma=p.simpo_gamma, lam=p.orpo_lambda, norm=norm)
    per_seq = np.empty(2 * len(chunk))
    per_seq[0::2], per_seq[1::2] = gc, gr
    return value, (per_seq[owner] * w).astype(np.float32), s
