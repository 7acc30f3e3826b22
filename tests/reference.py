"""A float64 numpy forward pass of the supported architectures, written from the GGUF with the
`gguf` package: the independent oracle the native engine's forward is checked against.

It is slow and simple on purpose (no caching, no fusion); use it on short sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


@dataclass
class RefModel:
    arch: str
    hp: dict
    w: dict

    @classmethod
    def load(cls, path: str) -> RefModel:
        r = gguf.GGUFReader(path)
        arch = _field(r, "general.architecture")
        p = arch + "."
        hp = {
            "n_layer": int(_field(r, p + "block_count")),
            "n_embd": int(_field(r, p + "embedding_length")),
            "n_head": int(_field(r, p + "attention.head_count")),
            "eps": float(_field(r, p + "attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_base": float(_field(r, p + "rope.freq_base", 10000.0)),
        }
        hp["n_head_kv"] = int(_field(r, p + "attention.head_count_kv", hp["n_head"]))
        hp["head_dim"] = int(_field(r, p + "attention.key_length", hp["n_embd"] // hp["n_head"]))
        hp["n_rot"] = int(_field(r, p + "rope.dimension_count", hp["head_dim"]))
        hp["n_swa"] = int(_field(r, p + "attention.sliding_window", 0) or 0)
        w = {}
        for t in r.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = [int(x) for x in reversed(t.shape)] if arr.ndim == 1 and len(t.shape) > 1 else arr.shape
            w[t.name] = np.asarray(arr, dtype=np.float64).reshape(shape)
        return cls(arch, hp, w)

    def set_lora(self, lora: dict[str, np.ndarray], scale: float, dropout: tuple[float, int] | None = None) -> None:
        """lora maps '<weight>.lora_a' / '.lora_b' to numpy arrays shaped (r, n_in) / (n_out, r), and
        for DoRA '<weight>.dora_m' to the magnitudes (n_out, 1); dropout = (p, seed) applies LoRA
        dropout's masks (dropout_mask) to the adapter's inputs."""
        self.lora = lora
        self.lora_scale = scale
        self.dropout = dropout

    def _lin(self, name: str, x: np.ndarray) -> np.ndarray:
        y = x @ self.w[name].T
        lora = getattr(self, "lora", None)
        if lora and name + ".lora_a" in lora:
            xa = x
            if getattr(self, "dropout", None):
                _, layer, kind, _ = name.split(".")
                p, seed = self.dropout
                xa = x * dropout_mask(seed, p, int(layer), TARGET_OF[kind], *x.shape)
            a, b = lora[name + ".lora_a"].astype(np.float64), lora[name + ".lora_b"].astype(np.float64)
            y = y + self.lora_scale * ((xa @ a.T) @ b.T)
            if name + ".dora_m" in lora:        # DoRA: rows of W + s B A rescaled to the magnitudes
                norm = np.linalg.norm(self.w[name] + self.lora_scale * (b @ a), axis=1)
                y = y * (lora[name + ".dora_m"][:, 0] / norm)
        b = name.replace(".weight", ".bias")
        if b in self.w:
            y = y + self.w[b]
        return y

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.hp["eps"]) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray, base: float, neox: bool) -> np.ndarray:
        # x: [T, H, D]
        n_rot = self.hp["n_rot"]
        inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        ang = pos[:, None].astype(np.float64) * inv[None, :]          # [T, n_rot/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        if neox:
            a, b = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]
            out[..., : n_rot // 2] = a * cos - b * sin
            out[..., n_rot // 2 : n_rot] = a * sin + b * cos
        else:
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        return out

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        hp, w, arch = self.hp, self.w, self.arch
        T = len(tokens)
        pos = np.arange(T)
        gemma = arch == "gemma3"
        neox = arch != "llama"
        x = w["token_embd.weight"][tokens]
        if gemma:
            x = x * np.sqrt(hp["n_embd"])
        H, KV, D = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
        for il in range(hp["n_layer"]):
            p = f"blk.{il}."
            h = self._rms(x, w[p + "attn_norm.weight"])
            q = self._lin(p + "attn_q.weight", h).reshape(T, H, D)
            k = self._lin(p + "attn_k.weight", h).reshape(T, KV, D)
            v = self._lin(p + "attn_v.weight", h).reshape(T, KV, D)
            if p + "attn_q_norm.weight" in w:
                q = self._rms(q, w[p + "attn_q_norm.weight"])
                k = self._rms(k, w[p + "attn_k_norm.weight"])
            swa = gemma and hp["n_swa"] > 0 and il % 6 < 5
            base = 10000.0 if swa else hp["rope_base"]
            q = self._rope(q, pos, base, neox)
            k = self._rope(k, pos, base, neox)
            scale = 1.0 / np.sqrt(D)
            mask = pos[None, :] <= pos[:, None]
            if swa:
                mask &= (pos[:, None] - pos[None, :]) < hp["n_swa"]
            out = np.zeros((T, H, D))
            for hh in range(H):
                kv = hh // (H // KV)
                s = (q[:, hh, :] @ k[:, kv, :].T) * scale
                s = np.where(mask, s, -np.inf)
                s = s - s.max(-1, keepdims=True)
                a = np.exp(s)
                a /= a.sum(-1, keepdims=True)
                out[:, hh, :] = a @ v[:, kv, :]
            o = self._lin(p + "attn_output.weight", out.reshape(T, H * D))
            if gemma:
                o = self._rms(o, w[p + "post_attention_norm.weight"])
            x = x + o
            h = self._rms(x, w[p + "ffn_norm.weight"])
            g = self._lin(p + "ffn_gate.weight", h)
            u = self._lin(p + "ffn_up.weight", h)
            if gemma:
                act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            else:
                act = g / (1 + np.exp(-g))
            f = self._lin(p + "ffn_down.weight", act * u)
            if gemma:
                f = self._rms(f, w[p + "post_ffw_norm.weight"])
            x = x + f
        x = self._rms(x, w["output_norm.weight"])
        out_w = w.get("output.weight", w["token_embd.weight"])
        return x @ out_w.T

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        z = self.logits(tokens)
        z = z - z.max(-1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return lp[np.arange(len(tokens) - 1), tokens[1:]]


# ---- LoRA dropout's masks: the numpy twin of native/dropout.c ----------------------------------
TARGET_OF = {"attn_q": 0, "attn_k": 1, "attn_v": 2, "attn_output": 3, "ffn_gate": 4, "ffn_up": 5, "ffn_down": 6}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def dropout_mask(seed: int, p: float, layer: int, target: int, n_rows: int, n_in: int) -> np.ndarray:
    """[n_rows, n_in] float32: element (row j, feature i) has index j * n_in + i; it is kept (as
    1 / (1 - p)) when the top 24 bits of splitmix64(base ^ index), over 2^24, are >= p, where
    base = splitmix64(seed + id * golden) and id = layer * 7 + target + 1."""
    ident = np.uint64(layer * 7 + target + 1)
    with np.errstate(over="ignore"):
        base = _splitmix64(np.array([np.uint64(seed) + ident * _GOLDEN], np.uint64))[0]
    k = np.arange(n_rows * n_in, dtype=np.uint64)
    u = (_splitmix64(base ^ k) >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    keep = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    return np.where(u >= np.float32(p), keep, np.float32(0.0)).astype(np.float32).reshape(n_rows, n_in)
