"""The trainable model: a quantized GGUF, a LoRA adapter on it, and the native engine that turns
per-token loss coefficients into adapter gradients. Algorithms and the trainer talk to this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd import adapter as adapter_io
from retrograd import native
from retrograd.batch import Batch, CoeffFn, LossInputs, LossOutputs  # noqa: F401 - re-exported
from retrograd.memory import return_large_blocks


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = native.TARGETS
    scaling: str = "standard"       # "rslora": the update is scaled by alpha / sqrt(rank)
    variant: str = "lora"           # "dora": a learned magnitude per output row (docs/numerics.md)

    @property
    def dora(self) -> bool:
        return self.variant == "dora"

    @property
    def effective_alpha(self) -> float:
        """The alpha llama.cpp's adapter format carries: it scales by alpha / rank, so rsLoRA's
        alpha / sqrt(rank) is written as alpha * sqrt(rank)."""
        return self.alpha * float(np.sqrt(self.rank)) if self.scaling == "rslora" else self.alpha


class Trainable(native.Closeable):
    """A model with a LoRA adapter, ready for forward passes and gradient accumulation. Owns the
    model, engine and adapter: close() (or leaving a `with` block) frees them, and is idempotent."""

    def __init__(self, model_path: str | os.PathLike, spec: LoraSpec, *, device: str = "auto",
                 threads: int | None = None, seed: int = 0) -> None:
        return_large_blocks()          # memory.py: freed per-step arrays go back to the system
        self.model_path = Path(model_path)
        self.model = native.Model(self.model_path, device=device, threads=threads)
        self.engine = native.Engine(self.model)
        self.spec = spec
        self.lora = native.Lora(self.model, spec.targets, spec.rank, spec.effective_alpha, dora=spec.dora)
        # the reference policy's adapter (KL in RL, preference losses): None is the base model; a run
        # that starts from [lora].init_adapter measures against that adapter, not the bare base
        self.reference: native.Lora | None = None
        self.init_lora(seed)

    @property
    def info(self) -> native.ModelInfo:
        return self.model.info

    def init_lora(self, seed: int) -> None:
        """Standard LoRA initialisation: A uniform in +-1/sqrt(n_in) (Kaiming with a=sqrt(5)), B = 0,
        so a fresh adapter leaves the model unchanged; DoRA's magnitudes start at W's row norms."""
        rng = np.random.default_rng(seed)
        for t in self.lora.tensors:
            if t.name.endswith(".lora_a"):
                bound = 1.0 / np.sqrt(t.shape[1])
                self.lora.write(t.index, rng.uniform(-bound, bound, t.shape).astype(np.float32))
            elif t.name.endswith(".lora_b"):
                self.lora.write(t.index, np.zeros(t.shape, np.float32))
        if self.spec.dora:
            self.lora.reset_magnitude()
        for slot in (native.SLOT_GRAD, native.SLOT_ADAM_M, native.SLOT_ADAM_V):
            self.lora.zero(slot)

    # ---- adapters as files -------------------------------------------------------------------
    def adapter_bytes(self) -> bytes:
        return adapter_io.to_bytes(self.info.arch, self.spec.effective_alpha, self.lora.state(),
                                   kind="dora" if self.spec.dora else "lora")

    def save_adapter(self, path: Path) -> None:
        adapter_io.write(path, self.adapter_bytes())

    def load_adapter(self, path: Path, *, reference: bool = False) -> None:
        """Load a llama.cpp LoRA GGUF into the adapter; it must match this model and spec. With
        `reference`, a frozen copy also becomes the reference policy (reference_logprobs)."""
        f = adapter_io.read(path)
        if f.arch != self.info.arch:
            raise adapter_io.AdapterError(f"{path}: adapter is for architecture {f.arch!r}, "
                                          f"the model is {self.info.arch!r}")
        want_kind = "dora" if self.spec.dora else "lora"
        if f.kind != want_kind:
            raise adapter_io.AdapterError(f"{path}: a {f.kind.upper()} adapter, and [lora].variant is {self.spec.variant!r}"
                                          f" (set variant = \"{f.kind}\" to use it)")
        if f.rank != self.spec.rank:
            raise adapter_io.AdapterError(f"{path}: adapter rank {f.rank} differs from [lora].rank = {self.spec.rank}")
        want = self.spec.effective_alpha
        if abs(f.alpha - want) > 1e-4 * max(1.0, want) and f.alpha != 0:
            how = f" ({self.spec.alpha} with rsLoRA scaling)" if self.spec.scaling == "rslora" else ""
            raise adapter_io.AdapterError(f"{path}: adapter alpha {f.alpha} differs from [lora].alpha = {want}{how}")
        missing = [t.name for t in self.lora.tensors if t.name not in f.tensors]
        extra = sorted(set(f.tensors) - set(self.lora.index))
        if missing or extra:
            raise adapter_io.AdapterError(
                f"{path}: adapter targets differ from [lora].targets = {list(self.spec.targets)} "
                f"(missing {missing[:2]}, unexpected {extra[:2]})")
        for t in self.lora.tensors:
            if f.tensors[t.name].shape != t.shape:
                raise adapter_io.AdapterError(f"{path}: {t.name} has shape {f.tensors[t.name].shape}, expected {t.shape}")
        dsts = [self.lora]
        if reference:
            if self.reference is None:
                self.reference = native.Lora(self.model, self.spec.targets, self.spec.rank, self.spec.effective_alpha,
                                             dora=self.spec.dora)
            dsts.append(self.reference)
        for dst in dsts:
            for t in dst.tensors:
                dst.write(t.index, f.tensors[t.name])

    # ---- computation ----------------------------------------------------------------------------
    def logprobs(self, batch: Batch, *, adapter: bool = True, entropy: bool = False,
                 hidden: bool = False) -> LossInputs:
        return self.engine.forward(self.lora if adapter else None, batch, entropy=entropy, hidden=hidden)

    def reference_logprobs(self, batch: Batch, **kw) -> LossInputs:
        """Log-probs under the reference policy: the model the run started from (the base model, or
        the base with [lora].init_adapter), which RL's KL term and preference losses measure against."""
        return self.engine.forward(self.reference, batch, **kw)

    def accumulate(self, batch: Batch, fn: CoeffFn, *, entropy: bool = False, hidden: bool = False) -> np.ndarray:
        return self.engine.accumulate(self.lora, batch, fn, entropy=entropy, hidden=hidden)

    def optimizer_step(self, **kw) -> float:
        return self.engine.adamw(self.lora, **kw)

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()
        self.lora.close()
        self.engine.close()
        self.model.close()
