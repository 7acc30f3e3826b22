"""`retrograd chat`: a conversation through the model's chat template, with the adapter, without it,
or both side by side (--compare). Works with piped stdin, one turn per line."""

from __future__ import annotations

import argparse
import sys

from retrograd.commands import choose_adapter, load_config, positive
from retrograd.data.chat import format_for
from retrograd.generation.conversation import encode_prompt
from retrograd.generation.llama import Generator, SamplingParams
from retrograd.run_setup import resolve_model, resolve_threads


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    positive(args, "max_new_tokens")
    ad = choose_adapter(args, cfg)
    model = resolve_model(cfg)
    gen = Generator(model, n_ctx=cfg.model.ctx, threads=resolve_threads(cfg), device=cfg.model.device)
    adapter_bytes = ad.read_bytes() if ad else None
    chat = format_for(gen.tokenizer, cfg.model.chat_template)
    interactive = sys.stdin.isatty()
    if interactive:
        who = "base model and adapter" if args.compare else ("adapter " + str(ad) if ad else "base model")
        print(f"chatting with {model.name} ({who}); /reset clears the history, /exit quits")
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            history = history[:1] if args.system else []
            print("(history cleared)")
            continue
        history.append({"role": "user", "content": text})
        prompt = encode_prompt(gen.tokenizer, chat, history)
        if len(prompt) + args.max_new_tokens > cfg.model.ctx:
            history = history[:-1]
            print(f"(the conversation no longer fits the context of {cfg.model.ctx} tokens; /reset or raise --ctx)")
            continue
        params = [SamplingParams(args.temp, args.top_p, 0, args.max_new_tokens, args.seed + turn)]
        variants = [("base", None), ("adapter", adapter_bytes)] if args.compare else [(None, adapter_bytes)]
        answer = ""
        for label, data in variants:
            if (data is None) == gen.has_adapter:
                gen.set_adapter(data)
            out = gen.generate(prompt, params)[0]
            answer = out.text.strip()
            print(f"[{label}] {answer}" if label else answer)
        sys.stdout.flush()
        history.append({"role": "assistant", "content": answer})
        turn += 1
    return 0
