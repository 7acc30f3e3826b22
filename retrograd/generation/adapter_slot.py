"""The adapter slot of a Generator (llama.py): `set_adapter` picks one of three small strategies
from the adapter's kind and the weights the generator has open, once per call:

- `_swap_lora`: a LoRA adapter (or none) on ordinary weights, loaded by llama.cpp from the bytes in
  place (fmemopen: never a temporary file, never a copy);
- `_swap_joined`: an adapter (or none) on a split copy (split.py), joined to the copy's block
  offsets (joint.py), without which its weights must never be decoded;
- `_swap_merged`: a DoRA adapter, which llama.cpp cannot apply: the model is reloaded with it
  merged in (F16, cached: merge.py).

glibc's fmemopen is bound on first use, so that importing the generator works on a libc without it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as lc

from retrograd import adapter as adapter_io
from retrograd.errors import GenerationError
from retrograd.generation.joint import JointAdapter
from retrograd.libc import Lazy

# the C library's, bound at the first adapter read from memory, not at import (retrograd.libc)
_fmemopen = Lazy("fmemopen", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p])
_fclose = Lazy("fclose", ctypes.c_int, [ctypes.c_void_p])


class AdapterSlot:
    """The adapter half of Generator: what it holds in the slot and how an adapter is swapped in.
    The generator opens its weights (`_open`, `_reopen`) and sets these attributes there."""

    path: Path
    _model: Any                    # llama.cpp's model and context
    _ctx: Any
    _joint: JointAdapter | None    # a split copy's offsets, joined to every adapter
    _adapter: Any                  # the llama.cpp adapter applied now (a split copy's: with its offsets)
    _merged: Path | None           # a DoRA adapter's merged model, when loaded instead of `path`
    _trained: bool                 # whether a training adapter is in
    _cache: list[int]              # tokens whose keys/values the KV cache holds for reuse

    def _open(self, path: Path) -> None:
        raise NotImplementedError

    def _reopen(self, path: Path) -> None:
        raise NotImplementedError

    def set_adapter(self, data: bytes | None, scale: float = 1.0) -> None:
        """Swap in an adapter from GGUF bytes (None switches it off). A DoRA adapter cannot be applied by
        llama.cpp: the generator loads the model with it merged in (F16, cached; generation/merge.py)
        and loads the base again when switched back, so that switch reloads weights."""
        if data is not None and adapter_io.kind_of(data) == "dora":
            self._swap_merged(data)
        elif self._joint is not None:
            self._swap_joined(self._joint, data, scale)
        else:
            self._swap_lora(data, scale)

    def load_adapter(self, path: str | os.PathLike) -> None:
        self.set_adapter(Path(path).read_bytes())

    @property
    def has_adapter(self) -> bool:
        return self._trained or self._merged is not None

    # ---- the strategies --------------------------------------------------------------------------
    def _swap_merged(self, data: bytes) -> None:
        from retrograd.generation.merge import merged_model

        old = self._adapter
        if self._joint is not None:       # the base is a split copy (a merged model is never one)
            raise GenerationError(f"{self.path}: a split generator copy cannot apply a DoRA adapter "
                                  '(set generator_weights = "native")')
        merged = merged_model(self.path, data)
        if old is not None:
            self._apply(None)
            lc.llama_adapter_lora_free(old)
            self._adapter = None
        if merged != self._merged:
            try:
                self._reopen(merged)
            except GenerationError:
                self._open(self.path)       # keep a working generator: the base model
                self._merged = None
                raise
            self._merged = merged
        self._cache = []

    def _swap_joined(self, joint: JointAdapter, data: bytes | None, scale: float) -> None:
        self._release()
        try:
            ad = joint.load(self._model, data, scale)
        except GenerationError:
            # never decode the split weights without their offsets
            self._adapter = joint.load(self._model, None)
            self._apply(self._adapter)
            raise
        if not self._apply(ad):
            lc.llama_adapter_lora_free(ad)
            raise GenerationError("llama.cpp could not apply the adapter")
        self._adapter, self._trained = ad, data is not None

    def _swap_lora(self, data: bytes | None, scale: float) -> None:
        self._release()
        if data is None:
            return
        # llama.cpp reads the bytes in place ("rb": fmemopen never writes), no copy of the adapter
        data = data if isinstance(data, bytes) else bytes(data)
        fp = _fmemopen(data, len(data), b"rb")
        if not fp:
            raise OSError("fmemopen failed")
        try:
            ad = lc.llama_adapter_lora_init_from_file_ptr(self._model, fp)
        finally:
            _fclose(fp)
        if not ad:
            raise GenerationError("llama.cpp rejected the adapter (is it for this model?)")
        if not self._apply(ad, scale):
            self._apply(None)
            lc.llama_adapter_lora_free(ad)
            raise GenerationError("llama.cpp could not apply the adapter")
        self._adapter, self._trained = ad, True

    # ---- helpers -----------------------------------------------------------------------------
    def _release(self) -> None:
        """Bare weights before another adapter loads: the base model again after a merged one, the
        current adapter out and freed first, so that two adapters never sit in memory together
        (GRPO swaps one every step, and the swap was the step's peak resident memory)."""
        old = self._adapter
        if self._merged is not None:
            self._reopen(self.path)
            self._merged = None
            old = None                    # freed with the merged model's context
        self._apply(None)
        self._adapter = None
        self._cache = []               # cached keys/values were computed with other weights
        if old is not None:
            lc.llama_adapter_lora_free(old)
        self._trained = False

    def _apply(self, ad, scale: float = 1.0) -> bool:
        """Give the context the adapter `ad` (None: none)."""
        if ad is None:
            return lc.llama_set_adapters_lora(self._ctx, None, 0, None) == 0
        arr = (lc.llama_adapter_lora_p_ctypes * 1)(ad)
        return lc.llama_set_adapters_lora(self._ctx, arr, 1, (ctypes.c_float * 1)(scale)) == 0
