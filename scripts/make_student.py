"""Make a lower-bit student from a GGUF with llama.cpp's own quantizer (through llama-cpp-python):
the distillation example recovers what the harder quantization lost.

    python scripts/make_student.py                      # default model -> examples/distill-q2k/student.gguf
    python scripts/make_student.py --type Q3_K_S --model M.gguf --out S.gguf

Requantizing an already quantized file is allowed here on purpose (the default model ships as
Q4_1). Tensors whose rows do not fit the K-quant block size (256) fall back to llama.cpp's choice.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import llama_cpp.llama_cpp as lc

ROOT = Path(__file__).resolve().parent.parent
TYPES = {"Q2_K": lc.LLAMA_FTYPE_MOSTLY_Q2_K, "Q3_K_S": lc.LLAMA_FTYPE_MOSTLY_Q3_K_S,
         "Q3_K_M": lc.LLAMA_FTYPE_MOSTLY_Q3_K_M, "Q4_0": lc.LLAMA_FTYPE_MOSTLY_Q4_0}


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from retrograd.models import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="source GGUF (default: the embedded default model)")
    ap.add_argument("--type", default="Q2_K", choices=sorted(TYPES))
    ap.add_argument("--out", default=str(ROOT / "examples" / "distill-q2k" / "student.gguf"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    src = Path(args.model) if args.model else default_model_path()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    params = lc.llama_model_quantize_default_params()
    params.ftype = TYPES[args.type]
    params.allow_requantize = True
    params.nthread = args.threads
    tmp = out.with_name(out.name + ".tmp")
    rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        print(f"error: llama.cpp could not quantize {src} to {args.type} (status {rc})", file=sys.stderr)
        tmp.unlink(missing_ok=True)
        return 1
    tmp.replace(out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.type} from {src.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
