"""Choosing the next token on the host from llama.cpp's logits: temperature, top-k, an exact top-p
and a seeded generator, returning the token's log-probability under the untempered model (what a
policy update compares against)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)   # log p(token) under the untempered model
    finish_reason: str = "length"                        # "stop" (end token or stop string) or "length"
    end_token: int | None = None                         # the end-of-generation token that stopped it
    end_logprob: float = 0.0

    def trained(self) -> tuple[list[int], list[float]]:
        """The tokens a policy update trains on and their sampling log-probs: the sampled tokens and
        the end token that stopped them (choosing to stop is part of the answer)."""
        if self.end_token is None:
            return list(self.tokens), list(self.logprobs)
        return [*self.tokens, self.end_token], [*self.logprobs, self.end_logprob]

    def take(self, t: int, lp: float, p: SamplingParams, tok, context_full: bool) -> bool:
        """Add the sampled token t (log-prob lp); False once the sequence has ended: an end token, a
        stop string (the text is cut before it), max_new_tokens, or the context full. Every decode
        loop (the batched rollouts and the server's continuous batch) ends sequences through here."""
        if t in tok.eog_ids:
            self.finish_reason, self.end_token, self.end_logprob = "stop", t, lp
            return False
        self.tokens.append(t)
        self.logprobs.append(lp)
        if p.stop:
            self.text = tok.decode(self.tokens)
            hit = min((self.text.find(x) for x in p.stop if x in self.text), default=-1)
            if hit >= 0:
                self.text = self.text[:hit]
                self.finish_reason = "stop"
                return False
        return not (len(self.tokens) >= p.max_new_tokens or context_full)

    def finish_text(self, p: SamplingParams, tok) -> None:
        """The text of the tokens, unless a stop string already cut it."""
        if not (p.stop and self.finish_reason == "stop"):
            self.text = tok.decode(self.tokens)


def _fast_top_p() -> bool:
    return os.environ.get("RETRO_FAST_TOP_P", "0") == "1"


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Token ids of the smallest most-probable set with mass >= top_p, most probable first, equal
    probabilities by token id (what a full stable sort of the vocabulary gives).

    Sorting the vocabulary costs milliseconds a token, a large share of a batched decode step, so
    only the tokens above a probability threshold are sorted: every token at or above it comes
    before every token below it in the full order, so once their running mass reaches top_p the
    nucleus lies among them, ties with its last token included. The threshold starts at a hundredth
    of the largest probability and drops a hundredfold until that holds."""
    threshold = float(probs.max()) * 1e-2
    while True:
        cand = np.flatnonzero(probs >= threshold)
        order = cand[np.lexsort((cand, -probs[cand]))]
        cum = np.cumsum(probs[order])
        if cum[-1] >= top_p or len(cand) == len(probs):
            return order[: int(np.searchsorted(cum, top_p)) + 1]
        threshold = threshold * 1e-2 if threshold > 1e-30 else 0.0


_PIECE = 1024


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn with probability proportional to weights (non-negative, not all zero).

    A running sum over the whole vocabulary is a sequential pass: most of the sampler's time. So
    the vocabulary is summed in pieces of 1,024 (a vectorized reduction), the piece found from their
    running sum, and only that piece summed in order. The same uniform number picks the same token
    as rng.choice except where it falls within rounding of a boundary between two tokens."""
    starts = np.arange(0, len(weights), _PIECE)
    sums = np.add.reduceat(weights, starts)
    pieces = np.cumsum(sums)
    target = rng.random() * pieces[-1]
    k = int(np.searchsorted(pieces, target, side="right"))
    if k == len(pieces):            # the uniform rounded up to the total: the last piece with mass
        k = int(np.flatnonzero(sums)[-1])
    lo = int(starts[k])
    piece = weights[lo:lo + _PIECE]
    inside = np.cumsum(piece)
    j = int(np.searchsorted(inside, target - (pieces[k - 1] if k else 0.0), side="right"))
    if j == len(piece):         # rounding took it past the piece's last token
        j = int(np.flatnonzero(piece)[-1])
    return lo + j


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> tuple[int, float]:
    """Choose a token; return it and its log-probability under the model (temperature 1).

    Top-p keeps the smallest set of most probable tokens whose mass reaches p (see _nucleus). The
    arithmetic is float64; RETRO_FAST_TOP_P=1 does it in float32 (about half the cost; the
    probabilities round differently, so ties and the token chosen for a seed may differ)."""
    # in place where possible: a fresh temporary of the vocabulary's size costs page faults
    d = logits.astype(np.float32 if _fast_top_p() else np.float64)
    d -= d.max()
    e = np.exp(d)
    lse = np.log(e.sum())
    if p.temperature <= 0:
        tok = int(np.argmax(d))
        return tok, float(d[tok] - lse)
    if p.temperature == 1:      # the tempered exponentials are the untempered ones
        probs = e
    else:
        probs = np.divide(d, p.temperature)
        np.exp(probs, out=probs)
    if p.top_k and p.top_k < len(probs):
        kth = np.partition(probs, -p.top_k)[-p.top_k]
        probs[probs < kth] = 0.0
    if 0 < p.top_p < 1:
        probs /= probs.sum()
        keep = _nucleus(probs, p.top_p)
        kept = probs[keep] / probs[keep].sum()
        tok = int(keep[rng.choice(len(keep), p=kept)])
    else:
        tok = _draw(probs, rng)         # in proportion to probs: no need to normalize them
    return tok, float(d[tok] - lse)
