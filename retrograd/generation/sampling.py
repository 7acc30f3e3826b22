"""Choosing the next token on the host from llama.cpp's logits: temperature, top-k, an exact top-p
and a seeded generator, returning the token's log-probability under the untempered model (what a
policy update compares against)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0
    stop: tuple[str, ...] = ()



def _fast_top_p() -> bool:
    return os.environ.get("RETRO_FAST_TOP_P", "0") == "1"


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Token ids of the smallest most-probable set with mass >= top_p, most probable first, equal
    probabilities by token id (what a full stable sort gives). Candidates are taken by partial
    selection, growing until they hold the mass; all tokens tied with the last candidate are
    included, so the result is exact. RETRO_FAST_TOP_P=1 skips the tie handling."""
    n = len(probs)
    k = 64
    fast = _fast_top_p()
    while k < n:
        part = np.argpartition(-probs, k)[:k]
        cutoff = probs[part].min()
        cand = part if fast else np.nonzero(probs >= cutoff)[0]
        if probs[cand].sum() >= top_p:
            break
        k *= 4
    else:
        cand = np.arange(n)
    order = cand[np.lexsort((cand, -probs[cand]))]
    cum = np.cumsum(probs[order])
    return order[: int(np.searchsorted(cum, top_p)) + 1]


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> tuple[int, float]:
    """Choose a token; return it and its log-probability under the model (temperature 1).

    Top-p keeps the smallest set of most probable tokens whose mass reaches p (see _nucleus)."""
    z = logits.astype(np.float64)
    zmax = z.max()
    logp_model = z - zmax - np.log(np.exp(z - zmax).sum())
    if p.temperature <= 0:
        tok = int(np.argmax(z))
        return tok, float(logp_model[tok])
    z = (z - zmax) / p.temperature
    if p.top_k and p.top_k < len(z):
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z)
    probs /= probs.sum()
    if 0 < p.top_p < 1:
        keep = _nucleus(probs, p.top_p)
        kept = probs[keep] / probs[keep].sum()
        tok = int(keep[rng.choice(len(keep), p=kept)])
        return tok, float(logp_model[tok])
    tok = int(rng.choice(len(probs), p=probs))
    return tok, float(logp_model[tok])
