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
    lora_dropout: float = 0.0              # LoRA dropout probability for this batch (training batches only)
    dropout_seed: int = 0                  # the masks' seed: the same seed draws the same masks

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


class Tally:
    """The metrics of one optimizer step, gathered over its micro-batches: sums (a loss already
    divided by the step's normaliser adds up to the step's loss) and weighted means (a per-token
    statistic: the total over the micro-batch's tokens and how many there were). `keep` holds
    values a loss hands back to its recipe (StepWork.on_kept). Tallies of the parts of a step
    computed in different processes merge into the step's."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weighted: dict[str, list[float]] = {}
        self.kept: dict = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def mean(self, key: str, total: float, count: float) -> None:
        acc = self.weighted.setdefault(key, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def keep(self, key, value) -> None:
        self.kept[key] = value

    def state(self) -> tuple[dict, dict, dict]:
        return self.sums, self.weighted, self.kept

    def merge(self, state: tuple[dict, dict, dict]) -> None:
        sums, weighted, kept = state
        for k, v in sums.items():
            self.add(k, v)
        for k, (total, count) in weighted.items():
            self.mean(k, total, count)
        self.kept.update(kept)

    def result(self) -> dict[str, float]:
        out = dict(self.sums)
        for k, (total, count) in self.weighted.items():
            out[k] = total / count if count else 0.0
        return out
