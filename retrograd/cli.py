"""`retrograd` command line: builds the parsers and dispatches to retrograd.commands.*; every known
failure becomes one `error:` line and a non-zero exit (2 for configuration errors)."""

from __future__ import annotations

import argparse
import sys

COMMON = "Paths on the command line resolve against the current directory; paths in the TOML file " \
         "resolve against the file's directory."

NOT_BUILT = {
    "tools": "the agentic tool catalog (agentic GRPO)",
    "scenarios": "scenario generation (agentic GRPO)",
    "judge": "judge evaluation (agentic GRPO)",
    "collect": "trace collection (agentic GRPO)",
}


def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    if config:
        p.add_argument("config", help="run configuration (TOML)")
    p.add_argument("--model", metavar="M", help="use this GGUF instead of [model].path")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"),
                   help="auto: a GPU if available, else the CPU; cpu: force the CPU; gpu: require a GPU")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="retrograd",
        description="Fine-tune quantized GGUF language models on the hardware you have: LoRA adapters trained "
                    "directly on the quantized weights, with SFT, GRPO, PPO, distillation and preference training "
                    "(DPO, IPO, SimPO, ORPO), evaluation, chat and an OpenAI-compatible server.",
        epilog=COMMON + " Environment: RETRO_THREADS overrides training.threads; RETRO_REQUIRE_GPU_RESIDENT=1 equals "
                        "training.require_gpu_resident; RETRO_LOG / RUST_LOG set the log level (default warn).")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="run [run].algorithm on the configuration",
                       description="Train the configured algorithm. --resume continues from the given checkpoint, "
                                   "or from the latest one in [checkpoint].directory.")
    _common(p)
    p.add_argument("--resume", nargs="?", const=True, metavar="CHECKPOINT.state",
                   help="continue from this checkpoint, or from the latest one when no path is given")

    p = sub.add_parser("bench", help="evaluate the base model (and an adapter) without training",
                       description="Evaluate without training. sft: loss and perplexity on the trained tokens; "
                                   "grpo/ppo: the reward distribution of sampled answers; distill: KL to the teacher, "
                                   "top-1 agreement and perplexity (loads the teacher); preference and agent_grpo: not "
                                   "supported. Without --adapter it measures the base model; with it, base and adapter "
                                   "on the same examples.")
    _common(p)
    p.add_argument("--data", metavar="FILE", help="evaluation data (default: [evaluation].data or the held-out split)")
    p.add_argument("--adapter", metavar="ADAPTER.gguf", help="also measure this adapter")
    p.add_argument("--limit", type=int, metavar="N", help="at most N examples")
    p.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                   help="report as a table (text), as JSON (jsonl) or by terminal (auto)")
    p.add_argument("--ctx", type=int, metavar="N", help="longest sequence (overrides [model].ctx)")

    p = sub.add_parser("chat", help="talk to the model through its chat template",
                       description="Interactive chat with the model's chat template. --compare shows the base "
                                   "model's and the adapter's answer to each turn; --base-only disables the adapter. "
                                   "Type /reset to clear the history and /exit to quit. Reads turns from stdin "
                                   "when it is not a terminal.")
    _common(p)
    p.add_argument("--adapter", metavar="ADAPTER.gguf", help="adapter to use (default: the run's adapter.gguf)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compare", action="store_true", help="show base and adapter answers side by side")
    g.add_argument("--base-only", action="store_true", help="no adapter")
    p.add_argument("--system", metavar="PROMPT", help="system prompt")
    p.add_argument("--temp", type=float, default=0.7, metavar="T", help="temperature (default 0.7; 0 is greedy)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="top-p (default 0.95)")
    p.add_argument("--max-new-tokens", type=int, default=512, metavar="N", help="default 512")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (overrides [model].ctx)")

    p = sub.add_parser("serve", help="serve the model through the OpenAI API",
                       description="Serve the model through the OpenAI API (/v1/chat/completions, /v1/models). The "
                                   "weights are chosen like chat: the adapter the configuration trains unless --adapter, "
                                   "--checkpoint (the adapter exported beside a .state directory) or --base-only. The "
                                   "base model is served beside it as 'base'. Binding anything but a loopback address "
                                   "requires --api-key (clients send Authorization: Bearer KEY).")
    _common(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--adapter", metavar="ADAPTER.gguf", help="serve this adapter")
    g.add_argument("--checkpoint", metavar="DIR/best.state", help="serve the adapter exported beside this checkpoint")
    g.add_argument("--base-only", action="store_true", help="serve only the base model")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (overrides [model].ctx)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", metavar="KEY", help="require Authorization: Bearer KEY")
    p.add_argument("--model-name", metavar="NAME", help="model id (default: the adapter's file name)")

    p = sub.add_parser("distill-teacher", help="write the teacher's top-k predictions for offline distillation",
                       description="Run the teacher over the data once and write its top-k next-token ids and "
                                   "log-probs for every trained position to FILE.topk (written as FILE.topk.tmp and "
                                   "renamed when complete). Set [distill].teacher_file to it and training never loads "
                                   "the teacher. --model names the teacher here (default [distill].teacher, else the "
                                   "embedded default model).")
    _common(p)
    p.add_argument("--data", metavar="FILE", help="data to score (default [data].train)")
    p.add_argument("--out", metavar="FILE.topk",
                   help="output (default [distill].teacher_file, else the data file's name with .topk)")
    p.add_argument("--k", type=int, metavar="N", help="tokens per position (default [distill].k)")
    p.add_argument("--ctx", type=int, metavar="N", help="longest sequence (overrides [model].ctx)")

    p = sub.add_parser("inspect", help="architecture, tensor types, LoRA targets and device of a GGUF",
                       description="Print the model's architecture, tensor types, suggested LoRA targets and the "
                                   "device that will be used.")
    _common(p, config=False)

    p = sub.add_parser("preflight", help="list the training-graph ops the device cannot run",
                       description="Build the training graph without running it and list the operations the device "
                                   "cannot run (they fall back to the CPU and slow every step). The same check runs "
                                   "at the start of every training run.")
    _common(p, config=False)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down", metavar="q,k,v",
                   help="LoRA targets (default: all seven)")
    p.add_argument("--strict", action="store_true", help="exit with an error if any op is unsupported")
    p.add_argument("--tokens", type=int, default=512, metavar="N", help="micro-batch size of the graph (default 512)")

    for name, what in NOT_BUILT.items():
        p = sub.add_parser(name, help=f"[not built yet] {what}", description=f"Not built yet: {what}.")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 2
    if args.command in NOT_BUILT:
        print(f"retrograd {args.command}: not built yet in this version ({NOT_BUILT[args.command]}).", file=sys.stderr)
        return 2
    from retrograd.commands import dispatch

    return dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
