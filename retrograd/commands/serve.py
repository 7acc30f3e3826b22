"""`retrograd serve`: the trained adapter (and the base model beside it) behind the OpenAI API."""

from __future__ import annotations

import argparse
import sys

from retrograd.commands import Subparsers, choose_adapter, common_flags, load_config
from retrograd.errors import UsageError
from retrograd.run_setup import resolve_model, resolve_threads


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="serve the model through the OpenAI API",
                       description="Serve the model through the OpenAI API (/v1/chat/completions, /v1/models). The "
                                   "weights are chosen like chat: the adapter the configuration trains unless --adapter, "
                                   "--checkpoint (the adapter exported beside a .state directory) or --base-only. The "
                                   "base model is served beside it as 'base'. Binding anything but a loopback address "
                                   "requires --api-key (clients send Authorization: Bearer KEY). Concurrent requests "
                                   "are decoded together, [serving].parallel at a time (default 8); [serving].queue "
                                   "more may wait (beyond: 429), each at most [serving].wait_seconds (then 503). GET "
                                   "/health reports how many are decoding and waiting.")
    common_flags(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--adapter", metavar="ADAPTER.gguf", help="serve this adapter (or a checkpoint's .state directory)")
    g.add_argument("--checkpoint", metavar="DIR/best.state", help="serve the adapter exported beside this checkpoint")
    g.add_argument("--base-only", action="store_true", help="serve only the base model")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (overrides [model].ctx)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", metavar="KEY", help="require Authorization: Bearer KEY")
    p.add_argument("--model-name", metavar="NAME", help="model id (default: the adapter's file name)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from retrograd.data.chat import format_for
    from retrograd.generation.batching import auto_parallel, serving_generator
    from retrograd.serve.app import BASE_ID, ModelHost, ServedModel, create_app, is_loopback
    from retrograd.serve.scheduler import Scheduler

    cfg = load_config(args)
    if not is_loopback(args.host) and not args.api_key:
        raise UsageError(f"--host {args.host} is not a loopback address: binding it requires --api-key")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    adapter = choose_adapter(args, cfg)
    model_path = resolve_model(cfg)
    parallel = cfg.serving.parallel or auto_parallel(cfg.model.ctx)
    gen = serving_generator(model_path, n_ctx=cfg.model.ctx, parallel=parallel, threads=resolve_threads(cfg),
                            device=cfg.model.device, weights=cfg.serving.generator_weights,
                            dora=cfg.lora.variant == "dora")
    chat = format_for(gen.tokenizer, cfg.model.chat_template)
    if adapter is None:
        served = [ServedModel(args.model_name or BASE_ID, None)]
        if args.model_name and args.model_name != BASE_ID:
            served.append(ServedModel(BASE_ID, None))
    else:
        data = adapter.read_bytes()
        gen.set_adapter(data)          # fails here, before serving, if llama.cpp rejects it
        served = [ServedModel(args.model_name or adapter.name, data), ServedModel(BASE_ID, None)]
    adapters = {m.id: m.adapter for m in served}
    sched = Scheduler(gen, parallel=parallel, queue=cfg.serving.queue, wait_seconds=cfg.serving.wait_seconds,
                      adapter_of=adapters.__getitem__)
    host = ModelHost(sched, chat, served)
    app = create_app(host, api_key=args.api_key, max_body_bytes=cfg.serving.max_body_bytes)
    names = ", ".join(m.id for m in served)
    print(f"serving {names} ({model_path.name}) on http://{args.host}:{args.port}/v1: {parallel} requests decoded "
          f"together, {cfg.serving.queue} more may wait", file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)
    return 0
