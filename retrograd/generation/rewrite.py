"""A GGUF model file copied with some of its weights replaced, for llama.cpp: the metadata and every
other tensor byte for byte. Streamed (tensor infos first, then each new weight computed, written
and dropped), so memory holds one weight at a time whatever the model's size. Used by the DoRA
merge (merge.py) and the generator's split Q4_1 copy (split.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from retrograd import native
from retrograd.fsutil import atomic_path


def rewrite(reader, out: Path, replaced: Mapping[str, tuple[int, Callable[[object], np.ndarray]]],
            extra: Mapping[str, str] | None = None) -> None:
    """Write `reader`'s model (a gguf.GGUFReader) to `out` atomically. replaced maps a tensor's name
    to (its new ggml type, a function of the old tensor giving the new raw bytes as uint8); extra adds
    string keys to the metadata."""
    import gguf

    arch = str(reader.fields["general.architecture"].contents())
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
        for key, value in (extra or {}).items():
            writer.add_string(key, value)
        for t in reader.tensors:
            if t.name in replaced:
                n_out, n_in = int(t.shape[1]), int(t.shape[0])
                kind = replaced[t.name][0]
                nbytes = native.rows_bytes(kind, n_out, n_in)
                writer.add_tensor_info(t.name, (n_out, nbytes // n_out), np.dtype(np.uint8), nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType(kind))
            else:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(replaced[t.name][1](t) if t.name in replaced else t.data)
        writer.close()
