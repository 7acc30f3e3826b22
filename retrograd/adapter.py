"""llama.cpp LoRA adapters as GGUF: writing (to bytes, for the in-memory swap after every optimizer
step, or atomically to a file) and reading back (`[lora].init_adapter`, `--adapter`).

The format is what llama.cpp's loader expects: general.type = "adapter", adapter.type = "lora",
adapter.lora.alpha, and for every adapted weight W the F32 tensors "<W>.lora_a" (ne = [n_in, r])
and "<W>.lora_b" (ne = [r, n_out]). The writer is a few lines of struct packing: it runs on the hot
path of RL, where the adapter is re-serialised after each step.

A DoRA adapter is the same file with adapter.type = "dora" and a third tensor per weight,
"<W>.dora_m" (ne = [1, n_out]): llama.cpp refuses the type (it cannot apply the magnitudes), so
the file is never mistaken for a plain LoRA; generation merges it (retrograd/generation/merge.py).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.errors import RetrogradError
from retrograd.fsutil import atomic_write

ALIGN = 32
_T_UINT32, _T_FLOAT32, _T_STRING = 4, 6, 8
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8      # ggml type numbers


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


KINDS = ("lora", "dora")


def tensor_nbytes(typ: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type F32, F16 or Q8_0 (blocks of 32 along its last axis)."""
    n = int(np.prod(shape))
    return n // 32 * 34 if typ == GGML_Q8_0 else n * (2 if typ == GGML_F16 else 4)


def header(arch: str, alpha: float, infos: list[tuple[str, tuple[int, ...], int]], name: str = "retrograd adapter",
           kind: str = "lora") -> tuple[bytes, list[int]]:
    """An adapter GGUF's bytes up to its tensor data, and each tensor's data offset from there.
    infos: (name, shape in (ne1, ne0) order, ggml type: GGML_F32, GGML_F16 or GGML_Q8_0) of each
    tensor, in file order."""
    kv = [
        ("general.architecture", _T_STRING, _s(arch)),
        ("general.type", _T_STRING, _s("adapter")),
        ("general.name", _T_STRING, _s(name)),
        ("adapter.type", _T_STRING, _s(kind)),
        ("adapter.lora.alpha", _T_FLOAT32, struct.pack("<f", float(alpha))),
        ("general.alignment", _T_UINT32, struct.pack("<I", ALIGN)),
    ]
    out = io.BytesIO()
    out.write(b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kv)))
    for key, typ, val in kv:
        out.write(_s(key) + struct.pack("<I", typ) + val)
    offset, offsets = 0, []
    for tname, shape, typ in infos:
        dims = list(reversed(shape))          # GGUF lists ne0 first
        out.write(_s(tname) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims))
        out.write(struct.pack("<IQ", typ, offset))
        offsets.append(offset)
        offset += (tensor_nbytes(typ, shape) + ALIGN - 1) // ALIGN * ALIGN
    out.write(b"\0" * ((-out.tell()) % ALIGN))
    return out.getvalue(), offsets


def to_bytes(arch: str, alpha: float, tensors: dict[str, np.ndarray], name: str = "retrograd adapter",
             kind: str = "lora") -> bytes:
    """GGUF bytes of a LoRA (or DoRA) adapter. tensors maps names to numpy arrays in (ne1, ne0) order,
    written as F32 (float16 arrays as F16)."""
    # float16 arrays stay F16 (values that F16 holds exactly, like the split copy's block sums)
    arrays = [np.ascontiguousarray(a, dtype=np.float16 if getattr(a, "dtype", None) == np.float16 else np.float32)
              for a in tensors.values()]
    infos = [(n, a.shape, GGML_F16 if a.dtype == np.float16 else GGML_F32) for n, a in zip(tensors, arrays)]
    head, _ = header(arch, alpha, infos, name, kind)
    out = io.BytesIO()
    out.write(head)
    for a in arrays:
        out.write(a.tobytes())
        out.write(b"\0" * ((-a.nbytes) % ALIGN))
    return out.getvalue()


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Cursor:
    """Reads GGUF's little-endian values from bytes, front to back."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        vals = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return vals[0] if len(vals) == 1 else vals

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos]).decode()

    def value(self, typ: int):
        if typ == _T_STRING:
            return self.string()
        if typ == 9:                                   # array: item type, count, items
            item, n = self.take("<I"), self.take("<Q")
            return [self.value(item) for _ in range(n)]
        return self.take(_SCALARS[typ])


def parse(data: bytes) -> AdapterFile:
    """An adapter from GGUF bytes (F32 and F16 tensors), its arrays views into `data`, not copies:
    the generator reads the training adapter this way on every swap (generation/joint.py)."""
    if bytes(data[:4]) != b"GGUF":
        raise AdapterError("adapter bytes are not GGUF")
    cur = _Cursor(data)
    cur.pos = 4
    _, n_tensors, n_kv = cur.take("<IQQ")
    fields = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        tname = cur.string()
        n_dims = cur.take("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", data, cur.pos)
        cur.pos += 8 * n_dims
        typ, off = cur.take("<IQ")
        if typ not in (GGML_F32, GGML_F16):
            raise AdapterError(f"adapter tensor {tname}: ggml type {typ}, expected F32 or F16")
        infos.append((tname, tuple(reversed(dims)), typ, off))
    align = int(fields.get("general.alignment", ALIGN))
    base = (cur.pos + align - 1) // align * align
    tensors = {}
    for tname, shape, typ, off in infos:
        dt = np.float16 if typ == GGML_F16 else np.float32
        tensors[tname] = np.frombuffer(data, dt, int(np.prod(shape)), base + off).reshape(shape)
    ranks = {a.shape[0] for n, a in tensors.items() if n.endswith(".lora_a")}
    return AdapterFile(str(fields.get("general.architecture")), float(fields.get("adapter.lora.alpha") or 0.0),
                       min(ranks, default=0), tensors, str(fields.get("adapter.type", "lora")))


def write(path: Path, data: bytes) -> None:
    """Atomic: a kill at any moment leaves either the old file or the new one."""
    atomic_write(path, data)


def kind_of(data: bytes) -> str:
    """"lora" or "dora" for adapter bytes, read from the adapter.type key without parsing the file:
    GGUF spells a string key-value one way only (u64 length, key, type 8, u64 length, value)."""
    for kind in KINDS:
        if _s("adapter.type") + struct.pack("<I", _T_STRING) + _s(kind) in data[:65536]:
            return kind
    return "lora"


@dataclass
class AdapterFile:
    arch: str
    alpha: float
    rank: int
    tensors: dict[str, np.ndarray]
    kind: str = "lora"                 # "dora": tensors also hold "<W>.dora_m"

    @property
    def scale(self) -> float:
        """What the update B A is multiplied by: alpha / rank (1 when alpha is 0, llama.cpp's rule)."""
        return self.alpha / self.rank if self.alpha else 1.0


class AdapterError(RetrogradError, ValueError):
    pass


def read(path: Path) -> AdapterFile:
    """Read and check a llama.cpp LoRA GGUF; errors name the file and the problem."""
    import gguf

    path = Path(path)
    try:
        r = gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise AdapterError(f"{path}: no such adapter file") from None
    except Exception as exc:
        raise AdapterError(f"{path}: not a readable GGUF file ({exc})") from None

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") not in KINDS:
        raise AdapterError(f"{path}: not a LoRA or DoRA adapter (general.type={field('general.type')!r}, "
                           f"adapter.type={field('adapter.type')!r})")
    tensors: dict[str, np.ndarray] = {}
    for t in r.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        else:
            arr = np.array(t.data)
        shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))
        tensors[t.name] = np.asarray(arr, np.float32).reshape(shape)
    ranks = {a.shape[0] for n, a in tensors.items() if n.endswith(".lora_a")}
    if len(ranks) != 1:
        raise AdapterError(f"{path}: LoRA tensors have ranks {sorted(ranks)}; expected one rank")
    alpha = field("adapter.lora.alpha")
    return AdapterFile(str(field("general.architecture")), float(alpha or 0.0), ranks.pop(), tensors,
                       str(field("adapter.type")))
