"""Generation throughput: one sequence and a batch of 8 (one GRPO group) with retrograd's generator,
beside llama-cpp-python's own Llama.create_completion in the same run, plus the cost of swapping a
LoRA adapter in from memory. With --weights, a group of 8 is also decoded from each generator copy
(`[grpo].generator_weights`), the formats taking turns round by round, and each is given as a
ratio to the model file's own weights measured in the same rounds.

With --rollouts, the GRPO rollouts of examples/grpo-arith instead (4 prompts x 8 completions, at
most 24 new tokens, temperature 1): the groups decoded one at a time from the model file's weights
(how GRPO sampled when issue 12 was filed), all four together from them, and all four together
from each --weights generator format (split, bf16, ...; GRPO's default, "auto", is split for a Q4_1
model); the same prompts and seeds for every variant of a round, the order alternating, each given
as a ratio to the first in the same rounds. Every generator carries the example's LoRA adapter
(small random values), as GRPO's does.

    python scripts/bench_generate.py [--model M] [--tokens 64] [--threads N] [--weights f16,bf16,q8_0]
    python scripts/bench_generate.py --rollouts [--rounds 6] [--weights bf16,q8_0] [--threads N]

With --serve-steps, the serving scheduler's continuous batch (generation/batching.py) on its own,
per generator format (the model's own weights, then each --weights copy, default split): the time
to start 8 chat requests (their prompts decoded one by one, a shared prefix copied) and, per step of
8 sequences, the median time of Python's sampling against llama_decode's.

    python scripts/bench_generate.py --serve-steps [--weights split] [--tokens 64] [--threads 2]
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
    ap.add_argument("--weights", default="", help="generator copies to compare with the model's own weights, "
                                                  "comma-separated (f16, bf16, q8_0)")
    ap.add_argument("--rollouts", action="store_true", help="GRPO rollouts of examples/grpo-arith (see above)")
    ap.add_argument("--rounds", type=int, default=6, help="--rollouts: rounds, each on 4 new prompts")
    ap.add_argument("--serve-steps", action="store_true", help="the serving batch's per-step profile (see above)")
    args = ap.parse_args()
    if args.rollouts:
        rollouts(args)
        return
    if args.serve_steps:
        serve_steps(args)
        return
    from retrograd.data.chat import format_for
    from retrograd.engine import LoraSpec
    from retrograd.generation.llama import Generator, plain_llama
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
        return rate(gen, prompt, sampling(n, args.tokens))

    run(1)
    one = statistics.median(run(1) for _ in range(args.repeats))
    eight = statistics.median(run(8) for _ in range(args.repeats))
    formats = [w for w in args.weights.split(",") if w]
    copies = compare_weights(gen, model, formats, prompt, args) if formats else {}
    gen.tokenizer.eog_ids = eog

    llm = plain_llama(model, n_ctx=1024, n_threads=args.threads)
    llm.create_completion(prompt, max_tokens=8)

    def ref() -> float:
        llm.reset()
        t = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=args.tokens, temperature=0.8, top_p=0.95, seed=1)
        return out["usage"]["completion_tokens"] / (time.perf_counter() - t)

    lcpp = statistics.median(ref() for _ in range(args.repeats))

    tr = random_adapter(model, LoraSpec(16, 32.0), args.threads)
    swaps = []
    for _ in range(5):
        t = time.perf_counter()
        gen.set_adapter(tr.adapter_bytes())
        swaps.append(time.perf_counter() - t)

    print(f"retrograd, 1 sequence      {one:7.1f} tokens/s")
    print(f"retrograd, batch of 8      {eight:7.1f} tokens/s  ({eight / one:.1f}x one sequence)")
    print(f"llama-cpp-python Llama     {lcpp:7.1f} tokens/s  (create_completion, 1 sequence)")
    print(f"adapter swap (r16, 7 targets, serialise + load): median {statistics.median(swaps) * 1000:.0f} ms")
    if copies:
        base = copies["native"]
        print("batch of 8 by generator weights (rounds alternate; ratio: median of per-round ratios to native):")
        for name, rates in copies.items():
            ratio = statistics.median(r / b for r, b in zip(rates, base))
            print(f"  {name:<7} {statistics.median(rates):7.1f} tokens/s  {ratio:.2f}x")


def sampling(n: int, tokens: int) -> list:
    from retrograd.generation.llama import SamplingParams

    return [SamplingParams(0.8, 0.95, 0, tokens, seed=i) for i in range(n)]


def rate(gen, prompt: list[int], params: list) -> float:
    """tokens/s of one batched generate call"""
    t = time.perf_counter()
    outs = gen.generate(prompt, params)
    return sum(len(o.tokens) for o in outs) / (time.perf_counter() - t)


def compare_weights(gen, model: str, formats: list[str], prompt: list[int], args) -> dict[str, list[float]]:
    """tokens/s of a group of 8 for the model's own weights (`gen`, already open) and each copy, one
    round of each in turn"""
    from pathlib import Path

    from retrograd.generation.llama import Generator
    from retrograd.generation.weights import generator_model

    gens = {"native": gen}
    for f in formats:
        gens[f] = Generator(str(generator_model(Path(model), f, args.threads)), n_ctx=1024, n_seq=8,
                            threads=args.threads)
    rates: dict[str, list[float]] = {k: [] for k in gens}
    params = sampling(8, args.tokens)
    for g in gens.values():
        g.tokenizer.eog_ids = frozenset()
        g.generate(prompt, params[:2])          # warm-up
    for r in range(args.repeats):
        for name in (list(gens) if r % 2 == 0 else list(gens)[::-1]):
            rates[name].append(rate(gens[name], prompt, params))
    return rates


def rollouts(args) -> None:
    """tokens/s of grpo-arith's rollouts by decoding order and generator weights (module docstring)"""
    import json
    from pathlib import Path

    from retrograd.config import load
    from retrograd.data.chat import format_for
    from retrograd.data.tokenizer import Tokenizer
    from retrograd.generation.llama import Generator, SamplingParams, group_kv_cells
    from retrograd.generation.weights import generator_model
    from retrograd.models import default_model_path

    example = Path(__file__).resolve().parent.parent / "examples" / "grpo-arith"
    g = load(example / "config.toml").grpo
    groups, size, new = g.prompts_per_step, g.group_size, g.max_new_tokens
    model = Path(args.model or default_model_path())
    formats = ["native", *[w for w in args.weights.split(",") if w]]
    records = [json.loads(line) for line in (example / "train.jsonl").open()]
    tok = Tokenizer(model)
    chat = format_for(tok)
    prompts = [tok.encode(chat.render([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True))
               for r in records]
    n_ctx = max(len(p) for p in prompts) + new + 8                  # as GRPO sizes it (algorithms/rl.py)
    cells = group_kv_cells(groups, n_ctx, groups * size, new)
    gens = {f: Generator(str(generator_model(model, f, args.threads)), n_ctx=n_ctx, n_seq=groups * size,
                         threads=args.threads, kv_cells=cells) for f in formats}
    adapter = example_adapter(model, load(example / "config.toml").lora, args.threads)
    for gen in gens.values():
        gen.set_adapter(adapter)

    def params(r: int, k: int) -> list:
        return [SamplingParams(g.temperature, g.top_p, g.top_k, new, 1000 * r + 10 * k + i) for i in range(size)]

    variants = {"one group at a time, native": ("native", False), "groups together, native": ("native", True)}
    variants.update({f"groups together, {f}": (f, True) for f in formats[1:]})
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds + 1):                       # round 0 warms up every generator
        ps = prompts[groups * r % len(prompts):][:groups]
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            f, together = variants[name]
            t = time.perf_counter()
            if together:
                outs = [o for grp in gens[f].generate_groups(ps, [params(r, k) for k in range(groups)]) for o in grp]
            else:
                outs = [o for k, p in enumerate(ps) for o in gens[f].generate(p, params(r, k))]
            if r:
                rates[name].append(sum(len(o.tokens) for o in outs) / (time.perf_counter() - t))
    base = rates["one group at a time, native"]
    print(f"grpo-arith rollouts ({groups} x {size}, <= {new} new tokens), {args.rounds} rounds; ratio: median of "
          "per-round ratios to one group at a time")
    for name, rs in rates.items():
        ratio = statistics.median(a / b for a, b in zip(rs, base))
        print(f"  {name:<32} {statistics.median(rs):7.1f} tokens/s  {ratio:.2f}x")


def random_adapter(model, spec, threads: int):
    """A Trainable whose adapter has small random B (an untrained one is zero, and changes nothing)."""
    from retrograd.engine import Trainable

    tr = Trainable(model, spec, threads=threads)
    rng = np.random.default_rng(0)
    for t in tr.lora.tensors:
        if t.name.endswith("lora_b"):
            tr.lora.write(t.index, rng.standard_normal(t.shape).astype(np.float32) * 1e-3)
    return tr


def example_adapter(model, lora, threads: int) -> bytes:
    """The bytes of an adapter of the example's [lora] shape with small random B."""
    from retrograd.engine import LoraSpec

    tr = random_adapter(model, LoraSpec(lora.rank, lora.alpha, targets=tuple(lora.targets)), threads)
    data = tr.adapter_bytes()
    tr.close()
    return data




def serve_steps(args) -> None:
    """Start 8 chat requests in a serving Batch, then decode them together: start time, and per step
    the median sampling and llama_decode times, per generator format."""
    from retrograd.data.chat import format_for
    from retrograd.generation.batching import Batch, serving_generator
    from retrograd.generation.sampling import SamplingParams
    from retrograd.models import default_model_path

    model = args.model or str(default_model_path())
    for weights in ["native", *(args.weights.split(",") if args.weights else ["split"])]:
        gen = serving_generator(model, n_ctx=1024, parallel=8, threads=args.threads, device="cpu", weights=weights)
        chat = format_for(gen.tokenizer)
        prompts = [gen.tokenizer.encode(chat.render([{"role": "user", "content": f"Tell me story {i} about a dragon."}],
                                                    add_generation_prompt=True)) for i in range(8)]
        gen.tokenizer.eog_ids = frozenset()         # every sequence generates --tokens
        starts, samples, decodes = [], [], []
        for rep in range(args.repeats):
            batch = Batch(gen, 8)
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                batch.start(p, SamplingParams(0.8, 0.95, 0, args.tokens, 1000 * rep + i, ()))
            starts.append(time.perf_counter() - t0)
            while batch.live:
                t1 = time.perf_counter()
                for s in batch.sample():
                    batch.leave(s)
                t2 = time.perf_counter()
                batch.decode()
                samples.append(t2 - t1)
                decodes.append(time.perf_counter() - t2)
            batch.reset()
        gen.close()
        step = statistics.median(samples) + statistics.median(decodes)
        print(f"{weights}: start of 8 requests {statistics.median(starts):.3f} s; a step of 8: sampling "
              f"{statistics.median(samples) * 1e3:.1f} ms, llama_decode {statistics.median(decodes) * 1e3:.1f} ms; "
              f"{8 / step:.0f} tokens/s while decoding")


if __name__ == "__main__":
    main()
