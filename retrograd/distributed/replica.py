"""One worker of a distributed run: the model (mmap), a replica of the adapter with its optimizer
state, and on demand a llama.cpp generator. The cluster runs it as a Ray actor; it knows nothing
of Ray itself, so it is also usable (and tested) in-process.

A step's gradient is computed in two calls: `gradients` (this worker's share of the micro-batches:
their summed adapter gradient and the tally of their losses) and, once the driver has summed every
worker's share, `apply` (the summed gradient written into the replica and the same AdamW step the
driver takes). Every replica applies identical float32 arithmetic to identical inputs, so the
replicas stay bit-identical; `digest` lets the driver check that they do.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np

from retrograd import native
from retrograd.batch import Tally
from retrograd.engine import LoraSpec, Trainable
from retrograd.generation.llama import Generator
from retrograd.memory import peak_rss_mib

#: the slots that make up a replica's state (the gradient slot is scratch, overwritten each step)
STATE_SLOTS = (native.SLOT_PARAM, native.SLOT_ADAM_M, native.SLOT_ADAM_V)


def read_state(tr: Trainable) -> dict[int, list[np.ndarray]]:
    return {slot: list(tr.lora.state(slot).values()) for slot in STATE_SLOTS}


def write_state(tr: Trainable, state: dict[int, list[np.ndarray]]) -> None:
    for slot, arrays in state.items():
        for t, a in zip(tr.lora.tensors, arrays):
            tr.lora.write(t.index, a, slot)
    tr.lora.zero(native.SLOT_GRAD)


def digest(tr: Trainable) -> str:
    """A hash of the adapter and its optimizer state: equal on two replicas only if they hold the
    same bits."""
    h = hashlib.sha256()
    for arrays in read_state(tr).values():
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def read_grads(tr: Trainable) -> list[np.ndarray]:
    return list(tr.lora.state(native.SLOT_GRAD).values())


def write_grads(tr: Trainable, grads: list[np.ndarray]) -> None:
    for t, g in zip(tr.lora.tensors, grads):
        tr.lora.write(t.index, g, native.SLOT_GRAD)


class Replica:
    def __init__(self, rank: int, model_path: str, spec: LoraSpec, device: str, threads: int,
                 recompute: bool = False, matmul: str = "auto") -> None:
        self.rank = rank
        self.threads = threads
        self.tr = Trainable(Path(model_path), spec, device=device, threads=threads)
        self.tr.engine.set_recompute(recompute)
        self.tr.engine.set_matmul_mode(matmul)      # the driver's rounding, so the replicas agree
        self.gen: Generator | None = None
        self.gen_key: tuple | None = None
        self.adapter_version = -1

    def pid(self) -> int:
        return os.getpid()

    # ---- the replica's state -------------------------------------------------------------------
    def load_state(self, state: dict[int, list[np.ndarray]]) -> str:
        write_state(self.tr, state)
        return digest(self.tr)

    def digest(self) -> str:
        return digest(self.tr)

    # ---- one step --------------------------------------------------------------------------------
    def gradients(self, micro: list) -> dict:
        """The summed gradient of these micro-batches (each a MicroBatch: batch, loss, flags) and
        their tally. A non-finite loss comes back as `failure` (the driver skips the step)."""
        t0 = time.monotonic()
        tally = Tally()
        self.tr.lora.zero(native.SLOT_GRAD)
        failure = None
        try:
            for mb in micro:
                self.tr.accumulate(mb.batch, mb.coefficients(tally),
                                   entropy=mb.want_entropy, hidden=mb.want_hidden)
        except native.NativeError as exc:
            if exc.status != native.STATUS_NONFINITE:
                raise
            failure = str(exc)
        grads = None if failure else read_grads(self.tr)
        peak_mib = peak_rss_mib()
        return {"grads": grads, "tally": tally.state(), "seconds": time.monotonic() - t0, "failure": failure,
                "rank": self.rank, "peak_mib": peak_mib}

    def apply(self, grads: list[np.ndarray], hp: dict) -> float:
        """Write the step's summed gradient and take the driver's AdamW step; returns the gradient
        norm (the driver compares it with its own)."""
        write_grads(self.tr, grads)
        return self.tr.optimizer_step(**hp)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, key: tuple, version: int, adapter: list, method: str, args: tuple) -> list:
        """Run Generator.<method>(*args) with the driver's generator settings `key` and adapter
        `version` (its bytes in `adapter`, a one-element list holding an object reference that is
        fetched only when this replica's adapter is older)."""
        if key != self.gen_key or self.gen is None:     # (no generator yet: gen_key is None too)
            if self.gen is not None:
                self.gen.close()
            path, n_ctx, n_seq, device = key
            self.gen = Generator(path, n_ctx=n_ctx, n_seq=n_seq, threads=self.threads, device=device)
            self.gen_key, self.adapter_version = key, -1
        if version != self.adapter_version:
            data = adapter[0]
            if data is not None and not isinstance(data, bytes):
                import ray  # the reference was sent as is; only a Ray worker ever receives one

                data = ray.get(data)
            self.gen.set_adapter(data)
            self.adapter_version = version
        return getattr(self.gen, method)(*args)

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()
        self.tr.close()
