"""The model's own tokenizer, from llama.cpp (vocabulary only, no weights), and llama.cpp's log
routing (quiet unless RETRO_LOG / RUST_LOG asks for more).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import weakref
from functools import lru_cache
from pathlib import Path

import llama_cpp.llama_cpp as lc

from retrograd.errors import RetrogradError
from retrograd.logs import level_name

_LEVELS = {"off": 6, "error": 4, "warn": 3, "warning": 3, "info": 2, "debug": 1, "trace": 1}


def _log_threshold() -> int:
    return _LEVELS.get(level_name(), 3)


@lc.llama_log_callback
def _log_cb(level, text, _user):  # pragma: no cover - depends on llama.cpp's chatter
    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 cont
    if level >= _log_threshold() and level != 5:
        msg = text.decode("utf-8", "replace")
        # with a KV cache shared by a batch of sequences the cache is n_seq x the context, while each
        # sequence's positions stay within one context: llama.cpp's overflow warning does not apply
        if level == 3 and "n_ctx_seq" in msg and "n_ctx_train" in msg:
            return
        # an adapter's tensors live in the plain CPU buffer beside repacked weights, as they should
        if level == 3 and "cannot use buft" in msg and "fallback to CPU" in msg:
            return
        sys.stderr.write(msg)


_installed = False


def quiet_llama_logs() -> None:
    """Route llama.cpp's logging through the RETRO_LOG / RUST_LOG threshold (default: warnings)."""
    global _installed
    if not _installed:
        lc.llama_log_set(_log_cb, ctypes.c_void_p())
        _installed = True


class TokenizerError(RetrogradError):
    pass


class Tokenizer:
    """Tokenize and detokenize with a GGUF's vocabulary; exposes its chat template and end tokens."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        quiet_llama_logs()
        self.path = Path(model_path)
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise TokenizerError(f"{self.path}: llama.cpp could not read the vocabulary (not a GGUF model?)")
        self._free = weakref.finalize(self, lc.llama_model_free, self._model)
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self.bos_id = lc.llama_vocab_bos(self._vocab)
        self.eos_id = lc.llama_vocab_eos(self._vocab)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self._vocab, t))
        self.chat_template = self.meta("tokenizer.chat_template")
        self.arch = self.meta("general.architecture") or ""

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def encode(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        arr = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), arr, cap, add_bos, special)
        if n < 0:
            cap = -n
            arr = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._vocab, data, len(data), arr, cap, add_bos, special)
        return list(arr[:n])

    def piece(self, token: int, special: bool = True) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def decode(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        return self.piece(token, True).decode("utf-8", "replace")

    def vocab_sha256(self) -> str:
        """Fingerprint of the vocabulary: sha256 over every token's raw text, in id order. Two models
        can share distillation targets exactly when size and fingerprint agree."""
        if getattr(self, "_vocab_sha", None) is None:
            h = hashlib.sha256()
            for t in range(self.n_vocab):
                text = lc.llama_vocab_get_text(self._vocab, t) or b""
                h.update(len(text).to_bytes(4, "little") + text)
            self._vocab_sha = h.hexdigest()
        return self._vocab_sha

    def close(self) -> None:
        self._free()


@lru_cache(maxsize=4)
def load(model_path: str) -> Tokenizer:
    return Tokenizer(model_path)
