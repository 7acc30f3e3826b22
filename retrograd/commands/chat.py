"""`retrograd chat`: a conversation through the model's chat template, with the adapter, without it,
or both side by side (--compare). Works with piped stdin, one turn per line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from retrograd.checkpoint import adapter_of
from retrograd.commands import load_config
from retrograd.data.chat import format_for
from retrograd.generation.llama import Generator, SamplingParams
from retrograd.models import default_model_path
from retrograd.trainer import TrainError, resolve_threads, run_dir


def adapter_path(args: argparse.Namespace, cfg) -> Path | None:
    if args.base_only:
        return None
    if args.adapter:
        p = Path(args.adapter).resolve()
        return adapter_of(p) if p.is_dir() else p
    p = run_dir(cfg) / "adapter.gguf"
    if not p.exists():
        if args.compare:
            raise TrainError(f"--compare needs an adapter: {p} does not exist yet (train first, or pass --adapter)")
        return None
    return p


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if args.max_new_tokens < 1:
        print("error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    model = Path(cfg.model.path) if cfg.model.path else default_model_path()
    gen = Generator(model, n_ctx=cfg.model.ctx, threads=resolve_threads(cfg), device=cfg.model.device)
    ad = adapter_path(args, cfg)
    if ad is not None and not ad.exists():
        raise TrainError(f"{ad}: no such adapter file")
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
        prompt = gen.tokenizer.encode(chat.render(history, add_generation_prompt=True), add_bos=gen.tokenizer.add_bos)
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
            if label:
                print(f"[{label}] {out.text.strip()}")
            else:
                print(out.text.strip())
            answer = out.text.strip()
        sys.stdout.flush()
        history.append({"role": "assistant", "content": answer})
        turn += 1
    return 0
