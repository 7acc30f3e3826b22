"""The plain types that cross between the Python side and the engine: a packed micro-batch with
its (row, token) targets, what a loss receives per micro-batch (log-probs, entropies, hidden
states) and what it returns (coefficients d(loss)/d(logp), optionally d(loss)/d(hidden)).

They are numpy containers only, so the data layer builds batches without loading the compiled
extension; retrograd.native converts them to the C structs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: prefix_ids value of a row that sees only its own sequence (RG_NO_PREFIX in native/retrograd.h)
NO_PREFIX = int(np.iinfo(np.int32).min)


@dataclass
class Batch:
    """One micro-batch of packed sequences and the (row, token id) targets to score."""

    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    target_rows: np.ndarray
    target_ids: np.ndarray
    prefix_ids: np.ndarray | None = None   # per row: another sequence whose rows it also sees
    embed_noise: np.ndarray | None = None  # [n_tokens, n_embd] added to the token embeddings (NEFTune)

    def __post_init__(self) -> None:
        for f in ("tokens", "positions", "seq_ids", "target_rows", "target_ids"):
            setattr(self, f, np.ascontiguousarray(getattr(self, f), dtype=np.int32))
        n = len(self.tokens)
        if self.prefix_ids is not None:
            self.prefix_ids = np.ascontiguousarray(self.prefix_ids, dtype=np.int32)
            if len(self.prefix_ids) != n:
                raise ValueError("prefix_ids must have one entry per token")
        if self.embed_noise is not None:
            self.embed_noise = np.ascontiguousarray(self.embed_noise, dtype=np.float32)
            if self.embed_noise.ndim != 2 or len(self.embed_noise) != n:
                raise ValueError("embed_noise must have one row per token")
        if len(self.positions) != n or len(self.seq_ids) != n:
            raise ValueError("tokens, positions and seq_ids must have the same length")
        if len(self.target_rows) != len(self.target_ids):
            raise ValueError("target_rows and target_ids must have the same length")

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_targets(self) -> int:
        return len(self.target_rows)

    @classmethod
    def next_token(cls, tokens: np.ndarray, seq_ids: np.ndarray | None = None,
                   weights_mask: np.ndarray | None = None) -> Batch:
        """Targets every next token within each sequence (optionally only where mask is set)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        seq = np.zeros(len(tokens), np.int32) if seq_ids is None else np.asarray(seq_ids, np.int32)
        pos = np.zeros(len(tokens), np.int32)
        for i in range(1, len(tokens)):
            pos[i] = pos[i - 1] + 1 if seq[i] == seq[i - 1] else 0
        same = seq[1:] == seq[:-1]
        if weights_mask is not None:
            same &= np.asarray(weights_mask[1:], bool)
        rows = np.nonzero(same)[0]
        return cls(tokens, pos, seq, rows, tokens[rows + 1])


@dataclass
class LossInputs:
    """What the coefficient callback receives (views valid only during the call)."""

    logp: np.ndarray
    entropy: np.ndarray | None
    hidden: np.ndarray | None       # [n_tokens, n_embd]


@dataclass
class LossOutputs:
    coeff: np.ndarray                  # d(loss)/d(logp) per target
    hidden_grad: np.ndarray | None = None  # d(loss)/d(hidden), [n_tokens, n_embd]


CoeffFn = Callable[[LossInputs], LossOutputs]
