"""Agentic rollouts, agent_grpo, collect, the judge and --api on the real default model and the
shipped notes environment. An adapter taught to call get_note (conftest.notes_adapter) makes the
conversations use tools; everything else — llama.cpp, the MCP server, SQLite state, our graph —
is the real thing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS

from retrograd.agent import scenarios as sc_mod
from retrograd.agent.judge import build_judge
from retrograd.agent.rollout import AgentEnv, rollout, score_group
from retrograd.agent.tools import ToolBox
from retrograd.batch import Batch
from retrograd.config import load
from retrograd.context import open_model
from retrograd.data.chat import format_for
from retrograd.data.formats import load_examples
from retrograd.data.pairs import load_pairs
from retrograd.generation.llama import Generator, SamplingParams
from retrograd.trainer import train

from .agent_support import EXAMPLE, default_sigint, free_port, notes_table, stop_proc
from .conftest import SYSTEM

pytestmark = pytest.mark.slow


def agent_config(d: Path, model: Path, adapter: Path | None, *, steps: int = 2, extra: str = "") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = d / "agent.toml"
    init = f'init_adapter = "{adapter}"' if adapter else ""
    cfg.write_text(f"""
[model]
path = "{model}"
ctx = 1024
[lora]
{init}
[run]
algorithm = "agent_grpo"
name = "a"
[training]
max_steps = {steps}
learning_rate = 1e-4
micro_batch_tokens = 1024
[grpo]
group_size = 3
prompts_per_step = 1
temperature = 0.7
[agent]
scenarios = "{EXAMPLE / 'scenarios.jsonl'}"
state_template = "{EXAMPLE / 'seed.db'}"
max_turns = 3
max_new_tokens = 48
system_prompt = "{SYSTEM}"
[[agent.servers]]
name = "notes"
command = ["{{python}}", "{EXAMPLE / 'notes_server.py'}"]
[evaluation]
data = "{EXAMPLE / 'eval_scenarios.jsonl'}"
limit = 3
[checkpoint]
every_steps = 1
{extra}
""")
    return cfg


def cli(*args: str, timeout: int = 900, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "RETRO_THREADS": str(THREADS)}
    return subprocess.run([sys.executable, "-m", "retrograd.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def read_scenarios(names: list[str]) -> list:
    every = sc_mod.load(EXAMPLE / "scenarios.jsonl")
    return [s for s in every if s.id in names]


def test_generate_each_equals_one_prompt_at_a_time(smollm):
    gen = Generator(smollm, n_ctx=256, n_seq=3, threads=THREADS)
    tok = gen.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("The capital of France was once"),
               tok.encode("Two plus two is")]
    params = [SamplingParams(0.0, 1.0, 0, 8, i) for i in range(3)]
    together = gen.generate_each(prompts, params)
    alone = [gen.generate(p, [pp])[0] for p, pp in zip(prompts, params)]
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=0.05)


@pytest.fixture(scope="module")
def tool_rollouts(smollm, notes_adapter, tmp_path_factory):
    gen = Generator(smollm, n_ctx=1024, n_seq=3, threads=THREADS)
    gen.load_adapter(notes_adapter)
    chat = format_for(gen.tokenizer)
    work = tmp_path_factory.mktemp("states")
    with ToolBox([notes_table()]) as box:
        env = AgentEnv(gen, chat, box, SYSTEM, 3, EXAMPLE / "seed.db", work)
        scen = read_scenarios(["train-00", "train-19"])      # a read (verify: answer) and an add (verify: SQL)
        params = [SamplingParams(0.7, 1.0, 0, 48, 11 + i) for i in range(3)]
        trajs = rollout(env, [scen[0]] * 3, params, ["r0", "r1", "r2"])
        trajs += rollout(env, [scen[1]] * 3, params, ["w0", "w1", "w2"])
        states = [t.state for t in trajs]
        score_group(trajs[:3])
        score_group(trajs[3:])
    yield gen, trajs, states


def test_rollouts_call_tools_and_keep_their_results_out_of_the_loss(tool_rollouts):
    gen, trajs, states = tool_rollouts
    tok = gen.tokenizer
    assert any(t.tool_calls for t in trajs), [t.raw for t in trajs]
    for t in trajs:
        assert len(t.tokens) == len(t.trained) and t.n_trained == len(t.sample_logp) > 0
        assert len(t.prompt) + len(t.tokens) < gen.n_ctx
        assert t.finish in ("answer", "max_turns", "context", "truncated_turn")
        if t.tool_calls:
            masked = [tok for tok, tr in zip(t.tokens, t.trained) if not tr]
            assert "<tool_response>" in tok.decode(masked, special=True)
            assert any(m["role"] == "tool" for m in t.messages)
    assert all(s is not None and not s.exists() for s in states)          # state copies are discarded
    read = [t for t in trajs[:3] if t.verified]
    assert read, [(t.answer, t.detail) for t in trajs[:3]]                # the adapter reads notes correctly
    assert all(t.reward == 1.0 for t in read)


def test_our_graph_scores_the_sampled_tokens_in_the_context_they_were_sampled(tool_rollouts, smollm, notes_adapter,
                                                                               tmp_path):
    """The sequence a rollout leaves is what llama.cpp saw: our log-probs of the model's own tokens
    equal llama.cpp's sampling log-probs up to the two engines' rounding."""
    _, trajs, _ = tool_rollouts
    cfg = load(agent_config(tmp_path, smollm, notes_adapter))
    ctx = open_model(cfg, need_data=False)
    t = max(trajs, key=lambda x: x.tool_calls)
    tokens = np.asarray(t.prompt + t.tokens, np.int32)
    trained = np.asarray([False] * len(t.prompt) + t.trained)
    batch = Batch.next_token(tokens, weights_mask=trained)
    ours = ctx.trainable.logprobs(batch).logp
    assert len(ours) == len(t.sample_logp)
    assert np.mean(np.abs(ours - np.asarray(t.sample_logp))) < 0.15


def test_agent_grpo_trains_and_resumes_exactly(smollm, notes_adapter, tmp_path):
    a = load(agent_config(tmp_path / "a", smollm, notes_adapter, steps=2))
    s = train(open_model(a))
    assert s["steps"] == 2 and "eval_verify_pass" in s and "eval_reward" in s
    rows = [json.loads(x) for x in (tmp_path / "a/runs/a/metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    for key in ("reward_mean", "verify_pass", "turns", "tool_calls", "tool_success", "logp_gap", "tool_s"):
        assert key in step1, key
    assert step1["logp_gap"] < 0.2
    b_cfg = agent_config(tmp_path / "b", smollm, notes_adapter, steps=1)
    train(open_model(load(b_cfg)))
    b_cfg.write_text(b_cfg.read_text().replace("max_steps = 1", "max_steps = 2"))
    train(open_model(load(b_cfg)), resume=True)
    la = {r["step"]: r["loss"] for r in rows if "loss" in r}
    lb = {json.loads(x)["step"]: json.loads(x)["loss"]
          for x in (tmp_path / "b/runs/a/metrics.jsonl").read_text().splitlines() if '"loss"' in x}
    assert sorted(lb) == [1, 2]
    for step, v in la.items():
        assert lb[step] == pytest.approx(v, rel=1e-6)
    assert (tmp_path / "a/runs/a/adapter.gguf").read_bytes() == (tmp_path / "b/runs/a/adapter.gguf").read_bytes()


def test_zero_signal_groups_are_resampled_together(smollm, notes_adapter, tmp_path):
    """Dynamic sampling: a group whose rollouts all get the same reward teaches nothing, so with
    [grpo].resample_zero_groups = 2 it is replaced by another scenario, twice; here no scenario can
    pass (its verify asks for a word no note holds), so every group is resampled twice and the step
    still trains (zero advantages, a finite loss)."""
    never = tmp_path / "never.jsonl"
    never.write_text("".join(json.dumps({"id": f"never-{i}", "task": f"What does the note titled '{t}' say?",
                                         "verify": {"answer_contains": "qqxqq-not-in-any-note"}}) + "\n"
                             for i, t in enumerate(["dentist", "wifi", "gym", "rent", "vet"])))
    cfg = agent_config(tmp_path / "z", smollm, notes_adapter, steps=1)
    text = cfg.read_text().replace(str(EXAMPLE / "scenarios.jsonl"), str(never))
    text = text.replace("prompts_per_step = 1", "prompts_per_step = 2\nresample_zero_groups = 2")
    text = text.replace("group_size = 3", "group_size = 2").replace("max_new_tokens = 48", "max_new_tokens = 24")
    cfg.write_text(text.replace("[evaluation]\n", "[evaluation]\nevery_steps = 0\n"))
    train(open_model(load(cfg)))
    rows = [json.loads(x) for x in (tmp_path / "z/runs/a/metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    assert step1["resampled_groups"] == 4 and step1["zero_signal_groups"] == 2
    assert step1["reward_mean"] == 0 and np.isfinite(step1["loss"])


def test_collect_writes_trainable_traces_and_pairs(smollm, notes_adapter, tmp_path):
    cfg = agent_config(tmp_path, smollm, notes_adapter)
    out, rep = tmp_path / "traces.jsonl", tmp_path / "report.json"
    r = cli("collect", str(cfg), "--out", str(out), "--k", "3", "--limit", "3", "--report", str(rep))
    assert r.returncode == 0, r.stderr
    report = json.loads(rep.read_text())
    assert report["scenarios"] == 3 and report["attempts"] == 9 and len(report["per_scenario"]) == 3
    assert report["written"] == sum(p["kept"] for p in report["per_scenario"]) >= 1
    assert sum(report["dropped"].values()) + report["written"] <= 9
    assert not Path(str(out) + ".tmp").exists()
    gen = Generator(smollm, n_ctx=64, threads=THREADS)
    examples, _ = load_examples(out, gen.tokenizer, format_for(gen.tokenizer), fmt="tools")
    assert len(examples) == report["written"]
    r = cli("collect", str(cfg), "--out", str(out), "--k", "3", "--limit", "3")
    assert r.returncode == 2 and "exists" in r.stderr
    pairs = tmp_path / "pairs.jsonl"
    r = cli("collect", str(cfg), "--out", str(pairs), "--k", "3", "--limit", "4", "--pairs", "--min-gap", "0.5")
    assert r.returncode == 0, r.stderr
    if pairs.read_text().strip():
        loaded, _ = load_pairs(pairs, gen.tokenizer, format_for(gen.tokenizer))
        assert loaded
    assert "pairs" in r.stdout
    r = cli("collect", str(cfg), "--out", str(pairs), "--k", "3", "--pairs", "--keep", "2", "--force")
    assert r.returncode == 2 and "no --keep" in r.stderr


def test_interrupted_collect_leaves_only_the_tmp(smollm, notes_adapter, tmp_path):
    cfg = agent_config(tmp_path, smollm, notes_adapter)
    out = tmp_path / "t.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "retrograd.cli", "collect", str(cfg), "--out", str(out), "--k", "2"],
                         preexec_fn=default_sigint,  # a shell's background job starts with SIGINT ignored
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "RETRO_THREADS": str(THREADS)})
    tmp = Path(str(out) + ".tmp")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (tmp.exists() and tmp.stat().st_size > 0):
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert tmp.exists() and not out.exists()
    assert all(json.loads(line)["messages"] for line in tmp.read_text().splitlines())


@pytest.fixture(scope="module")
def served(smollm, notes_adapter, tmp_path_factory):
    """`retrograd serve` with the notes adapter: an OpenAI-compatible endpoint for --api and the judge."""
    d = tmp_path_factory.mktemp("serve")
    cfg = d / "serve.toml"
    cfg.write_text(f'[model]\npath = "{smollm}"\nctx = 2048\n')
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "retrograd.cli", "serve", str(cfg), "--adapter", str(notes_adapter),
                          "--model-name", "notes", "--port", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env={**os.environ, "RETRO_THREADS": str(THREADS)})
    import urllib.request

    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/models", timeout=1).read()
            break
        except OSError:
            if p.poll() is not None:
                raise AssertionError(p.stderr.read().decode()) from None
            time.sleep(0.5)
    yield url
    stop_proc(p)


def test_collect_api_uses_the_endpoint_and_loads_no_model(served, smollm, notes_adapter, tmp_path):
    cfg = agent_config(tmp_path, Path("/nonexistent/never-loaded.gguf"), None,
                       extra=f'[agent.collect_api]\nbase_url = "{served}"\nmodel = "notes"\nmax_tokens = 64\n')
    cfg.write_text(cfg.read_text().replace('path = "/nonexistent/never-loaded.gguf"\n', ""))
    out = tmp_path / "api.jsonl"
    r = cli("collect", str(cfg), "--api", "--out", str(out), "--k", "1", "--limit", "2", "--report",
            str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["attempts"] == 2
    for line in out.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        assert any(m.get("tool_calls") for m in msgs if m["role"] == "assistant")   # structured turns


def test_judge_against_a_local_serve(served, smollm, tmp_path):
    cfg = tmp_path / "judge.toml"
    cfg.write_text(f'[model]\npath = "{smollm}"\n[agent.judge]\nbase_url = "{served}"\nmodel = "base"\n'
                   "max_tokens = 96\nretries = 1\ntimeout_seconds = 300\n")
    r = cli("judge", "eval", str(cfg), "--fixtures", str(EXAMPLE / "judge_fixtures.jsonl"), "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["overall"]["fixtures"] == len(rep["fixtures"]) >= 6
    assert 0.0 <= rep["overall"]["best_pick_accuracy"] <= 1.0
    for f in rep["fixtures"]:
        assert all(0.0 <= s <= 1.0 for s in f["judge"])
    cfg.write_text(cfg.read_text().replace(served, "http://127.0.0.1:9/v1").replace("timeout_seconds = 300",
                                                                                   "timeout_seconds = 2"))
    r = cli("judge", "eval", str(cfg), "--fixtures", str(EXAMPLE / "judge_fixtures.jsonl"))
    assert r.returncode == 1 and "failed after 2 attempt(s)" in r.stderr and "Traceback" not in r.stderr


def test_judge_scores_a_group_of_rollouts(served, tool_rollouts, tmp_path, smollm):
    _, trajs, _ = tool_rollouts
    cfg = tmp_path / "j.toml"
    cfg.write_text(f'[model]\npath = "{smollm}"\n[agent.judge]\nbase_url = "{served}"\nmodel = "base"\n'
                   "max_tokens = 96\nretries = 0\n")
    judge = build_judge(load(cfg), required=True)
    got = judge.score(trajs[0].scenario, trajs[:3])
    assert len(got) == 3 and all(0.0 <= s <= 1.0 for s, _ in got)


def test_profile_times_tool_calls_as_their_own_phase(smollm, notes_adapter, tmp_path):
    cfg = agent_config(tmp_path, smollm, notes_adapter)
    out = subprocess.run([sys.executable, "-m", "retrograd.commands.profile", str(cfg), "--steps", "1", "--json",
                          "--threads", str(THREADS)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    med = json.loads(out.stdout)["median"]
    for phase in ("generation", "tool calls", "reference", "forward", "backward", "adapter swap"):
        assert med[phase] >= 0, phase
    assert not (tmp_path / "runs").exists()


def test_agent_grpo_samples_its_turns_on_ray_workers(smollm, notes_adapter, tmp_path):
    """[distributed]: the conversations of a step are split between two Ray workers each turn; the
    driver runs the tools and the judge-free verification, trains and evaluates as usual."""
    pytest.importorskip("ray")
    dist = '[distributed]\nbackend = "ray"\nworkers = 2\nthreads_per_worker = 1\ncheck_every = 1\n'
    s = train(open_model(load(agent_config(tmp_path, smollm, notes_adapter, steps=1, extra=dist))))
    assert s["steps"] == 1 and "eval_verify_pass" in s
    rows = [json.loads(x) for x in (tmp_path / "runs/a/metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    assert step1["dist_workers"] == 2 and step1["dist_gen_s"] > 0 and step1["dist_w0_s"] > 0
    assert step1["turns"] >= 1 and step1["logp_gap"] < 0.2
