"""A generator with the interface of generation.llama.Generator whose sampling runs on the
cluster's workers: a call's groups (or a group's sequences, or a batch of conversations) are split
into one contiguous share per worker, each worker decodes its share with its own llama.cpp, and
the results come back in order. The adapter's bytes go into Ray's object store once per
set_adapter (once per step); a worker fetches them only when its copy is older.

Every sequence carries its own seeded sampler, so what a sequence draws does not depend on which
worker decodes it beyond the rounding of differently sized decode batches.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from retrograd.data.tokenizer import Tokenizer
from retrograd.generation.llama import Completion, SamplingParams, TokenIds


def split_even(n: int, parts: int) -> list[range]:
    """0..n-1 in `parts` contiguous runs whose lengths differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        end = start + base + (k < extra)
        out.append(range(start, end))
        start = end
    return out


class RemoteGenerator:
    """`cluster` is the run's distributed.Cluster (its generate, put and size)."""

    def __init__(self, cluster: Any, model_path: str | os.PathLike, *, n_ctx: int = 2048, n_seq: int = 1,
                 device: str = "auto") -> None:
        self.cluster = cluster
        self.path = Path(model_path)
        self.tokenizer = Tokenizer(self.path)
        self.n_ctx = n_ctx
        self.n_seq = max(1, n_seq)
        self.key = (str(self.path), n_ctx, self.n_seq, device)
        self.version = 0
        self.adapter: list = [None]

    # ---- adapters ------------------------------------------------------------------------------
    def set_adapter(self, data: bytes | None, scale: float = 1.0) -> None:
        if scale != 1.0:
            raise ValueError("a distributed generator applies adapters at scale 1 only")
        self.version += 1
        self.adapter = [None if data is None else self.cluster.put(data)]

    def load_adapter(self, path: str | os.PathLike) -> None:
        self.set_adapter(Path(path).read_bytes())

    @property
    def has_adapter(self) -> bool:
        return self.adapter[0] is not None

    # ---- decoding ----------------------------------------------------------------------------
    def _check(self, n: int) -> None:
        if n > self.n_seq:
            raise ValueError(f"{n} sequences requested, the context was made for {self.n_seq}")

    def _run(self, calls: list[tuple[str, tuple]]) -> list:
        return self.cluster.generate(self.key, self.version, self.adapter, calls)

    def _shares(self, n: int) -> list[range]:
        return [r for r in split_even(n, min(n, self.cluster.size)) if len(r)]

    def generate(self, prompt: TokenIds, params: Sequence[SamplingParams]) -> list[Completion]:
        self._check(len(params))
        shares = self._shares(len(params))
        parts = self._run([("generate", (list(prompt), [params[i] for i in r])) for r in shares])
        return [c for part in parts for c in part]

    def generate_each(self, prompts: Sequence[TokenIds], params: Sequence[SamplingParams]) -> list[Completion]:
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts for {len(params)} sampling settings")
        self._check(len(params))
        shares = self._shares(len(params))
        parts = self._run([("generate_each", ([list(prompts[i]) for i in r], [params[i] for i in r]))
                           for r in shares])
        return [c for part in parts for c in part]

    def generate_groups(self, prompts: Sequence[TokenIds],
                        params: Sequence[Sequence[SamplingParams]]) -> list[list[Completion]]:
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts for {len(params)} groups")
        self._check(sum(len(p) for p in params))
        shares = self._shares(len(prompts))
        parts = self._run([("generate_groups", ([list(prompts[i]) for i in r], [list(params[i]) for i in r]))
                           for r in shares])
        return [g for part in parts for g in part]

    def close(self) -> None:
        """The workers' generators live as long as the cluster."""
