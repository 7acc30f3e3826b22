"""llama.cpp (through llama-cpp-python) as the reference for log-probs.

With its default settings llama.cpp rounds the KV cache to F16 and runs some quantized matmuls
through repacked kernels; both are rounding choices of its own, which the 8-bit activation
quantization of later layers amplifies into ~0.02-0.04 nats of per-token noise. For the equality
check the F32 KV cache and the plain kernels are chosen, so both sides compute the same function.
"""

from __future__ import annotations

from retrograd.eval.llama_ppl import token_logprobs


def llama(path, lora_path=None, n_ctx=1024, exact=True):
    """llama.cpp on `path` with every token's logits; exact: F32 KV cache and no repacked weights"""
    from retrograd.generation.llama import plain_llama

    kw = dict(type_k=0, type_v=0) if exact else {}
    return plain_llama(path, extra_buffers=not exact, lora_path=str(lora_path) if lora_path else None,
                       logits_all=True, n_ctx=n_ctx, n_threads=2, **kw)


#: log p(tokens[i] | tokens[:i]) from llama.cpp's logits (the export's scorer)
next_token_logprobs = token_logprobs
