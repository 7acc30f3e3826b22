"""Write GGUF models of real shapes with random but valid weights, to measure scale without downloads.

Shapes (the published configurations of these families; the vocabulary is the real size, its
tokens are placeholders):

    llama-7b     n_embd 4096, 32 layers, 32 heads (32 kv), ff 11008, vocab 32000
    llama-3b     n_embd 3072, 28 layers, 24 heads (8 kv),  ff 8192,  vocab 128256
    qwen2-0.5b   n_embd 896,  24 layers, 14 heads (2 kv),  ff 4864,  vocab 151936
    qwen2-1.5b   n_embd 1536, 28 layers, 12 heads (2 kv),  ff 8960,  vocab 151936
    qwen2-7b     n_embd 3584, 28 layers, 28 heads (4 kv),  ff 18944, vocab 152064

The weights are Q4_K_M's mix: Q4_K everywhere, Q6_K for output.weight and for attn_v / ffn_down
in the layers llama.cpp's Q4_K_M gives more bits (the first and last eighth, and every third in
between); rows not a multiple of 256 wide fall back to Q8_0, as llama.cpp does (qwen2-0.5b's 896).
Blocks are random bytes with the block scales set so the weights have a standard deviation near
0.02 and mean near 0: every block is valid for ggml (no NaN, no overflow), and the forward pass
stays finite through any depth because of the RMS norms. Such a model says nothing about
quality; its memory and speed are a real model's of that shape.

    python scripts/make_synthetic_model.py llama-7b [--out DIR]     # prints the path
    python scripts/make_synthetic_model.py --list
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SHAPES = {
    # name: (arch, n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab)
    "llama-7b": ("llama", 4096, 32, 32, 32, 11008, 32000),
    "llama-3b": ("llama", 3072, 28, 24, 8, 8192, 128256),
    "qwen2-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151936),
    "qwen2-1.5b": ("qwen2", 1536, 28, 12, 2, 8960, 151936),
    "qwen2-7b": ("qwen2", 3584, 28, 28, 4, 18944, 152064),
}

QK_K = 256
Q4_K_BYTES, Q6_K_BYTES = 144, 210
STD = 0.02


def _f16_bytes(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K rows: w = d * sc * q - dmin * m with sc, m 6-bit and q 4-bit uniform. The std of
    w is about 258 d and its mean 0 when dmin = 7.5 d (E[sc q] = 236, E[m] = 31.5)."""
    nb = cols // QK_K
    raw = rng.integers(0, 256, (rows, nb, Q4_K_BYTES), dtype=np.uint8)
    d = STD / 258.0
    raw[:, :, 0:2] = _f16_bytes(d)
    raw[:, :, 2:4] = _f16_bytes(7.5 * d)
    return raw.reshape(rows, nb * Q4_K_BYTES)


def q6_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K rows: w = d * sc * (q - 32), sc int8 and q 6-bit uniform: std about 1370 d."""
    nb = cols // QK_K
    raw = rng.integers(0, 256, (rows, nb, Q6_K_BYTES), dtype=np.uint8)
    raw[:, :, 208:210] = _f16_bytes(STD / 1370.0)
    return raw.reshape(rows, nb * Q6_K_BYTES)


def q8_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 rows (w = d * q, q int8 uniform: std about 74 d), llama.cpp's fallback for rows
    that are not a multiple of 256 wide."""
    nb = cols // 32
    raw = rng.integers(0, 256, (rows, nb, 34), dtype=np.uint8)
    raw[:, :, 0:2] = _f16_bytes(STD / 74.0)
    return raw.reshape(rows, nb * 34)


def more_bits(il: int, n_layer: int) -> bool:
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M keeps in Q6_K."""
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def write(name: str, out_dir: Path) -> Path:
    import gguf

    arch, n_embd, n_layer, n_head, n_kv, n_ff, n_vocab = SHAPES[name]
    path = out_dir / f"synthetic-{name}-Q4_K_M.gguf"
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    hd = n_embd // n_head
    tmp = path.with_suffix(".gguf.partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_type("model")
    w.add_name(f"synthetic {name} (random weights)")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens = [f"<0x{i:02X}>".encode() for i in range(256)] + [b"<s>", b"</s>", b"<unk>"]
    tokens += [f"<t{i}>".encode() for i in range(n_vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([6] * 256 + [3] * 3 + [1] * (n_vocab - 259))
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K

    def mat(tname: str, rows: int, cols: int, six: bool = False) -> None:
        if cols % QK_K:         # k-quants need rows of whole 256-blocks; llama.cpp falls back too
            data, qt = q8_0_blocks(rows, cols, rng), gguf.GGMLQuantizationType.Q8_0
        else:
            data, qt = (q6_k_blocks(rows, cols, rng), q6) if six else (q4_k_blocks(rows, cols, rng), q4)
        w.add_tensor(tname, data, raw_shape=data.shape, raw_dtype=qt)

    def ones(tname: str, n: int) -> None:
        w.add_tensor(tname, np.ones(n, np.float32))

    mat("token_embd.weight", n_vocab, n_embd)
    mat("output.weight", n_vocab, n_embd, six=True)
    ones("output_norm.weight", n_embd)
    for il in range(n_layer):
        p = f"blk.{il}."
        ones(p + "attn_norm.weight", n_embd)
        ones(p + "ffn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_head * hd, n_embd)
        mat(p + "attn_k.weight", n_kv * hd, n_embd)
        mat(p + "attn_v.weight", n_kv * hd, n_embd, six=more_bits(il, n_layer))
        mat(p + "attn_output.weight", n_embd, n_head * hd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff, six=more_bits(il, n_layer))
        if arch == "qwen2":
            for nm, n in (("attn_q", n_head * hd), ("attn_k", n_kv * hd), ("attn_v", n_kv * hd)):
                w.add_tensor(p + nm + ".bias", np.zeros(n, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)       # a file of this name is always complete
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "retrograd" / "synthetic"),
                    help="directory (default ~/.cache/retrograd/synthetic); an existing file is reused")
    ap.add_argument("--list", action="store_true", help="list the shapes")
    args = ap.parse_args()
    if args.list or not args.shape:
        for k, (arch, e, nl, nh, nkv, ff, nv) in SHAPES.items():
            print(f"{k:<11} {arch:<6} n_embd {e}, {nl} layers, {nh} heads ({nkv} kv), ff {ff}, vocab {nv}")
        sys.exit(0 if args.list else 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(write(args.shape, out))


if __name__ == "__main__":
    main()
