"""Python face of the native engine (native/retrograd.h); the only module that touches cffi.

Everything here is a thin, typed wrapper: models, LoRA tensors, micro-batches, the forward and
training calls, AdamW, preflight. Errors from C arrive as NativeError carrying the C message.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import numpy as np

# ggml answers a failed internal assertion by attaching gdb and printing every frame; a short
# message is what a user needs, so that is switched off before the library loads.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

try:
    from retrograd._native import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "retrograd's native library is not built. Run `bash scripts/setup.sh` (or "
        "`pip install --no-build-isolation -e .` after `python scripts/fetch_vendor.py`)."
    ) from exc

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
SLOT_PARAM, SLOT_GRAD, SLOT_ADAM_M, SLOT_ADAM_V = 0, 1, 2, 3
_STATUS = {1: "bad argument", 2: "I/O error", 3: "format error", 4: "unsupported",
           5: "device error", 6: "compute error", 7: "non-finite value", 8: "callback error"}


class NativeError(RuntimeError):
    """A failure reported by the native engine; .status is the rg_status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = _STATUS.get(status, "error")


def _check(status: int) -> None:
    if status != 0:
        raise NativeError(status, ffi.string(lib.rg_last_error()).decode("utf-8", "replace"))


def _f32(a: np.ndarray, n: int) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.size != n:
        raise ValueError(f"expected {n} values, got {a.size}")
    return a


def _ptr(a: np.ndarray, ctype: str):
    return ffi.cast(ctype, a.ctypes.data) if a.size else ffi.NULL


# ---- devices ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    description: str
    kind: str
    memory_free: int
    memory_total: int


_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def devices() -> list[DeviceInfo]:
    out = []
    info = ffi.new("rg_device_info *")
    for i in range(lib.rg_device_count()):
        _check(lib.rg_device_get_info(i, info))
        out.append(DeviceInfo(i, ffi.string(info.name).decode(), ffi.string(info.description).decode(),
                              _KINDS.get(info.type, "accel"), info.memory_free, info.memory_total))
    return out


def select_device(want: str = "auto") -> DeviceInfo:
    idx = ffi.new("int *")
    _check(lib.rg_device_select(want.encode(), idx))
    return devices()[idx[0]]


def default_threads() -> int:
    env = os.environ.get("RETRO_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"RETRO_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"RETRO_THREADS must be a positive integer, got {env!r}")
        return n
    return os.cpu_count() or 1


# ---- models -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    n_rot: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float
    rope_freq_scale: float
    attn_scale: float
    embd_scale: float
    rope_mode: int
    n_swa: int
    n_swa_layers: int
    tied_output: int
    has_qk_norm: int
    n_params: int
    weight_bytes: int
    device_index: int
    device_name: str
    mmapped: int
    n_threads: int


class Model:
    """A GGUF model loaded for training, weights in their stored types."""

    def __init__(self, path: str | os.PathLike, device: str = "auto", threads: int | None = None) -> None:
        self.path = os.fspath(path)
        self.device = select_device(device)
        out = ffi.new("rg_model **")
        _check(lib.rg_model_init(self.path.encode(), self.device.index, threads or default_threads(), out))
        self._ptr = out[0]
        raw = ffi.new("rg_model_info *")
        lib.rg_model_get_info(self._ptr, raw)
        vals = {}
        for f in fields(ModelInfo):
            v = getattr(raw, f.name)
            vals[f.name] = ffi.string(v).decode() if isinstance(v, ffi.CData) else v
        self.info = ModelInfo(**vals)

    def set_threads(self, n: int) -> None:
        _check(lib.rg_model_set_threads(self._ptr, n))

    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        name, tname = ffi.new("char **"), ffi.new("char **")
        ne = ffi.new("int64_t[4]")
        out = []
        for i in range(lib.rg_model_tensor_count(self._ptr)):
            _check(lib.rg_model_tensor_info(self._ptr, i, name, tname, ne))
            shape = tuple(int(ne[j]) for j in range(4))
            while len(shape) > 1 and shape[-1] == 1:
                shape = shape[:-1]
            out.append((ffi.string(name[0]).decode(), ffi.string(tname[0]).decode(), shape))
        return out

    def target_dims(self, layer: int, target: str) -> tuple[int, int]:
        n_in, n_out = ffi.new("int64_t *"), ffi.new("int64_t *")
        _check(lib.rg_model_target_dims(self._ptr, layer, TARGETS.index(target), n_in, n_out))
        return int(n_in[0]), int(n_out[0])

    def close(self) -> None:
        if getattr(self, "_ptr", None) is not None:
            lib.rg_model_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, TypeError):   # interpreter shutdown: the library is already gone
            pass


# ---- LoRA ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraTensor:
    index: int
    name: str
    shape: tuple[int, int]   # numpy shape (rows, cols) = (ne1, ne0)


class Lora:
    """LoRA A/B tensors plus gradient and AdamW slots, living on the model's device."""

    def __init__(self, model: Model, targets: Iterable[str], rank: int, alpha: float) -> None:
        targets = list(targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; expected some of {list(TARGETS)}")
        mask = 0
        for t in targets:
            mask |= 1 << TARGETS.index(t)
        self.model = model
        self.targets = [t for t in TARGETS if t in targets]
        self.rank = rank
        self.alpha = alpha
        out = ffi.new("rg_lora **")
        _check(lib.rg_lora_init(model._ptr, mask, rank, alpha, out))
        self._ptr = out[0]
        self.scale = float(lib.rg_lora_scale(self._ptr))
        name = ffi.new("char **")
        ne0, ne1 = ffi.new("int64_t *"), ffi.new("int64_t *")
        self.tensors: list[LoraTensor] = []
        for i in range(lib.rg_lora_tensor_count(self._ptr)):
            _check(lib.rg_lora_tensor_info(self._ptr, i, name, ne0, ne1))
            self.tensors.append(LoraTensor(i, ffi.string(name[0]).decode(), (int(ne1[0]), int(ne0[0]))))
        self.index = {t.name: t for t in self.tensors}

    @property
    def n_params(self) -> int:
        return sum(t.shape[0] * t.shape[1] for t in self.tensors)

    def read(self, i: int, slot: int = SLOT_PARAM) -> np.ndarray:
        t = self.tensors[i]
        out = np.empty(t.shape, dtype=np.float32)
        _check(lib.rg_lora_read(self._ptr, i, slot, _ptr(out, "float *"), out.size))
        return out

    def write(self, i: int, values: np.ndarray, slot: int = SLOT_PARAM) -> None:
        t = self.tensors[i]
        arr = np.asarray(values, dtype=np.float32)
        if arr.shape != t.shape:
            raise ValueError(f"{t.name}: expected shape {t.shape}, got {arr.shape}")
        arr = np.ascontiguousarray(arr)
        _check(lib.rg_lora_write(self._ptr, i, slot, _ptr(arr, "float *"), arr.size))

    def zero(self, slot: int) -> None:
        _check(lib.rg_lora_zero(self._ptr, slot))

    def state(self, slot: int = SLOT_PARAM) -> dict[str, np.ndarray]:
        return {t.name: self.read(t.index, slot) for t in self.tensors}

    def load_state(self, state: dict[str, np.ndarray], slot: int = SLOT_PARAM) -> None:
        missing = [t.name for t in self.tensors if t.name not in state]
        extra = sorted(set(state) - set(self.index))
        if missing or extra:
            raise ValueError(f"LoRA tensors do not match: missing {missing[:3]}, unexpected {extra[:3]}")
        for t in self.tensors:
            self.write(t.index, state[t.name], slot)

    def close(self) -> None:
        if getattr(self, "_ptr", None) is not None:
            lib.rg_lora_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, TypeError):   # interpreter shutdown: the library is already gone
            pass


# ---- batches ------------------------------------------------------------------------------
@dataclass
class Batch:
    """One micro-batch of packed sequences and the (row, token id) targets to score."""

    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    target_rows: np.ndarray
    target_ids: np.ndarray
    prefix_ids: np.ndarray | None = None   # per row: another sequence whose rows it also sees

    def __post_init__(self) -> None:
        for f in ("tokens", "positions", "seq_ids", "target_rows", "target_ids"):
            setattr(self, f, np.ascontiguousarray(getattr(self, f), dtype=np.int32))
        n = len(self.tokens)
        if self.prefix_ids is not None:
            self.prefix_ids = np.ascontiguousarray(self.prefix_ids, dtype=np.int32)
            if len(self.prefix_ids) != n:
                raise ValueError("prefix_ids must have one entry per token")
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

    def _c(self):
        c = ffi.new("rg_batch *")
        c.n_tokens = self.n_tokens
        c.tokens = _ptr(self.tokens, "int32_t *")
        c.positions = _ptr(self.positions, "int32_t *")
        c.seq_ids = _ptr(self.seq_ids, "int32_t *")
        c.prefix_ids = _ptr(self.prefix_ids, "int32_t *") if self.prefix_ids is not None else ffi.NULL
        c.n_targets = self.n_targets
        c.target_rows = _ptr(self.target_rows, "int32_t *")
        c.target_ids = _ptr(self.target_ids, "int32_t *")
        return c


# ---- engine -------------------------------------------------------------------------------
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


class _CallbackState:
    def __init__(self, fn: CoeffFn) -> None:
        self.fn = fn
        self.error: BaseException | None = None


@ffi.def_extern()
def rg_py_coeff(user, n_targets, logp, entropy, coeff, n_tokens, n_embd, hidden, hidden_grad):
    state: _CallbackState = ffi.from_handle(user)
    try:
        k = int(n_targets)
        lp = np.frombuffer(ffi.buffer(logp, 4 * k), np.float32) if k else np.zeros(0, np.float32)
        ent = np.frombuffer(ffi.buffer(entropy, 4 * k), np.float32) if (entropy != ffi.NULL and k) else None
        hid = None
        if hidden != ffi.NULL:
            hid = np.frombuffer(ffi.buffer(hidden, 4 * n_tokens * n_embd), np.float32).reshape(n_tokens, n_embd)
        out = state.fn(LossInputs(lp, ent, hid))
        c = np.asarray(out.coeff, dtype=np.float32)
        if c.shape != (k,):
            raise ValueError(f"loss returned {c.shape} coefficients for {k} targets")
        if k:
            ffi.memmove(coeff, c.tobytes(), 4 * k)
        if out.hidden_grad is not None:
            if hidden_grad == ffi.NULL:
                raise ValueError("loss returned a hidden-state gradient but want_hidden was not set")
            g = np.ascontiguousarray(out.hidden_grad, np.float32)
            if g.shape != (n_tokens, n_embd):
                raise ValueError(f"hidden gradient of shape {g.shape}, expected {(n_tokens, n_embd)}")
            ffi.memmove(hidden_grad, g.tobytes(), g.nbytes)
        return 0
    except BaseException as exc:  # re-raised by Engine.accumulate
        state.error = exc
        return 1


@dataclass(frozen=True)
class Timings:
    build_ms: float
    alloc_ms: float
    forward_ms: float
    head_ms: float
    backward_ms: float
    optimizer_ms: float
    n_nodes: int


class Engine:
    """Forward, gradient accumulation and AdamW for one model."""

    def __init__(self, model: Model) -> None:
        self.model = model
        out = ffi.new("rg_engine **")
        _check(lib.rg_engine_init(model._ptr, out))
        self._ptr = out[0]

    def set_matmul_mode(self, mode: str) -> None:
        """'auto' (default), 'native' (llama.cpp's kernels, bit-equal), 'f16', or 'f32' (smooth, slow)."""
        modes = {"auto": 0, "native": 1, "f16": 2, "f32": 3}
        if mode not in modes:
            raise ValueError(f"matmul mode must be one of {sorted(modes)}, got {mode!r}")
        lib.rg_engine_set_matmul_mode(self._ptr, modes[mode])

    def set_exact_ops(self, on: bool) -> None:
        """Exact composite ops everywhere (for finite-difference checks); see retrograd.h."""
        lib.rg_engine_set_exact_ops(self._ptr, int(on))

    def set_head_budget(self, nbytes: int) -> None:
        lib.rg_engine_set_head_budget(self._ptr, nbytes)

    def forward(self, lora: Lora | None, batch: Batch, entropy: bool = False,
                hidden: bool = False) -> LossInputs:
        k = batch.n_targets
        logp = np.zeros(k, np.float32)
        ent = np.zeros(k, np.float32) if entropy else None
        hid = np.zeros((batch.n_tokens, self.model.info.n_embd), np.float32) if hidden else None
        _check(lib.rg_engine_forward(
            self._ptr, lora._ptr if lora is not None else ffi.NULL, batch._c(),
            _ptr(logp, "float *") if k else ffi.new("float[1]"),
            _ptr(ent, "float *") if ent is not None and k else ffi.NULL,
            _ptr(hid, "float *") if hid is not None else ffi.NULL))
        return LossInputs(logp, ent, hid)

    def topk(self, lora: Lora | None, batch: Batch, k: int,
             targets: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """For each target's row, the k most likely next tokens: ids [n_targets, k] int32 and
        their log-probs [n_targets, k] float32, best first; with targets=True also the targets'
        own log-probs [n_targets] from the same pass (as forward gives them)."""
        n = batch.n_targets
        ids = np.zeros((max(n, 1), k), np.int32)
        lp = np.zeros((max(n, 1), k), np.float32)
        tlp = np.zeros(max(n, 1), np.float32) if targets else None
        _check(lib.rg_engine_topk(self._ptr, lora._ptr if lora is not None else ffi.NULL, batch._c(), k,
                                  _ptr(ids, "int32_t *"), _ptr(lp, "float *"),
                                  _ptr(tlp, "float *") if targets else ffi.NULL))
        return ids[:n], lp[:n], (tlp[:n] if targets else None)

    def accumulate(self, lora: Lora, batch: Batch, fn: CoeffFn, entropy: bool = False,
                   hidden: bool = False) -> np.ndarray:
        """Adds d(loss)/d(params) to the GRAD slot; returns the targets' log-probs."""
        state = _CallbackState(fn)
        handle = ffi.new_handle(state)
        logp = np.zeros(max(batch.n_targets, 1), np.float32)
        status = lib.rg_engine_accumulate(self._ptr, lora._ptr, batch._c(), lib.rg_py_coeff, handle,
                                          int(entropy), int(hidden), _ptr(logp, "float *"))
        if state.error is not None:
            raise state.error
        _check(status)
        return logp[: batch.n_targets]

    def adamw(self, lora: Lora, *, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999,
              eps: float = 1e-8, weight_decay: float = 0.0, grad_scale: float = 1.0,
              grad_clip: float = 0.0) -> float:
        """One AdamW update from the accumulated gradient; returns the pre-clip gradient norm."""
        p = ffi.new("rg_adamw *")
        p.lr, p.beta1, p.beta2, p.eps = lr, beta1, beta2, eps
        p.weight_decay, p.grad_scale, p.grad_clip, p.step = weight_decay, grad_scale, grad_clip, step
        norm = ffi.new("float *")
        _check(lib.rg_engine_adamw(self._ptr, lora._ptr, p, norm))
        return float(norm[0])

    def preflight(self, lora: Lora | None, n_tokens: int) -> dict[str, int]:
        buf = ffi.new("char[8192]")
        n = ffi.new("int *")
        _check(lib.rg_engine_preflight(self._ptr, lora._ptr if lora is not None else ffi.NULL,
                                       n_tokens, buf, 8192, n))
        out = {}
        for line in ffi.string(buf).decode().splitlines():
            op, count = line.rsplit(" ", 1)
            out[op] = int(count)
        return out

    def set_profiling(self, on: bool) -> None:
        lib.rg_engine_set_profiling(self._ptr, int(on))

    def profile(self, reset: bool = True) -> list[tuple[str, float, int]]:
        """(op, milliseconds, count) per op kind, largest first, since the last reset."""
        buf = ffi.new("char[16384]")
        _check(lib.rg_engine_profile_report(self._ptr, buf, 16384, int(reset)))
        out = []
        for line in ffi.string(buf).decode().splitlines():
            op, ms, cnt = line.split(" ")
            out.append((op, float(ms), int(cnt)))
        return out

    def timings(self) -> Timings:
        t = ffi.new("rg_timings *")
        lib.rg_engine_get_timings(self._ptr, t)
        return Timings(t.build_ms, t.alloc_ms, t.forward_ms, t.head_ms, t.backward_ms,
                       t.optimizer_ms, t.n_nodes)

    def close(self) -> None:
        if getattr(self, "_ptr", None) is not None:
            lib.rg_engine_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, TypeError):   # interpreter shutdown: the library is already gone
            pass
