"""From examples to engine micro-batches: deterministic epoch orders (resumable by position),
greedy packing under a token budget, and the (row, next token) targets of the trained tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import numpy as np

from retrograd.batch import NO_PREFIX, Batch
from retrograd.data.formats import Example


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of epoch `epoch`: a pure function of (seed, epoch), so a resumed run sees the same."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def train_and_eval(cfg, load, what: str, notes: list[str], train: Path | None = None) -> tuple[list, list]:
    """The training items of `train` (default [data].train) and the evaluation items: those of
    [evaluation].data when it is set, else the held-out split ([data].eval_split). load(path) ->
    (items, LoadReport); a note per file."""
    items, report = load(Path(train or cfg.data.train))
    notes.append(f"train {what}: {report.summary()}")
    kept, held = split_holdout(items, cfg.data.eval_split, cfg.run.seed)
    if cfg.evaluation.data:
        held, er = load(Path(cfg.evaluation.data))
        notes.append(f"eval {what}: {er.summary()}")
    elif held:
        notes.append(f"eval {what}: {len(held)} examples held out of the training data")
    return kept, held


def split_holdout(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    order = np.random.default_rng([seed, 7919]).permutation(len(examples))
    k = max(1, int(round(len(examples) * fraction)))
    held = set(order[:k].tolist())
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


@dataclass
class Cursor:
    """Position in the stream of training examples: epoch and index within its order."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


T = TypeVar("T")       # a stream's items: Examples, or what a recipe samples from (prompts, scenarios)


class ExampleStream(Generic[T]):
    """Endless, resumable stream of examples over epochs."""

    def __init__(self, examples: Sequence[T], seed: int, shuffle: bool, cursor: Cursor | None = None):
        self.examples = examples
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = cursor or Cursor()
        self._order = epoch_order(len(examples), seed, self.cursor.epoch, shuffle)

    def take(self, n: int = 0, tokens: int = 0) -> list[T]:
        """The next n examples, or as many as fit in `tokens` (at least one; Examples only)."""
        out: list[T] = []
        used = 0
        while True:
            if self.cursor.index >= len(self._order):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
                self._order = epoch_order(len(self.examples), self.seed, self.cursor.epoch, self.shuffle)
            ex = self.examples[self._order[self.cursor.index]]
            size = len(cast(Example, ex).tokens) if tokens else 0
            if tokens and out and used + size > tokens:
                return out
            out.append(ex)
            used += size
            self.cursor = Cursor(self.cursor.epoch, self.cursor.index + 1)
            if (n and len(out) >= n) or (tokens and used >= tokens):
                return out

    def seek(self, cursor: dict) -> None:
        """Continue from a position saved as cursor.to_dict() (resume)."""
        self.cursor = Cursor(int(cursor.get("epoch", 0)), int(cursor.get("index", 0)))
        self._order = epoch_order(len(self.examples), self.seed, self.cursor.epoch, self.shuffle)

    @property
    def epoch_progress(self) -> float:
        return self.cursor.epoch + self.cursor.index / max(1, len(self.examples))


def first_fit(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Indices per bin, first fit in order: each item goes to the first bin it fits in under
    `budget`; an item larger than the budget gets a bin of its own."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i, n in enumerate(sizes):
        for b, size in enumerate(used):
            if size + n <= budget:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return bins


def pack(examples: Sequence[Example], budget: int, packing: bool = True) -> list[list[Example]]:
    """Examples grouped into micro-batches of at most `budget` tokens (first_fit), or one per
    micro-batch without packing."""
    if not packing:
        return [[ex] for ex in examples]
    return [[examples[i] for i in b] for b in first_fit([len(ex.tokens) for ex in examples], budget)]


def take_step(stream: ExampleStream, t) -> list:
    """The items of one optimizer step: batch_size x grad_accum items, or as many as fit in
    batch_tokens x grad_accum tokens when [training].batch_tokens is set."""
    if t.batch_tokens:
        return stream.take(tokens=t.batch_tokens * t.grad_accum)
    return stream.take(n=t.batch_size * t.grad_accum)


def steps_for(items: Sequence, t, tokens_of: Callable[[Any], int]) -> int:
    """Optimizer steps of [training].epochs passes over `items` under take_step's rule."""
    if t.batch_tokens:
        return max(1, math.ceil(t.epochs * sum(tokens_of(x) for x in items) / (t.batch_tokens * t.grad_accum)))
    return max(1, math.ceil(t.epochs * len(items) / (t.batch_size * t.grad_accum)))


def to_batch(group: Sequence[Example]) -> tuple[Batch, np.ndarray]:
    """One packed micro-batch, plus for each target the index of its example in `group`."""
    toks, pos, seq, rows, ids, owner = [], [], [], [], [], []
    offset = 0
    for s, ex in enumerate(group):
        n = len(ex.tokens)
        toks.append(ex.tokens)
        pos.append(np.arange(n, dtype=np.int32))
        seq.append(np.full(n, s, np.int32))
        labels = np.nonzero(ex.trained[1:])[0]          # label index i+1 is predicted at row i
        rows.append(labels + offset)
        ids.append(ex.tokens[labels + 1])
        owner.append(np.full(len(labels), s, np.int32))
        offset += n
    batch = Batch(np.concatenate(toks), np.concatenate(pos), np.concatenate(seq),
                  np.concatenate(rows), np.concatenate(ids))
    return batch, np.concatenate(owner)


@dataclass
class Group:
    """A prompt and several continuations of it, trained with one shared copy of the prompt.
    `trained` marks, per continuation, the tokens that are targets (default: all of them; a
    multi-turn rollout's continuation also holds tool results, which are context only)."""

    prompt: np.ndarray
    completions: list[np.ndarray]
    trained: list[np.ndarray] | None = None

    def mask(self, i: int) -> np.ndarray:
        if self.trained is None:
            return np.ones(len(self.completions[i]), bool)
        return np.asarray(self.trained[i], bool)

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + sum(len(c) for c in self.completions)


def pack_groups(groups: Sequence[Group], budget: int) -> list[list[int]]:
    """Indices of groups per micro-batch (first_fit; a group is never split)."""
    return first_fit([g.n_tokens for g in groups], budget)


def split_groups(groups: Sequence[Group], budget: int) -> list[tuple[Group, np.ndarray]]:
    """Groups cut to fit `budget` tokens: a longer group becomes several parts, each with the whole
    prompt and as many of its continuations, in order, as fit (at least one). Continuations only
    see the prompt and themselves, and the prompt has no targets, so the parts give every target
    the same log-prob and gradient as the whole group (tests/test_native.py: shared prefix equals
    separate sequences). What it saves is memory: attention's scores grow with the square of a
    micro-batch's length, and an agentic group of 8 conversations can run to thousands of tokens.
    Returns each part with its continuations' indices counted over all `groups` in order."""
    out: list[tuple[Group, np.ndarray]] = []
    base = 0
    for g in groups:
        cuts: list[list[int]] = [[]]
        size = len(g.prompt)
        for i, c in enumerate(g.completions):
            if cuts[-1] and size + len(c) > budget:
                cuts.append([])
                size = len(g.prompt)
            cuts[-1].append(i)
            size += len(c)
        for idx in cuts:
            trained = None if g.trained is None else [g.trained[i] for i in idx]
            out.append((Group(g.prompt, [g.completions[i] for i in idx], trained), base + np.asarray(idx)))
        base += len(g.completions)
    return out


def group_batch(groups: Sequence[Group]) -> tuple[Batch, np.ndarray]:
    """Rows: each prompt once, then its continuations seeing it as their prefix. Targets: every
    trained continuation token (the first predicted from the prompt's last row). Returns the batch
    and, per target, the index of its continuation counted over `groups` in order."""
    toks, pos, seq, pre, rows, ids, owner = [], [], [], [], [], [], []
    offset, sid, cidx = 0, 0, 0
    none = NO_PREFIX
    for g in groups:
        p = len(g.prompt)
        toks.append(g.prompt)
        pos.append(np.arange(p, dtype=np.int32))
        seq.append(np.full(p, sid, np.int32))
        pre.append(np.full(p, none, np.int32))
        prompt_sid, prompt_last = sid, offset + p - 1
        offset += p
        sid += 1
        for ci, c in enumerate(g.completions):
            n = len(c)
            keep = g.mask(ci)
            toks.append(c)
            pos.append(np.arange(p, p + n, dtype=np.int32))
            seq.append(np.full(n, sid, np.int32))
            pre.append(np.full(n, prompt_sid, np.int32))
            rows.append(np.concatenate([[prompt_last], offset + np.arange(n - 1)]).astype(np.int32)[keep])
            ids.append(c[keep])
            owner.append(np.full(int(keep.sum()), cidx, np.int32))
            offset += n
            sid += 1
            cidx += 1
    batch = Batch(np.concatenate(toks), np.concatenate(pos), np.concatenate(seq), np.concatenate(rows),
                  np.concatenate(ids), np.concatenate(pre))
    return batch, np.concatenate(owner)
