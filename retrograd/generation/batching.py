"""Continuous batching over one Generator: sequences join and leave a running batch between decode
steps (the server's requests), where Generator.generate* decodes a fixed set to its end (rollouts).

Up to `parallel` sequences are live. A new sequence copies the longest prefix it shares with any
sequence whose cells are still in the KV cache (llama_memory_seq_cp: the cells are shared, nothing is
recomputed) and decodes only the rest. Each step samples every live sequence from its own logits
with its own settings and RNG (sampling.sample, Completion.take: what the rollouts use) and decodes
the continuing ones in one llama_decode call.

A finished or cancelled sequence leaves the batch at once (its slot is free for the next request);
its cells stay, and can still lend their prefix, until the batch has drained (then the whole cache is
cleared) or live sequences need the room (then the oldest kept sequence's go, llama_memory_seq_rm).
Not earlier: llama.cpp's CPU flash attention accumulates in F16 in the order of the KV cells, and
freeing cells moves the cache's write head back, so the next tokens would land before older cells
of their own sequence and the logits would change (by up to ~1 on SmolLM2-135M). Kept this way,
every sequence's cells stay in position order, and an answer is bit-identical to the same request
decoded alone. One thread must own a Batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp.llama_cpp as lc
import numpy as np

from retrograd.generation.llama import Generator
from retrograd.generation.sampling import Completion, SamplingParams, sample
from retrograd.generation.weights import generator_model


def auto_parallel(n_ctx: int) -> int:
    """Sequences decoded together when [serving].parallel is 0: 8, fewer when 8 full contexts would
    need more than 32,768 KV cells (the cache is parallel x ctx cells)."""
    return max(1, min(8, 32768 // max(1, n_ctx)))


def serving_generator(model_path, *, n_ctx: int, parallel: int, threads: int | None, device: str,
                      weights: str = "native", dora: bool = False) -> Generator:
    """A Generator for a Batch of `parallel` sequences: 2 x parallel sequence ids (the live ones and
    those whose cells are kept), a KV cache of parallel x n_ctx cells (every live sequence may reach
    n_ctx; kept cells give way first). `weights`: [serving].generator_weights (weights.py), `dora`:
    whether a DoRA adapter will be applied (the generator then loads merged models, never a copy)."""
    path = Path(model_path)
    if weights != "native":            # the device is asked only when a copy may be made
        from retrograd import native

        on_cpu = native.select_device(device).kind == "cpu"
        path = generator_model(path, weights, threads or os.cpu_count() or 1, on_cpu=on_cpu, dora=dora)
    return Generator(path, n_ctx=n_ctx, n_seq=2 * parallel, threads=threads, device=device,
                     kv_cells=parallel * n_ctx)


@dataclass
class Seq:
    params: SamplingParams
    rng: np.random.Generator
    kv: list[int]                    # the tokens in this sequence's KV cells, by position
    logits: np.ndarray               # the row the next token is sampled from
    out: Completion = field(default_factory=Completion)
    pending: int | None = None        # the sampled token, decoded at the next step


class Batch:
    def __init__(self, gen: Generator, parallel: int) -> None:
        if gen.n_seq < 2 * parallel:
            raise ValueError(f"the generator has {gen.n_seq} sequences; a batch of {parallel} needs {2 * parallel}")
        self.gen = gen
        self.parallel = parallel
        self.ids = gen.n_seq
        self.live: dict[int, Seq] = {}
        self.kept: dict[int, list[int]] = {}     # ended sequences whose cells stay, oldest first: their tokens
        self._rows = np.empty((self.ids, gen.n_vocab), np.float32)   # reused: no fresh mapping a step

    @property
    def free(self) -> int:
        return self.parallel - len(self.live)

    def reset(self) -> None:
        """Forget every cell (new weights: what is cached was computed with others)."""
        self.live.clear()
        self.kept.clear()
        lc.llama_memory_seq_rm(self.gen._mem, -1, -1, -1)

    def _release(self, sid: int) -> None:
        self.kept.pop(sid, None)
        lc.llama_memory_seq_rm(self.gen._mem, sid, -1, -1)

    def _make_room(self, n: int) -> None:
        """Kept cells give way, oldest first, when the live sequences need them (counted without
        sharing: an upper bound)."""
        used = sum(len(q.kv) for q in self.live.values()) + sum(len(k) for k in self.kept.values())
        while self.kept and used + n > self.gen.kv_cells:
            sid = next(iter(self.kept))
            used -= len(self.kept[sid])
            self._release(sid)

    def _settle(self) -> None:
        """Once the batch has drained, every cell goes: the next batch starts from an empty cache."""
        if not self.live and self.kept:
            self.kept.clear()
            lc.llama_memory_seq_rm(self.gen._mem, -1, -1, -1)

    def start(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Put a sequence in the batch: copy its longest cached prefix, decode the rest of its prompt.
        Returns its id. The prompt must leave room for a token (len(prompt) < n_ctx)."""
        gen, prompt = self.gen, list(prompt)
        if not prompt or len(prompt) >= gen.n_ctx:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit the context of {gen.n_ctx}")
        if len(self.live) >= self.parallel:
            raise ValueError(f"the batch is full ({self.parallel} sequences)")
        free = [i for i in range(self.ids) if i not in self.live and i not in self.kept]
        if not free:
            self._release(next(iter(self.kept)))
            free = [i for i in range(self.ids) if i not in self.live and i not in self.kept]
        s = free[0]
        best, src = 0, None
        for sid, kv in [*self.kept.items(), *((i, q.kv) for i, q in self.live.items())]:
            n = _common(kv, prompt)
            if n > best:
                best, src = n, sid
        lc.llama_memory_seq_rm(gen._mem, s, -1, -1)
        if src is not None:
            lc.llama_memory_seq_cp(gen._mem, src, s, 0, best)
        rest = prompt[best:]
        self._make_room(len(rest))
        gen._decode(rest, range(best, len(prompt)), [s] * len(rest), [False] * (len(rest) - 1) + [True])
        row = self._rows[s]
        row[:] = gen._logits(gen._last_row(len(rest)))
        self.live[s] = Seq(params, np.random.default_rng(params.seed & (2**64 - 1)), prompt, logits=row)
        return s

    def sample(self) -> list[int]:
        """Choose every live sequence's next token; returns the ids of those that ended (still live:
        the caller reads their completion, then leave()s them)."""
        tok, ended = self.gen.tokenizer, []
        for s, q in self.live.items():
            t, lp = sample(q.logits, q.params, q.rng)
            if q.out.take(t, lp, q.params, tok, len(q.kv) + 1 >= self.gen.n_ctx):
                q.pending = t
            else:
                q.pending = None
                q.out.finish_text(q.params, tok)
                ended.append(s)
        return ended

    def decode(self) -> None:
        """One llama_decode of every live sequence's pending token."""
        steps = [(s, q, t) for s, q in self.live.items() if (t := q.pending) is not None]
        if not steps:
            return
        self._make_room(len(steps))
        self.gen._decode([t for _, _, t in steps], [len(q.kv) for _, q, _ in steps], [s for s, _, _ in steps],
                         [True] * len(steps))
        rows = self.gen._step_logits(len(steps))
        for i, (s, q, t) in enumerate(steps):
            self._rows[s] = rows[i]          # copied: a prompt decoded before the next step overwrites them
            q.logits = self._rows[s]
            q.kv.append(t)
            q.pending = None

    def leave(self, s: int) -> None:
        """A sequence (ended or cancelled) leaves the batch; its cells are kept until it drains."""
        q = self.live.pop(s, None)
        if q is not None:
            self.kept[s] = q.kv
        self._settle()


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, leaving at least the last token of b to decode."""
    n, top = 0, min(len(a), len(b) - 1)
    while n < top and a[n] == b[n]:
        n += 1
    return n
