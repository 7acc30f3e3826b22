"""Tiny synthetic GGUF models written with the `gguf` package, for fast exact tests.

Weights are random F32 (or quantized where asked) and there is a minimal byte-level
tokenizer so that llama.cpp can load the file too.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def write_tiny(path: Path, arch: str = "llama", *, n_layer: int = 2, n_embd: int = 64,
               n_head: int = 4, n_head_kv: int = 2, n_ff: int = 96, n_vocab: int = 260,
               head_dim: int | None = None, seed: int = 0, qtype: str = "F32",
               n_swa: int = 4, tied: bool = True, rope_base: float = 10000.0) -> Path:
    """Write a random model of the given family; returns the path."""
    rng = np.random.default_rng(seed)
    hd = head_dim or n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(rope_base)
    w.add_key_length(hd)
    w.add_value_length(hd)
    if arch == "gemma3":
        w.add_sliding_window(n_swa)
    # a byte-level vocabulary: enough for llama.cpp to load the file
    tokens = [f"<0x{i:02X}>".encode() for i in range(256)] + [b"<s>", b"</s>", b"<unk>", b"<pad>"]
    tokens += [f"<extra{i}>".encode() for i in range(n_vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([6] * 256 + [3] * (n_vocab - 256))
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)

    qt = getattr(gguf.GGMLQuantizationType, qtype)

    def t(name: str, shape: tuple[int, ...], scale: float = 0.2, quant: bool = True) -> None:
        arr = (rng.standard_normal(shape) * scale).astype(np.float32)
        if quant and qt != gguf.GGMLQuantizationType.F32 and len(shape) == 2:
            data = gguf.quants.quantize(arr, qt)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
        else:
            w.add_tensor(name, arr)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", (n_vocab, n_embd), 0.5)
    if not tied:
        t("output.weight", (n_vocab, n_embd), 0.3)
    norm("output_norm.weight", n_embd)
    q_out, kv_out = n_head * hd, n_head_kv * hd
    for il in range(n_layer):
        p = f"blk.{il}."
        norm(p + "attn_norm.weight", n_embd)
        norm(p + "ffn_norm.weight", n_embd)
        t(p + "attn_q.weight", (q_out, n_embd))
        t(p + "attn_k.weight", (kv_out, n_embd))
        t(p + "attn_v.weight", (kv_out, n_embd))
        t(p + "attn_output.weight", (n_embd, q_out))
        t(p + "ffn_gate.weight", (n_ff, n_embd))
        t(p + "ffn_up.weight", (n_ff, n_embd))
        t(p + "ffn_down.weight", (n_embd, n_ff))
        if arch == "qwen2":
            for nm, n in (("attn_q", q_out), ("attn_k", kv_out), ("attn_v", kv_out)):
                w.add_tensor(p + nm + ".bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if arch == "gemma3":
            norm(p + "post_attention_norm.weight", n_embd)
            norm(p + "post_ffw_norm.weight", n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
