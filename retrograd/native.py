"""Python face of the native engine (native/retrograd.h, and native/retrograd_test.h's entry points
for tests and benchmarks); the only module that touches cffi.

Everything here is a thin, typed wrapper: models, LoRA tensors, micro-batches, the forward and
training calls, AdamW, preflight. Errors from C arrive as NativeError carrying the C message and
status (NativeMemoryError, also a MemoryError, when memory ran out). Every constant (statuses,
targets, slots, device kinds, matmul modes and kernels, RG_NO_PREFIX) is read from the compiled
header (lib.RG_*), never copied.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import numpy as np

from retrograd.batch import NO_PREFIX, Batch, CoeffFn, LossInputs, LossOutputs  # noqa: F401 - re-exported for callers
from retrograd.errors import RetrogradError
from retrograd.logs import log
from retrograd.run_setup import resolve_threads

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

if lib.RG_NO_PREFIX != NO_PREFIX:  # pragma: no cover - a header and retrograd.batch that disagree
    raise ImportError(f"native/retrograd.h has RG_NO_PREFIX = {lib.RG_NO_PREFIX}, "
                      f"retrograd.batch.NO_PREFIX is {NO_PREFIX}")

#: LoRA targets in RG_TARGET_* order (bit i of a target mask is TARGETS[i])
TARGETS: tuple[str, ...] = tuple(ffi.string(lib.rg_target_name(i)).decode() for i in range(lib.RG_N_TARGETS))
SLOT_PARAM, SLOT_GRAD, SLOT_ADAM_M, SLOT_ADAM_V = lib.RG_SLOT_PARAM, lib.RG_SLOT_GRAD, lib.RG_SLOT_ADAM_M, lib.RG_SLOT_ADAM_V

# rg_status codes, for comparisons with NativeError.status
STATUS_OK = lib.RG_OK
STATUS_ARG = lib.RG_ERR_ARG
STATUS_IO = lib.RG_ERR_IO
STATUS_FORMAT = lib.RG_ERR_FORMAT
STATUS_UNSUPPORTED = lib.RG_ERR_UNSUPPORTED
STATUS_DEVICE = lib.RG_ERR_DEVICE
STATUS_COMPUTE = lib.RG_ERR_COMPUTE
STATUS_NONFINITE = lib.RG_ERR_NONFINITE
STATUS_CALLBACK = lib.RG_ERR_CALLBACK
STATUS_NOMEM = lib.RG_ERR_NOMEM
_KINDS = {STATUS_ARG: "bad argument", STATUS_IO: "I/O error", STATUS_FORMAT: "format error",
          STATUS_UNSUPPORTED: "unsupported", STATUS_DEVICE: "device error", STATUS_COMPUTE: "compute error",
          STATUS_NONFINITE: "non-finite value", STATUS_CALLBACK: "callback error", STATUS_NOMEM: "out of memory"}


class NativeError(RetrogradError, RuntimeError):
    """A failure reported by the native engine: .status is the rg_status code (compare it with the
    STATUS_* constants), .kind a short description of it, the message the C side's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = _KINDS.get(status, "error")


class NativeMemoryError(NativeError, MemoryError):
    """The native engine ran out of memory (RG_ERR_NOMEM): host memory, or a device buffer. The
    message says what could not be allocated; a smaller micro-batch, weight cache or model helps."""


def _check(status: int) -> None:
    if status == STATUS_OK:
        return
    message = ffi.string(lib.rg_last_error()).decode("utf-8", "replace")
    if status == STATUS_NOMEM:
        raise NativeMemoryError(status, message if message.startswith("out of") else f"out of memory: {message}")
    raise NativeError(status, message)


def _free(free: Callable, ptr, _parents: tuple) -> None:
    """Frees a C object; the parents ride along only so they outlive it."""
    free(ptr)


class Closeable:
    """`with` support for objects with an idempotent close(): the handles below, and the objects
    that own them (engine.Trainable, the distillation teacher)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Handle(Closeable):
    """Owns one C object: its pointer and a finalizer that frees it exactly once, on close(), when
    the object is collected, or at interpreter exit (while the library is still loaded). Handles an
    object depends on (the Model under a Lora or an Engine) are held by its finalizer, so they are
    never freed first. close() is idempotent; a closed handle's methods raise ValueError."""

    _cptr = None
    _finalizer: weakref.finalize | None = None

    def _own(self, ptr, free: Callable, *parents: _Handle) -> None:
        self._cptr = ptr
        self._finalizer = weakref.finalize(self, _free, free, ptr, parents)

    @property
    def _ptr(self):
        if self._cptr is None:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._cptr

    @property
    def closed(self) -> bool:
        return self._cptr is None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._cptr = None


def _f32(a: np.ndarray, n: int) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.size != n:
        raise ValueError(f"expected {n} values, got {a.size}")
    return a


def _ptr(a: np.ndarray, ctype: str):
    return ffi.cast(ctype, a.ctypes.data) if a.size else ffi.NULL


def set_crash_note(text: str | None) -> None:
    """What the process writes to stderr if it dies of a fatal signal (a device driver's fault,
    issue 38), before dying of it as it would have; None clears it."""
    _check(lib.rg_crash_note_set(text.encode() if text else ffi.NULL))


# ---- devices ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    description: str
    kind: str
    memory_free: int
    memory_total: int


_DEVICE_KINDS = {lib.RG_DEVICE_CPU: "cpu", lib.RG_DEVICE_GPU: "gpu", lib.RG_DEVICE_IGPU: "igpu",
                 lib.RG_DEVICE_ACCEL: "accel"}


def devices() -> list[DeviceInfo]:
    out = []
    info = ffi.new("rg_device_info *")
    for i in range(lib.rg_device_count()):
        _check(lib.rg_device_get_info(i, info))
        out.append(DeviceInfo(i, ffi.string(info.name).decode(), ffi.string(info.description).decode(),
                              _DEVICE_KINDS.get(info.type, "accel"), info.memory_free, info.memory_total))
    return out


def select_device(want: str = "auto") -> DeviceInfo:
    idx = ffi.new("int *")
    _check(lib.rg_device_select(want.encode(), idx))
    return devices()[idx[0]]


# ---- the frozen weights' products ---------------------------------------------------------
#: the packed kernels (retrograd.h, RG_KERNEL_*) by the names rg_matmul_kernel gives them
PACKED_KERNELS = {"amx-bf16": lib.RG_KERNEL_AMX_BF16, "avx512-bf16": lib.RG_KERNEL_AVX512_BF16,
                  "avx2-f16": lib.RG_KERNEL_AVX2_F16}
#: how base-weight products are computed: [training].matmul_precision's values, and "f32" (the smooth
#: mode of the finite-difference tests), as a matmul mode and a kernel (RG_MATMUL_*, RG_KERNEL_*). The
#: plain modes leave the kernel to the CPU; the others force one route, for benchmarks and comparisons:
#: a packed kernel (named as it is) or ggml's own product of the 16-bit copies ("ggml-bf16", "ggml-f16").
MATMUL_ROUTES: dict[str, tuple[int, int]] = {
    "auto": (lib.RG_MATMUL_AUTO, lib.RG_KERNEL_AUTO), "bf16": (lib.RG_MATMUL_BF16, lib.RG_KERNEL_AUTO),
    "f16": (lib.RG_MATMUL_F16, lib.RG_KERNEL_AUTO), "native": (lib.RG_MATMUL_NATIVE, lib.RG_KERNEL_AUTO),
    "f32": (lib.RG_MATMUL_F32, lib.RG_KERNEL_AUTO),
    "amx-bf16": (lib.RG_MATMUL_BF16, lib.RG_KERNEL_AMX_BF16), "avx512-bf16": (lib.RG_MATMUL_BF16, lib.RG_KERNEL_AVX512_BF16),
    "avx2-f16": (lib.RG_MATMUL_F16, lib.RG_KERNEL_AVX2_F16),
    "ggml-bf16": (lib.RG_MATMUL_BF16, lib.RG_KERNEL_GGML), "ggml-f16": (lib.RG_MATMUL_F16, lib.RG_KERNEL_GGML),
}


def _route(matmul: str) -> tuple[int, int]:
    if matmul not in MATMUL_ROUTES:
        raise ValueError(f"matmul mode must be one of {', '.join(MATMUL_ROUTES)}, got {matmul!r}")
    return MATMUL_ROUTES[matmul]


def conv_type(matmul: str = "auto") -> str:
    """The type ("f16", "bf16"; "f32" for f32) of the copies of base weights matmul mode `matmul`
    multiplies through on this CPU ("auto": bf16 where the CPU has AVX512-BF16, else f16)."""
    return ffi.string(lib.rg_matmul_conv_type(_route(matmul)[0])).decode()


def matmul_kernel(matmul: str = "auto") -> str:
    """The kernel that multiplies those copies on this CPU: a packed kernel ("amx-bf16",
    "avx512-bf16", "avx2-f16") or "ggml" (ggml's own product: asked for, a mode that converts nothing
    or to another type, or a CPU without one). Raises NativeError where `matmul` forces a kernel
    this CPU cannot run."""
    name = ffi.new("char **")
    _check(lib.rg_matmul_kernel(*_route(matmul), name))
    return ffi.string(name[0]).decode()


def packed_kernels() -> list[str]:
    """The packed kernels this CPU runs (each can be forced by its name as a matmul mode)."""
    name = ffi.new("char **")
    return [k for k in PACKED_KERNELS if lib.rg_matmul_kernel(*MATMUL_ROUTES[k], name) == STATUS_OK]


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


class Model(_Handle):
    """A GGUF model loaded for training, weights in their stored types."""

    def __init__(self, path: str | os.PathLike, device: str = "auto", threads: int | None = None) -> None:
        self.path = os.fspath(path)
        self.device = select_device(device)
        out = ffi.new("rg_model **")
        _check(lib.rg_model_init(self.path.encode(), self.device.index, threads or resolve_threads(), out))
        self._own(out[0], lib.rg_model_free)
        raw = ffi.new("rg_model_info *")
        lib.rg_model_get_info(self._ptr, raw)
        vals = {}
        for f in fields(ModelInfo):
            v = getattr(raw, f.name)
            vals[f.name] = ffi.string(v).decode() if isinstance(v, ffi.CData) else v
        self.info = ModelInfo(**vals)
        log.info("model %s: %s, %d layers, width %d, on %s, %d threads", self.path, self.info.arch, self.info.n_layer,
                 self.info.n_embd, self.device.name, self.info.n_threads)

    def set_weight_cache(self, mib: int, matmul: str = "auto") -> float:
        """Keep 16-bit copies of the quantized target weights within `mib` MiB (0: none), of the type
        (and packed layout) an engine in matmul mode `matmul` multiplies; returns the MiB used.
        Results are unchanged (the copies are what the per-micro-batch conversion makes)."""
        mode, kernel = _route(matmul)
        used = ffi.new("size_t *")
        _check(lib.rg_model_set_weight_cache(self._ptr, int(mib) << 20, mode, kernel, used))
        return used[0] / (1 << 20)

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



# ---- LoRA ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraTensor:
    index: int
    name: str
    shape: tuple[int, int]   # numpy shape (rows, cols) = (ne1, ne0)


class Lora(_Handle):
    """LoRA A/B tensors (and DoRA's magnitudes) plus gradient and AdamW slots, on the model's device."""

    def __init__(self, model: Model, targets: Iterable[str], rank: int, alpha: float, *, dora: bool = False) -> None:
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
        self.dora = dora
        out = ffi.new("rg_lora **")
        _check(lib.rg_lora_init(model._ptr, mask, rank, alpha, lib.RG_LORA_DORA if dora else lib.RG_LORA_PLAIN, out))
        self._own(out[0], lib.rg_lora_free, model)
        self.scale = float(lib.rg_lora_scale(self._ptr))
        name = ffi.new("char **")
        ne0, ne1 = ffi.new("int64_t *"), ffi.new("int64_t *")
        self.tensors: list[LoraTensor] = []
        for i in range(lib.rg_lora_tensor_count(self._ptr)):
            _check(lib.rg_lora_tensor_info(self._ptr, i, name, ne0, ne1))
            self.tensors.append(LoraTensor(i, ffi.string(name[0]).decode(), (int(ne1[0]), int(ne0[0]))))
        self.index = {t.name: t for t in self.tensors}

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

    def reset_magnitude(self) -> None:
        """DoRA: every magnitude becomes the row norm of W + scale B A for the current A and B."""
        _check(lib.rg_lora_magnitude_reset(self._ptr))



# ---- weight formats -----------------------------------------------------------------------
def rows_bytes(type_id: int, n_rows: int, n_per_row: int) -> int:
    """Bytes of n_rows rows of n_per_row values in ggml type `type_id` (0: blocks do not fill a row)."""
    return int(lib.rg_rows_bytes(type_id, n_rows, n_per_row))


def dequantize_rows(type_id: int, raw: np.ndarray, n_rows: int, n_per_row: int) -> np.ndarray:
    """Rows of a GGUF tensor (its raw bytes, any ggml type number) as float32 [n_rows, n_per_row]."""
    raw = np.ascontiguousarray(raw)
    if raw.nbytes != lib.rg_rows_bytes(type_id, n_rows, n_per_row):
        raise ValueError(f"{raw.nbytes} bytes are not {n_rows} rows of {n_per_row} values of ggml type {type_id}")
    out = np.empty((n_rows, n_per_row), np.float32)
    _check(lib.rg_rows_dequantize(type_id, ffi.from_buffer(raw), _ptr(out, "float *"), n_rows, n_per_row))
    return out


def quantize_rows(type_id: int, values: np.ndarray) -> np.ndarray:
    """float32 [n_rows, n_per_row] in ggml type `type_id` by ggml's quantizer: the raw bytes, as uint8."""
    v = np.ascontiguousarray(values, np.float32)
    n_rows, n_per_row = v.shape
    nbytes = lib.rg_rows_bytes(type_id, n_rows, n_per_row)
    if nbytes == 0:
        _check(lib.rg_rows_quantize(type_id, _ptr(v, "float *"), ffi.NULL, n_rows, n_per_row))   # names the problem
    out = np.empty(nbytes, np.uint8)
    _check(lib.rg_rows_quantize(type_id, _ptr(v, "float *"), ffi.from_buffer(out), n_rows, n_per_row))
    return out.reshape(n_rows, nbytes // n_rows)


# ---- batches ------------------------------------------------------------------------------
def _c_batch(b: Batch, n_embd: int):
    c = ffi.new("rg_batch *")
    c.n_tokens = b.n_tokens
    c.tokens = _ptr(b.tokens, "int32_t *")
    c.positions = _ptr(b.positions, "int32_t *")
    c.seq_ids = _ptr(b.seq_ids, "int32_t *")
    c.prefix_ids = _ptr(b.prefix_ids, "int32_t *") if b.prefix_ids is not None else ffi.NULL
    c.n_targets = b.n_targets
    c.target_rows = _ptr(b.target_rows, "int32_t *")
    c.target_ids = _ptr(b.target_ids, "int32_t *")
    if b.embed_noise is not None:
        if b.embed_noise.shape != (b.n_tokens, n_embd):
            raise ValueError(f"embed_noise has shape {b.embed_noise.shape}, expected ({b.n_tokens}, {n_embd})")
        c.embed_noise = _ptr(b.embed_noise, "float *")
    c.lora_dropout = b.lora_dropout
    c.dropout_seed = int(b.dropout_seed) & 0xFFFFFFFFFFFFFFFF
    return c




# ---- engine -------------------------------------------------------------------------------
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
    graph_mib: float = 0.0


# ---- tests and benchmarks (native/retrograd_test.h) -----------------------------------------
_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q6_k": 14, "bf16": 30}


def matmul_bench(type_name: str, m: int, n: int, k: int, *, threads: int, reps: int = 10) -> float:
    """FLOP/s of ggml's CPU product of an [m, k] matrix of `type_name` with an F32 [k, n] one (one
    warm-up, then the mean of `reps`): the yardstick for a profile's rates, measured in the same run."""
    if type_name not in _GGML_TYPES:
        raise ValueError(f"matmul_bench: unknown type {type_name!r} (one of {', '.join(_GGML_TYPES)})")
    out = ffi.new("double *")
    _check(lib.rg_matmul_bench(_GGML_TYPES[type_name], m, n, k, threads, reps, out))
    return 2.0 * m * n * k / out[0]


def _packed_kernel(kernel: str) -> int:
    if kernel != "auto" and kernel not in PACKED_KERNELS:
        raise ValueError(f"packed kernel must be auto or one of {', '.join(PACKED_KERNELS)}, got {kernel!r}")
    return lib.RG_KERNEL_AUTO if kernel == "auto" else PACKED_KERNELS[kernel]


def gemm_check(type_name: str, w: np.ndarray, x: np.ndarray, *, kernel: str = "auto", transposed: bool = False,
               lowrank: tuple[np.ndarray, np.ndarray] | None = None, threads: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """A packed product (native/gemm.c; `kernel` one of packed_kernels(), "auto": the CPU's own) on its
    own: `w` [n_out, n_in] quantized to `type_name`, times `x` [tokens, n_in] (or W^T times `x`
    [tokens, n_out] when `transposed`), plus `z @ v` for `lowrank` = (v [rank, rows], z [tokens, rank]).
    The BF16 kernels round W and x to BF16; "avx2-f16" rounds W to F16 and keeps x in F32. Returns the
    product [tokens, rows] and W as quantized, dequantized, for an oracle. Raises where the kernel
    does not run."""
    if type_name not in _GGML_TYPES:
        raise ValueError(f"gemm_check: unknown type {type_name!r} (one of {', '.join(_GGML_TYPES)})")
    w = np.ascontiguousarray(w, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_out, n_in = w.shape
    rows = n_in if transposed else n_out
    out = np.empty((x.shape[0], rows), np.float32)
    deq = np.empty_like(w)
    v = z = np.zeros(0, np.float32)
    if lowrank is not None:
        v, z = (np.ascontiguousarray(a, dtype=np.float32) for a in lowrank)
    _check(lib.rg_gemm_check(_packed_kernel(kernel), _GGML_TYPES[type_name], _ptr(w, "float *"), n_out, n_in,
                             _ptr(x, "float *"), x.shape[0],
                             int(transposed), _ptr(v, "float *"), _ptr(z, "float *"), v.shape[0] if v.size else 0,
                             threads, _ptr(out, "float *"), _ptr(deq, "float *")))
    return out, deq


def gemm_bench(m: int, n: int, k: int, *, kernel: str = "auto", threads: int = 2, reps: int = 5) -> float:
    """FLOP/s of a packed product (`kernel` as for gemm_check: BF16, or "avx2-f16"'s F16 weights times
    F32 activations) of an [m, k] weight with [k, n] activations, both packed beforehand: the product
    alone. Raises where the kernel does not run."""
    out = ffi.new("double *")
    _check(lib.rg_gemm_bench(_packed_kernel(kernel), m, n, k, threads, reps, out))
    return 2.0 * m * n * k / out[0]


@dataclass(frozen=True)
class ProfileEntry:
    """One cell of a training-graph profile: phase ("forward"/"backward"), ggml op, and what the
    nodes work on (a target's base weight "q" ... "down", "lora", "attention" or "other")."""
    phase: str
    op: str
    kind: str
    ms: float
    flops: float
    count: int


class Engine(_Handle):
    """Forward, gradient accumulation and AdamW for one model."""

    def __init__(self, model: Model) -> None:
        self.model = model
        out = ffi.new("rg_engine **")
        _check(lib.rg_engine_init(model._ptr, out))
        self._own(out[0], lib.rg_engine_free, model)

    def _batch(self, batch: Batch):
        return _c_batch(batch, self.model.info.n_embd)

    def set_matmul_mode(self, mode: str) -> None:
        """'auto' (default), 'native' (llama.cpp's kernels, bit-equal), 'f16', 'bf16', 'f32' (smooth,
        slow), or a route forced (MATMUL_ROUTES: a packed kernel by its name, 'ggml-bf16', 'ggml-f16').
        Raises NativeError for a kernel this CPU cannot run, the engine unchanged."""
        _check(lib.rg_engine_set_matmul(self._ptr, *_route(mode)))

    def set_exact_ops(self, on: bool) -> None:
        """Exact composite ops everywhere (for finite-difference checks); see retrograd.h."""
        _check(lib.rg_engine_set_exact_ops(self._ptr, int(on)))

    def set_attention(self, mode: str) -> None:
        """'tiled' (default: memory grows with the tokens) or 'dense' (ggml's ops on whole score matrices)."""
        if mode not in ("tiled", "dense"):
            raise ValueError(f"attention must be 'tiled' or 'dense', got {mode!r}")
        _check(lib.rg_engine_set_attention(self._ptr, lib.RG_ATTENTION_TILED if mode == "tiled" else lib.RG_ATTENTION_DENSE))

    def set_recompute(self, on: bool) -> None:
        """Activation checkpointing: each layer recomputed in the backward from its saved input."""
        _check(lib.rg_engine_set_recompute(self._ptr, int(on)))

    def forward(self, lora: Lora | None, batch: Batch, entropy: bool = False,
                hidden: bool = False) -> LossInputs:
        k = batch.n_targets
        logp = np.zeros(k, np.float32)
        ent = np.zeros(k, np.float32) if entropy else None
        hid = np.zeros((batch.n_tokens, self.model.info.n_embd), np.float32) if hidden else None
        _check(lib.rg_engine_forward(
            self._ptr, lora._ptr if lora is not None else ffi.NULL, self._batch(batch),
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
        _check(lib.rg_engine_topk(self._ptr, lora._ptr if lora is not None else ffi.NULL, self._batch(batch), k,
                                  _ptr(ids, "int32_t *"), _ptr(lp, "float *"),
                                  _ptr(tlp, "float *") if tlp is not None else ffi.NULL))
        return ids[:n], lp[:n], (tlp[:n] if tlp is not None else None)

    def accumulate(self, lora: Lora, batch: Batch, fn: CoeffFn, entropy: bool = False,
                   hidden: bool = False) -> np.ndarray:
        """Adds d(loss)/d(params) to the GRAD slot; returns the targets' log-probs."""
        state = _CallbackState(fn)
        handle = ffi.new_handle(state)
        logp = np.zeros(max(batch.n_targets, 1), np.float32)
        status = lib.rg_engine_accumulate(self._ptr, lora._ptr, self._batch(batch), lib.rg_py_coeff, handle,
                                          int(entropy), int(hidden), _ptr(logp, "float *"))
        if state.error is not None:
            raise state.error
        _check(status)
        return logp[: batch.n_targets]

    def adamw(self, lora: Lora, *, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999,
              eps: float = 1e-8, weight_decay: float = 0.0, grad_scale: float = 1.0,
              grad_clip: float = 0.0, lr_b_ratio: float = 1.0) -> float:
        """One AdamW update from the accumulated gradient; returns the pre-clip gradient norm.
        `lr_b_ratio` (LoRA+): the B matrices learn at lr * lr_b_ratio."""
        p = ffi.new("rg_adamw *")
        p.lr, p.beta1, p.beta2, p.eps, p.lr_b_ratio = lr, beta1, beta2, eps, lr_b_ratio
        p.weight_decay, p.grad_scale, p.grad_clip, p.step = weight_decay, grad_scale, grad_clip, step
        norm = ffi.new("float *")
        _check(lib.rg_engine_adamw(self._ptr, lora._ptr, p, norm))
        return float(norm[0])

    def preflight(self, lora: Lora | None, n_tokens: int) -> dict[str, int]:
        """Ops of the training graph for n_tokens tokens (the forward graph without a lora) that the
        model's device cannot run: {op name: node count}, in ggml op order."""
        _check(lib.rg_engine_preflight(self._ptr, lora._ptr if lora is not None else ffi.NULL,
                                       n_tokens, ffi.NULL))
        op, count = ffi.new("char **"), ffi.new("int *")
        out = {}
        for i in range(lib.rg_engine_preflight_count(self._ptr)):
            _check(lib.rg_engine_preflight_get(self._ptr, i, op, count))
            out[ffi.string(op[0]).decode()] = int(count[0])
        return out

    def slow_paths(self) -> list[tuple[str, int, str]]:
        """The last preflight's slow paths: (what, nodes, why) for routes the device runs but that
        cost more than the CPU build's (its CPU-only kernels unavailable, or an F32 mode)."""
        what, count, why = ffi.new("char **"), ffi.new("int *"), ffi.new("char **")
        out = []
        for i in range(lib.rg_engine_slow_path_count(self._ptr)):
            _check(lib.rg_engine_slow_path_get(self._ptr, i, what, count, why))
            out.append((ffi.string(what[0]).decode(), int(count[0]), ffi.string(why[0]).decode()))
        return out

    def set_profiling(self, on: bool) -> None:
        _check(lib.rg_engine_set_profiling(self._ptr, int(on)))

    def profile(self, reset: bool = True) -> list[ProfileEntry]:
        """Per (phase, op, kind) tallies since the last reset, largest time first."""
        e = ffi.new("rg_profile_entry *")
        out = []
        for i in range(lib.rg_engine_profile_count(self._ptr)):
            _check(lib.rg_engine_profile_get(self._ptr, i, e))
            out.append(ProfileEntry("backward" if e.backward else "forward", ffi.string(e.op).decode(),
                                    ffi.string(e.kind).decode(), float(e.ms), float(e.flops), int(e.count)))
        if reset:
            lib.rg_engine_profile_reset(self._ptr)
        return out

    def timings(self) -> Timings:
        t = ffi.new("rg_timings *")
        lib.rg_engine_get_timings(self._ptr, t)
        return Timings(t.build_ms, t.alloc_ms, t.forward_ms, t.head_ms, t.backward_ms,
                       t.optimizer_ms, t.n_nodes, t.graph_mib)
