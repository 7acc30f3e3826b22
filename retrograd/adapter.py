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
_GGML_F32, _GGML_F16 = 0, 1


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


KINDS = ("lora", "dora")


def to_bytes(arch: str, alpha: float, tensors: dict[str, np.ndarray], name: str = "retrograd adapter",
             kind: str = "lora") -> bytes:
    """GGUF bytes of a LoRA (or DoRA) adapter. tensors maps names to numpy arrays in (ne1, ne0) order,
    written as F32 (float16 arrays as F16)."""
    kv = [
        ("general.architecture", _T_STRING, _s(arch)),
        ("general.type", _T_STRING, _s("adapter")),
        ("general.name", _T_STRING, _s(name)),
        ("adapter.type", _T_STRING, _s(kind)),
        ("adapter.lora.alpha", _T_FLOAT32, struct.pack("<f", float(alpha))),
        ("general.alignment", _T_UINT32, struct.pack("<I", ALIGN)),
    ]
    out = io.BytesIO()
    out.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, typ, val in kv:
        out.write(_s(key) + struct.pack("<I", typ) + val)
    offset = 0
    blobs = []
    for tname, arr in tensors.items():
        # float16 arrays stay F16 (values that F16 holds exactly, like the split copy's block sums)
        half = getattr(arr, "dtype", None) == np.float16
        a = np.ascontiguousarray(arr, dtype=np.float16 if half else np.float32)
        dims = list(reversed(a.shape))          # GGUF lists ne0 first
        out.write(_s(tname) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims))
        out.write(struct.pack("<IQ", _GGML_F16 if half else _GGML_F32, offset))
        blobs.append(a)
        offset += (a.nbytes + ALIGN - 1) // ALIGN * ALIGN
    pad = (-out.tell()) % ALIGN
    out.write(b"\0" * pad)
    for a in blobs:
        out.write(a.tobytes())
        out.write(b"\0" * ((-a.nbytes) % ALIGN))
    return out.getvalue()


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
