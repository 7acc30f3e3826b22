"""`retrograd chat`: a conversation through the model's chat template, with the adapter, without it,
or both side by side (--compare). Works with piped stdin, one turn per line."""

from __future__ import annotations

import argparse
import sys

from retrograd.commands import Subparsers, choose_adapter, common_flags, load_config, positive
from retrograd.run_setup import resolve_model, resolve_threads


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("chat", help="talk to the model through its chat template",
                       description="Interactive chat with the model's chat template. The adapter is chosen like "
                                   "serve's: --adapter, else the adapter the configuration trains (an error if it does "
                                   "not exist yet), unless --base-only. --compare shows the base model's and the "
                                   "adapter's answer to each turn. Type /reset to clear the history and /exit to quit. "
                                   "Reads turns from stdin when it is not a terminal.")
    common_flags(p)
    p.add_argument("--adapter", metavar="ADAPTER.gguf",
                   help="adapter to use, or a checkpoint's .state directory (default: the run's adapter.gguf)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compare", action="store_true", help="show base and adapter answers side by side")
    g.add_argument("--base-only", action="store_true", help="no adapter")
    p.add_argument("--system", metavar="PROMPT", help="system prompt")
    p.add_argument("--temp", type=float, default=0.7, metavar="T", help="temperature (default 0.7; 0 is greedy)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="top-p (default 0.95)")
    p.add_argument("--max-new-tokens", type=int, default=512, metavar="N", help="default 512")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (overrides [model].ctx)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from retrograd.data.chat import format_for
    from retrograd.generation.conversation import encode_prompt
    from retrograd.generation.llama import Generator, SamplingParams

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
