"""Perplexity of held-out examples as llama.cpp scores them (its own forward through
llama-cpp-python), for a GGUF alone or with a LoRA adapter: `retrograd export` compares the file
it wrote with the base model and the adapter it came from on the same tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.data.formats import Example


@dataclass
class Score:
    nll: float          # mean negative log-likelihood per scored token
    tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(min(self.nll, 50.0))


def take_tokens(examples: Sequence[Example], budget: int, most: int = 2000) -> list[Example]:
    """The first examples whose trained tokens add up to about `budget`, or whose tokens add up to
    `most` first (at least one example)."""
    out, n, total = [], 0, 0
    for ex in examples:
        if n >= budget or total >= most:
            break
        out.append(ex)
        n += int(ex.n_trained)
        total += len(ex.tokens)
    return out


def token_logprobs(llm, tokens: Sequence[int]) -> np.ndarray:
    """log p(tokens[i] | tokens[:i]) for i >= 1, from llama.cpp's logits of every position."""
    llm.reset()
    llm.eval(list(tokens))
    sc = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    sc -= sc.max(1, keepdims=True)
    ls = sc - np.log(np.exp(sc).sum(1, keepdims=True))
    return ls[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]


def score(model: Path, examples: Sequence[Example], *, lora: Path | None = None, n_ctx: int = 2048,
          threads: int = 2) -> Score:
    """Mean NLL of the trained tokens of `examples` under llama.cpp (F32 KV cache, so the numbers
    are not rounded through F16)."""
    from retrograd.generation.llama import plain_llama

    n_ctx = max(n_ctx, max((len(ex.tokens) for ex in examples), default=16))
    llm = plain_llama(model, lora_path=str(lora) if lora else None, logits_all=True, n_ctx=n_ctx, n_threads=threads,
                      n_batch=min(n_ctx, 512), type_k=0, type_v=0)
    try:
        total, count = 0.0, 0
        for ex in examples:
            lp = token_logprobs(llm, ex.tokens.tolist())
            mask = np.asarray(ex.trained[1:], bool)
            total -= float(lp[mask].sum())
            count += int(mask.sum())
    finally:
        llm.close()
    return Score(total / max(count, 1), count)
