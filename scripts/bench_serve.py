"""`retrograd serve` under concurrent clients: continuous batching against one request at a time.

Two servers on the same model run side by side, taking turns round by round (only one is ever
loaded with work): `[serving].parallel = 1` with the model file's own weights (one request at a
time, the behaviour before batching) and the batched default (`parallel = 8`, `queue = 32`,
`generator_weights` from --weights, default native). Each round measures, per side:

- the latency of one request alone (64 new tokens), before and after the round's burst;
- a burst of --clients concurrent clients x --tokens new tokens: completion tokens per second;
- (batched side) 24 concurrent clients: every status code counted (expected: all 200);
- an eval-shaped workload: --eval-prompts short requests (16 new tokens) sent by 1 and by 8
  concurrent clients through the openai SDK (what lm-eval's num_concurrent does), wall-clock.

Medians over the rounds and the batched/one-at-a-time ratios are printed at the end.

    python scripts/bench_serve.py [--model M.gguf] [--threads 2] [--rounds 3] [--clients 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(d: Path, name: str, model: str | None, threads: int, serving: str) -> tuple[subprocess.Popen, str]:
    cfg = d / f"{name}.toml"
    (d / "train.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"},
                                                            {"role": "assistant", "content": "y"}]}) + "\n")
    path = f'path = "{model}"\n' if model else ""
    cfg.write_text(f'[model]\n{path}ctx = 1024\nthreads = {threads}\n[data]\ntrain = "train.jsonl"\n'
                   f"[serving]\n{serving}\n")
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "retrograd.cli", "serve", str(cfg), "--base-only", "--port",
                          str(port)], stdout=subprocess.DEVNULL, stderr=open(d / f"{name}.log", "w"),
                         env={**os.environ, "RETRO_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if p.poll() is not None:
            raise SystemExit((d / f"{name}.log").read_text())
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return p, url
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"{name} did not start")


def ask(url: str, i: int, tokens: int) -> tuple[int, int]:
    """One request: (status, completion tokens)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    try:
        r = c.chat.completions.create(model="base", temperature=0, max_tokens=tokens, messages=[
            {"role": "user", "content": f"Write a long story about the number {i}, then count from {i} to 1000."}])
        return 200, r.usage.completion_tokens
    except openai.APIStatusError as exc:
        return exc.status_code, 0


def burst(url: str, clients: int, tokens: int, first: int = 0) -> tuple[float, list[int], int]:
    """`clients` requests at once: (wall seconds, status codes, completion tokens)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        res = list(pool.map(lambda i: ask(url, first + i, tokens), range(clients)))
    return time.perf_counter() - t0, [s for s, _ in res], sum(n for _, n in res)


def alone(url: str, tokens: int, n: int = 3) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        ask(url, 1000 + i, tokens)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the embedded default model, SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--weights", default="native", help="[serving].generator_weights of the batched side")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    # the baseline is the server before batching: one request at a time, the model file's own weights
    sides = {"one-at-a-time": 'parallel = 1\nqueue = 64\nwait_seconds = 600\ngenerator_weights = "native"',
             "batched": f"parallel = 8\nqueue = 32\nwait_seconds = 600\ngenerator_weights = \"{args.weights}\""}
    procs = {name: start(d, name.replace("-", "_"), args.model, args.threads, s) for name, s in sides.items()}
    rows: dict[str, dict[str, list]] = {n: {} for n in sides}
    try:
        for _, url in procs.values():            # warm up: pages of the model, first allocations
            burst(url, 2, 8)
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                url, row = procs[name][1], rows[name]
                row.setdefault("alone before burst (s)", []).append(alone(url, args.tokens))
                wall, codes, toks = burst(url, args.clients, args.tokens, 100 * r)
                assert codes == [200] * args.clients, codes
                row.setdefault(f"{args.clients} clients: tokens/s", []).append(toks / wall)
                row.setdefault("alone after burst (s)", []).append(alone(url, args.tokens))
                t1 = time.perf_counter()
                for i in range(args.eval_prompts):
                    ask(url, 2000 + i, 16)
                row.setdefault("eval, 1 client (s)", []).append(time.perf_counter() - t1)
                wall8 = _eval8(url, args.eval_prompts)
                row.setdefault("eval, 8 clients (s)", []).append(wall8)
                if name == "batched":
                    _, codes, _ = burst(url, 24, args.tokens, 3000)
                    row.setdefault("24 clients: not 200", []).append(sum(c != 200 for c in codes))
                print(f"round {r} {name}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in row.items()), flush=True)
    finally:
        for p, _ in procs.values():
            p.terminate()
            p.wait(timeout=30)
    print(f"\nmedians over {args.rounds} rounds ({args.threads} threads, {args.tokens} new tokens, model "
          f"{args.model or 'default'}):")
    keys = list(rows["batched"])
    print("| measure | one at a time | batched | ratio |\n|---|---|---|---|")
    for k in keys:
        a = statistics.median(rows["one-at-a-time"][k]) if k in rows["one-at-a-time"] else None
        b = statistics.median(rows["batched"][k])
        ratio = f"{b / a:.2f}" if a else ""
        print(f"| {k} | {'' if a is None else f'{a:.3g}'} | {b:.3g} | {ratio} |")
    b = rows["batched"]
    e1, e8 = statistics.median(b["eval, 1 client (s)"]), statistics.median(b["eval, 8 clients (s)"])
    print(f"\nbatched server, eval workload: 8 clients {e1 / e8:.2f}x faster than 1 client")


def _eval8(url: str, n: int) -> float:
    """Wall seconds of n short requests through 8 concurrent clients (lm-eval's num_concurrent=8)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        codes = [s for s, _ in pool.map(lambda i: ask(url, 2000 + i, 16), range(n))]
    assert codes == [200] * n, codes
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
