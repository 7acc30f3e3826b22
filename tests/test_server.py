"""`retrograd-server` on the real default model: runs submitted over HTTP train in worker
processes, answer live through the openai SDK, persist across a SIGKILL of the server, resume to
the same adapter as an uninterrupted run, and refuse what they must with clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest import THREADS
from test_serve import free_port

from retrograd.data.chat import format_for
from retrograd.generation.conversation import encode_prompt, read_reply
from retrograd.generation.llama import Generator, SamplingParams

pytestmark = pytest.mark.slow       # every test starts a server

PROMPT = [{"role": "user", "content": "Say the word number 3."}]
RECORDS = [{"messages": [{"role": "user", "content": f"Say the word number {i}."},
                         {"role": "assistant", "content": f"Word {i}: {'alpha beta gamma delta'.split()[i % 4]}"}]}
           for i in range(40)]
SHARED: dict = {}           # the first test's finished run, which later tests compare with


class Server:
    def __init__(self, state: Path, *extra: str) -> None:
        self.state, self.extra = state, extra
        self.start()

    def start(self) -> None:
        port = free_port()
        env = {**os.environ, "RETRO_THREADS": str(THREADS)}
        self.state.mkdir(parents=True, exist_ok=True)
        # stderr to a file: a pipe nobody reads would block the server once it filled up
        self.stderr = open(self.state / "server.stderr", "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "retrograd.commands.server", "--port", str(port),
                                      "--state-dir", str(self.state), *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=self.stderr, text=True, env=env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError((self.state / "server.stderr").read_text())
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("retrograd-server did not start")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)

    def call(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def run(self, run_id: str) -> dict:
        return self.call("GET", f"/api/runs/{run_id}")[1]

    def wait(self, run_id: str, states=("finished",), timeout: float = 900) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            rec = self.run(run_id)
            if rec["state"] in states:
                return rec
            assert rec["state"] not in ("failed", "crashed") or "crashed" in states, rec
            time.sleep(0.2)
        raise AssertionError(f"{run_id} stayed {self.run(run_id)['state']}")

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def ask(self, model: str) -> tuple[str, dict]:
        raw = self.client().chat.completions.with_raw_response.create(model=model, messages=PROMPT, temperature=0,
                                                                      max_tokens=12)
        return raw.parse().choices[0].message.content, dict(raw.headers)


def write_config(d: Path, model: Path, *, steps: int = 8, serving: str = "enabled = true") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    cfg = d / "run.toml"
    cfg.write_text(f"""
[model]
path = "{model}"
ctx = 128
[lora]
rank = 4
alpha = 8
[run]
name = "words"
seed = 1
[data]
train = "train.jsonl"
eval_split = 0.1
[training]
max_steps = {steps}
batch_size = 2
learning_rate = 3e-3
threads = {THREADS}
[checkpoint]
every_steps = 1
keep = 50
[serving]
{serving}
""")
    return cfg


def greedy_with(model: Path, adapter: Path | None) -> str:
    """What `chat --adapter FILE` answers: llama.cpp with the adapter file, greedy."""
    gen = Generator(model, n_ctx=128, threads=THREADS)
    try:
        if adapter is not None:
            gen.load_adapter(adapter)
        prompt = encode_prompt(gen.tokenizer, format_for(gen.tokenizer), PROMPT)
        out = gen.generate(prompt, [SamplingParams(0.0, 1.0, 0, 12, 1)])[0]
        return read_reply(out.text, None).message()["content"]
    finally:
        gen.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("state"))
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_live_answers_follow_the_steps_and_saved_weights_match_them(server, smollm, tmp_path):
    status, rec = server.call("POST", "/api/runs", {"config": str(write_config(tmp_path, smollm))})
    assert status == 201, rec
    run_id = rec["id"]
    live = {}
    while server.run(run_id)["state"] in ("queued", "running"):
        try:
            text, headers = server.ask(run_id)
        except openai.NotFoundError:            # finished between the check and the request
            break
        if headers["x-retrograd-weights"] != f"{run_id}@live":       # likewise, answered by the final adapter
            break
        live[int(headers["x-retrograd-step"])] = text
    server.wait(run_id)
    assert len(live) >= 2, live
    steps = sorted(live)
    assert steps[0] < steps[-1]
    # a live answer at step N is the answer of the adapter saved at step N, through the server and llama.cpp
    for step in (steps[0], steps[-1]):
        saved, headers = server.ask(f"{run_id}@step-{step}")
        assert headers["x-retrograd-weights"] == f"{run_id}@step-{step}"
        assert saved == live[step], step
        adapter = server.state / "runs" / run_id / "out" / "checkpoints" / f"step-{step}.state" / "adapter.gguf"
        assert greedy_with(smollm, adapter) == saved
    final, _ = server.ask(run_id)
    out = server.state / "runs" / run_id / "out"
    assert final == server.ask(f"{run_id}@final")[0] == greedy_with(smollm, out / "adapter.gguf")
    base, _ = server.ask(f"{run_id}@base")
    assert base == greedy_with(smollm, None) and base != final          # training changed the answer
    assert server.ask(f"{run_id}@latest")[0] == server.ask(f"{run_id}@step-8")[0] == final
    assert server.ask(f"{run_id}@best")[1]["x-retrograd-weights"] == f"{run_id}@best"      # by the final eval_loss
    ids = {m.id for m in server.client().models.list().data}
    assert {run_id, f"{run_id}@final", f"{run_id}@best", f"{run_id}@base", f"{run_id}@step-8"} <= ids
    # unknown runs, weights and steps are 404s that name them
    for model, text in ((f"{run_id}@step-99", "no step-99 adapter"), ("nope", "no run 'nope'"),
                        (f"{run_id}@worst", "unknown weights @worst")):
        with pytest.raises(openai.NotFoundError) as exc:
            server.ask(model)
        assert text in exc.value.body["message"], exc.value.body
    # the run's events: state, one metrics event per step, log lines, then end
    with urllib.request.urlopen(server.url + f"/api/runs/{run_id}/events", timeout=60) as r:
        text = r.read().decode()
    assert text.count("event: metrics") == 9 and "event: log" in text and text.rstrip().endswith('"finished"}')
    SHARED["run"] = run_id


def test_saved_weights_decode_together_grouped_by_adapter(server):
    """Concurrent requests for three adapters of one base: decoded in batches (an adapter's requests
    together, the adapters taking turns), each answer what it is alone."""
    run_id = SHARED["run"]
    models = [f"{run_id}@{w}" for w in ("final", "base", "step-2", "final", "base", "step-2", "final", "final")]
    alone = [server.ask(m) for m in models]
    seen = []
    with ThreadPoolExecutor(len(models)) as pool:
        futures = [pool.submit(server.ask, m) for m in models]
        while not all(f.done() for f in futures):
            seen.append(server.call("GET", "/health")[1]["decoding"])
            time.sleep(0.02)
        together = [f.result() for f in futures]
    assert max(seen) >= 2, seen
    for m, (a, ha), (b, hb) in zip(models, alone, together):
        assert a == b and ha["x-retrograd-weights"] == hb["x-retrograd-weights"] == m, (m, a, b)
    assert alone[0][0] != alone[1][0]                  # the adapter and the base answer differently
    assert server.call("GET", "/health")[1]["waiting"] == 0


def test_queue_full_and_device_held(server, smollm, tmp_path):
    run_id = SHARED["run"]
    # one request decoding at a time and queue = 1 on a second run: several requests at once, the ones
    # beyond the queue get 429
    status, rec = server.call("POST", "/api/runs", {"config": str(write_config(
        tmp_path, smollm, steps=3, serving="parallel = 1\nqueue = 1\nidle_seconds = 2"))})
    assert status == 201
    other = rec["id"]
    server.wait(other)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: server.call("POST", "/v1/chat/completions", {
            "model": f"{other}@final", "messages": PROMPT, "max_tokens": 24, "temperature": 0}), range(4)))
    codes = sorted(c for c, _ in results)
    assert codes.count(200) >= 1 and 429 in codes, codes
    busy = next(b for c, b in results if c == 429)
    assert "[serving].queue = 1" in busy["error"]["message"]
    # the server's generator for saved weights is let go after the run's idle_seconds
    assert server.call("GET", "/health")[1]["loaded_models"] >= 1
    deadline = time.time() + 30
    while server.call("GET", "/health")[1]["loaded_models"] and time.time() < deadline:
        time.sleep(0.5)
    assert server.call("GET", "/health")[1]["loaded_models"] == 0
    big = {"model": f"{other}@final", "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    status, body = server.call("POST", "/v1/chat/completions", big)
    assert status == 413 and "[serving].max_body_bytes" in body["error"]["message"]
    # while a run trains it holds the device: loading saved weights is refused (device_wait_seconds = 0),
    # and a run that does not serve live weights says so
    status, rec = server.call("POST", "/api/runs", {"config": str(write_config(tmp_path, smollm, steps=40,
                                                                                serving="enabled = false"))})
    busy_id = rec["id"]
    server.wait(busy_id, ("running",))
    status, body = server.call("POST", "/v1/chat/completions", {"model": f"{run_id}@final", "messages": PROMPT})
    assert status == 503 and body["error"]["code"] == "device_busy" and busy_id in body["error"]["message"]
    status, body = server.call("POST", "/v1/chat/completions", {"model": busy_id, "messages": PROMPT})
    assert status == 409 and "[serving].enabled" in body["error"]["message"]
    assert server.call("GET", "/health")[1]["device_held_by"] == busy_id
    # a run submitted meanwhile waits for the device, and gets it when the first one stops
    status, rec = server.call("POST", "/api/runs", {"config": str(write_config(tmp_path, smollm, steps=2))})
    waiting = rec["id"]
    assert status == 201 and rec["state"] == "queued"
    # stop: a checkpoint at the step it stopped at, then resume to the end
    status, rec = server.call("POST", f"/api/runs/{busy_id}/stop")
    assert status == 200 and rec["state"] in ("stopping", "stopped")
    rec = server.wait(busy_id, ("stopped",))
    server.wait(waiting)
    ckpts = server.run(busy_id)["checkpoints"]
    assert ckpts and ckpts[-1] == rec["step"] < 40
    status, body = server.call("POST", f"/api/runs/{busy_id}/stop")
    assert status == 409 and "stopped" in body["error"]["message"]
    status, rec = server.call("POST", f"/api/runs/{busy_id}/resume")
    assert status == 200 and rec["state"] in ("queued", "running")
    server.call("POST", f"/api/runs/{busy_id}/stop")
    server.wait(busy_id, ("stopped",))


def test_sigkill_of_the_server_then_resume_gives_the_uninterrupted_adapter(server, smollm, tmp_path):
    run_id = SHARED["run"]        # the same configuration, trained without interruption
    status, rec = server.call("POST", "/api/runs", {"config": str(write_config(tmp_path, smollm))})
    again = rec["id"]
    server.wait(again, ("running",))
    while server.run(again)["step"] < 3:
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    server.start()
    rec = server.run(again)
    assert rec["state"] == "crashed" and "resume" in rec["error"]
    runs = {r["id"]: r["state"] for r in server.call("GET", "/api/runs")[1]["runs"]}
    assert runs[run_id] == "finished" and runs[again] == "crashed"
    status, rec = server.call("POST", f"/api/runs/{again}/resume")
    assert status == 200
    server.wait(again)
    out = server.state / "runs"
    assert (out / again / "out" / "adapter.gguf").read_bytes() == (out / run_id / "out" / "adapter.gguf").read_bytes()
    assert "resumed at step" in (out / again / "log.txt").read_text()


def test_bad_submissions_name_the_problem(server, smollm, tmp_path):
    cfg = write_config(tmp_path, smollm)
    cases = [({"config": str(tmp_path / "missing.toml")}, "cannot read"),
             ({"toml": "[training\nx=1"}, "not valid TOML"),
             ({"toml": "[training]\nbogus = 1"}, "bogus"),
             ({"toml": cfg.read_text(), "base_dir": "/nonexistent"}, "train.jsonl"),
             ({"config": str(cfg), "toml": "x"}, "exactly one"),
             ({"name": 3, "config": str(cfg)}, "name: expected a string"),
             ([1, 2], "JSON object")]
    before = len(server.call("GET", "/api/runs")[1]["runs"])
    for body, text in cases:
        status, answer = server.call("POST", "/api/runs", body)
        assert status == 400 and text in answer["error"]["message"], (body, answer)
    assert len(server.call("GET", "/api/runs")[1]["runs"]) == before      # nothing half-created
    for method, path in (("GET", "/api/runs/nope"), ("POST", "/api/runs/nope/stop"), ("POST", "/api/runs/nope/resume")):
        status, answer = server.call(method, path)
        assert status == 404 and "no run 'nope'" in answer["error"]["message"]
    doc = server.call("GET", "/openapi.json")[1]
    assert "/v1/chat/completions" in doc["paths"] and "/api/runs" in doc["paths"]


def test_api_key_rules(tmp_path):
    out = subprocess.run([sys.executable, "-m", "retrograd.commands.server", "--host", "0.0.0.0", "--state-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "requires --api-key" in out.stderr
    srv = Server(tmp_path / "keyed", "--api-key", "sekret")
    try:
        assert srv.call("GET", "/health")[0] == 200
        for method, path in (("GET", "/api/runs"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                             ("GET", "/openapi.json"), ("POST", "/api/runs")):
            status, body = srv.call(method, path, {} if method == "POST" else None)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", path
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").models.list()
        assert srv.client("sekret").models.list().data == []
        assert srv.call("GET", "/api/runs", headers={"Cookie": "retrograd_key=sekret"})[0] == 200
        try:
            urllib.request.urlopen(srv.url + "/", timeout=10)
            raise AssertionError("the page answered without the key")
        except urllib.error.HTTPError as e:
            assert e.code == 401 and b"requires an API key" in e.read()
    finally:
        srv.stop()
