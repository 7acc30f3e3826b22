"""How far each matmul precision's per-token log-probs are from llama.cpp's on the same tokens.

For each model and each `[training].matmul_precision` (and the smooth F32 mode), the engine's
log-probs of a few hundred tokens of English text are compared with llama.cpp's (through
llama-cpp-python, F32 KV cache and plain kernels: the reference tests/test_native.py uses), with
the base model and with a random non-zero adapter loaded on both sides. Prints mean and max
|difference| in nats. The figures docs/numerics.md quotes come from this script. `--modes` picks
other matmul precisions, e.g. routes forced by their kernel's name (avx2-f16, ggml-f16, ...).

    python scripts/parity_matmul.py [--modes native,f16,bf16,f32] [MODEL.gguf ...]
                                    (default: the default model and Gemma 3 270M)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from llama_ref import llama, next_token_logprobs  # noqa: E402

from retrograd import native  # noqa: E402
from retrograd.engine import LoraSpec, Trainable  # noqa: E402
from retrograd.models import cache_dir  # noqa: E402

TEXT = ("The history of mathematics deals with the origin of discoveries in mathematics and the mathematical "
        "methods and notation of the past. Before the modern age and the worldwide spread of knowledge, written "
        "examples of new mathematical developments have come to light only in a few locales. From 3000 BC the "
        "Mesopotamian states of Sumer, Akkad and Assyria, followed closely by Ancient Egypt and the Levantine "
        "state of Ebla began using arithmetic, algebra and geometry for purposes of taxation, commerce, trade "
        "and also in the patterns in nature, the field of astronomy and to record time and formulate calendars.")
MODES = ("native", "f16", "bf16", "f32")


def compare(path: Path, modes: tuple[str, ...] = MODES) -> None:
    tr = Trainable(path, LoraSpec(8, 16.0), threads=2)
    rng = np.random.default_rng(0)
    for t in tr.lora.tensors:
        if t.name.endswith("lora_b"):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 0.02)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = Path(tmp) / "a.gguf"
        tr.save_adapter(adapter)
        print(f"{path.name} (auto = {native.conv_type('auto')}, kernel {native.matmul_kernel('auto')} on this CPU)")
        print(f"  {'mode':<11} {'adapter':<8} {'mean |d|':>9} {'max |d|':>9}")
        for lora_path in (None, adapter):
            llm = llama(path, lora_path)
            toks = (llm.tokenize(TEXT.encode(), add_bos=True) * 3)[:300]
            ref = next_token_logprobs(llm, toks)
            del llm
            batch = native.Batch.next_token(np.array(toks, np.int32))
            for mode in modes:
                tr.engine.set_matmul_mode(mode)
                d = np.abs(tr.logprobs(batch, adapter=lora_path is not None).logp - ref)
                print(f"  {mode:<11} {'yes' if lora_path else 'no':<8} {d.mean():9.4f} {d.max():9.4f}")
    tr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated matmul modes (any of {', '.join(native.MATMUL_ROUTES)})")
    ap.add_argument("models", nargs="*", type=Path)
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    unknown = [m for m in modes if m not in native.MATMUL_ROUTES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}")
    models = args.models or [cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf", cache_dir() / "gemma-3-270m-q4_k_m.gguf"]
    for m in models:
        compare(m, modes)


if __name__ == "__main__":
    main()
