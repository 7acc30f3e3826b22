"""Generation throughput: one sequence and a batch of 8 (one GRPO group) with retrograd's generator,
beside llama-cpp-python's own Llama.create_completion in the same run, plus the cost of swapping a
LoRA adapter in from memory.

    python scripts/bench_generate.py [--model M] [--tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from llama_cpp import Llama

    from retrograd.data.chat import format_for
    from retrograd.engine import LoraSpec, Trainable
    from retrograd.generation.llama import Generator, SamplingParams
    from retrograd.models import default_model_path

    model = args.model or str(default_model_path())
    gen = Generator(model, n_ctx=1024, n_seq=8, threads=args.threads)
    chat = format_for(gen.tokenizer)
    text = chat.render([{"role": "user", "content": "Write a long story about a dragon and a lighthouse."}],
                       add_generation_prompt=True)
    prompt = gen.tokenizer.encode(text)
    # ignore end tokens so every sequence generates exactly --tokens
    eog = gen.tokenizer.eog_ids
    gen.tokenizer.eog_ids = frozenset()

    def run(n: int) -> float:
        params = [SamplingParams(0.8, 0.95, 0, args.tokens, seed=i) for i in range(n)]
        t = time.perf_counter()
        outs = gen.generate(prompt, params)
        return sum(len(o.tokens) for o in outs) / (time.perf_counter() - t)

    run(1)
    one = statistics.median(run(1) for _ in range(args.repeats))
    eight = statistics.median(run(8) for _ in range(args.repeats))
    gen.tokenizer.eog_ids = eog

    llm = Llama(model_path=model, n_ctx=1024, n_threads=args.threads, verbose=False)
    llm.create_completion(prompt, max_tokens=8)

    def ref() -> float:
        llm.reset()
        t = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=args.tokens, temperature=0.8, top_p=0.95, seed=1)
        return out["usage"]["completion_tokens"] / (time.perf_counter() - t)

    lcpp = statistics.median(ref() for _ in range(args.repeats))

    tr = Trainable(model, LoraSpec(16, 32.0), threads=args.threads)
    rng = np.random.default_rng(0)
    for t in tr.lora.tensors:
        if t.name.endswith("lora_b"):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 1e-3)
    swaps = []
    for _ in range(5):
        t = time.perf_counter()
        gen.set_adapter(tr.adapter_bytes())
        swaps.append(time.perf_counter() - t)

    print(f"retrograd, 1 sequence      {one:7.1f} tokens/s")
    print(f"retrograd, batch of 8      {eight:7.1f} tokens/s  ({eight / one:.1f}x one sequence)")
    print(f"llama-cpp-python Llama     {lcpp:7.1f} tokens/s  (create_completion, 1 sequence)")
    print(f"adapter swap (r16, 7 targets, serialise + load): median {statistics.median(swaps) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
