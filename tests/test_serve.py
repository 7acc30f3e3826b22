"""`retrograd serve` on the real default model, reached with the openai SDK: the routes, tool calls,
refusals, and continuous batching (concurrent requests answer what each answers alone; a client
that hangs up frees its slot; the 429 and 503 rules of [serving].queue and wait_seconds)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest import THREADS, train_sft

from retrograd.generation.toolcalls import parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as r:
        return json.loads(r.read())


def with_serving(run_dir: Path, name: str, serving: str) -> Path:
    """The run's configuration with a [serving] section of its own."""
    cfg = run_dir / name
    cfg.write_text((run_dir / "run.toml").read_text() + f"\n[serving]\n{serving}\n")
    return cfg


def start(config: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "RETRO_THREADS": str(THREADS)}
    # stderr to a file: a pipe nobody reads would block the server once it filled up
    err = open(config.parent / f"serve-{port}.stderr", "w+")
    p = subprocess.Popen([sys.executable, "-m", "retrograd.cli", "serve", str(config), "--port", str(port), *extra],
                         stdout=subprocess.DEVNULL, stderr=err, text=True, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while time.time() < deadline:
        if p.poll() is not None:
            raise AssertionError(Path(err.name).read_text())
        try:
            urllib.request.urlopen(url + "/models", timeout=1)
            return p, url
        except urllib.error.HTTPError:
            return p, url           # up, but wants a key
        except OSError:
            time.sleep(0.2)
    p.kill()
    raise AssertionError("server did not start")


@pytest.fixture(scope="module")
def run_dir(smollm, tmp_path_factory):
    """An adapter trained to answer weather questions with a tool call, then with the result."""
    d = tmp_path_factory.mktemp("serve")
    recs = []
    for city in ["Oslo", "Lima", "Pune", "Kyoto", "Accra", "Quito", "Perth", "Turin"]:
        recs.append({"tools": [WEATHER], "messages": [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                                    "arguments": {"city": city}}}]},
            {"role": "tool", "content": "sunny, 21 C"},
            {"role": "assistant", "content": f"It is sunny and 21 C in {city}."}]})
    return train_sft(d, recs, smollm, name="s", ctx=1024, steps=12, every_steps=6, timeout=900)


@pytest.fixture(scope="module")
def server(run_dir):
    p, url = start(run_dir / "run.toml", "--model-name", "tuned")
    yield url
    p.terminate()
    p.wait(timeout=30)


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)


def test_models_and_plain_chat(server):
    c = client(server)
    assert sorted(m.id for m in c.models.list().data) == ["base", "tuned"]
    r = c.chat.completions.create(model="base", messages=[{"role": "user", "content": "Say hello."}],
                                  temperature=0, max_tokens=16)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 16
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streaming_arrives_in_one_piece(server):
    c = client(server)
    chunks = list(c.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "Hi"}],
                                            temperature=0, max_tokens=12, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")
    same = c.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                     max_tokens=12)
    assert same.choices[0].message.content == text        # temperature 0 is greedy


def test_tool_call_round_trip(server):
    c = client(server)
    msgs = [{"role": "user", "content": "What is the weather in Bergen?"}]
    r = c.chat.completions.create(model="tuned", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Bergen"}
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = c.chat.completions.create(model="tuned", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=32)
    assert r.choices[0].finish_reason == "stop" and "Bergen" in r.choices[0].message.content
    # tool_choice none leaves the catalog out: no tool call comes back
    r = c.chat.completions.create(model="tuned", messages=msgs[:1], tools=[WEATHER], tool_choice="none",
                                  temperature=0, max_tokens=24)
    assert not r.choices[0].message.tool_calls


def test_base_and_adapter_differ(server):
    c = client(server)
    msgs = [{"role": "user", "content": "What is the weather in Lima?"}]
    a = c.chat.completions.create(model="tuned", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=32)
    b = c.chat.completions.create(model="base", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=32)
    assert a.choices[0].message.tool_calls and (b.choices[0].message.content or "") != (a.choices[0].message.content or "")


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"temperature": "hot"}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
])
def test_refusals_name_the_field(server, extra, param):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "x"}], **extra)
    assert exc.value.body["param"] == param and param in exc.value.body["message"]


def raw_post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_unknown_and_oversized(server):
    status, body = raw_post(server, b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = raw_post(server, json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode())
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = raw_post(server, json.dumps({"model": "tuned", "messages": "hi"}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    big = json.dumps({"model": "tuned", "messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode()
    status, body = raw_post(server, big)
    assert status == 413 and "exceeds" in body["error"]["message"]


def test_client_disconnect_does_not_wedge(server):
    host, port = server.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": "tuned", "stream": True, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "Tell me a story."}]}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.2)
    r = client(server).chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
    assert r.choices[0].message.content is not None


def test_api_key_rules(run_dir):
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "serve", str(run_dir / "run.toml"), "--host",
                          "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "requires --api-key" in out.stderr
    p, url = start(run_dir / "run.toml", "--api-key", "sekret", "--base-only")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        status, body = raw_post(url, b"{}")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert [m.id for m in client(url, "sekret").models.list().data] == ["base"]
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.mark.parametrize("text, calls, fmt", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', [("f", {"a": 1})], "hermes"),
    ('ok <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>{"name": "g", "arguments": {"x": "y"}}'
     '</tool_call>', [("f", {}), ("g", {"x": "y"})], "hermes"),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 2}}', [("f", {"a": 2})], "llama3"),
    ('{"name": "f", "parameters": {"a": 2}}', [("f", {"a": 2})], "llama3"),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 3}}]', [("f", {"a": 3})], "mistral"),
    ('[TOOL_CALLS]f[ARGS]{"a": 4}', [("f", {"a": 4})], "mistral"),
    ('```tool_code\nf(a=5, b="x")\n```', [("f", {"a": 5, "b": "x"})], "gemma"),
    ('[f(a=6), g()]', [("f", {"a": 6}), ("g", {})], "gemma"),
    ('Sure:\n```json\n{"name": "f", "arguments": {"a": 7}}\n```', [("f", {"a": 7})], "json"),
    ("no call here", [], ""),
])
def test_tool_call_formats(text, calls, fmt):
    p = parse(text)
    assert [(c.name, c.arguments) for c in p.calls] == calls and p.format == fmt and not p.errors


def test_malformed_tool_calls_are_reported_not_raised():
    p = parse('<tool_call>{"name": "f", "arguments": {oops</tool_call>')
    assert not p.calls and p.errors and "not valid JSON" in p.errors[0]
    p = parse('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', {"f"})
    assert not p.calls and "unknown tool 'nope'" in p.errors[0]
    p = parse("```tool_code\nimport os\n```")
    assert not p.calls and p.errors


# ---- continuous batching ----------------------------------------------------------------------
def test_a_turn_takes_its_adapters_waiting_requests_and_keeps_the_others_turn():
    """Interleaved requests for adapters A and B: a fresh turn starts every waiting A together (up to the
    room); while it decodes, a new A joins only while the oldest waiting request is also an A."""
    from collections import deque
    from types import SimpleNamespace

    from retrograd.serve.scheduler import take_turn

    def queue(keys: str) -> deque:
        return deque(SimpleNamespace(key=k, n=i) for i, k in enumerate(keys))

    def names(jobs) -> str:
        return "".join(f"{j.key}{j.n}" for j in jobs)

    waiting = queue("ABABAA")
    assert names(take_turn(waiting, "A", 3, fresh=True)) == "A0A2A4" and names(waiting) == "B1B3A5"
    assert names(take_turn(waiting, "A", 1, fresh=False)) == ""            # B1 is older: no more A this turn
    assert names(take_turn(waiting, "B", 8, fresh=True)) == "B1B3" and names(waiting) == "A5"
    assert names(take_turn(waiting, "B", 8, fresh=False)) == ""
    waiting = queue("AAB")
    assert names(take_turn(waiting, "A", 1, fresh=False)) == "A0"           # room for one
    assert names(take_turn(waiting, "A", 0, fresh=True)) == "" and len(waiting) == 2


STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]
COUNT = [{"role": "user", "content": "Count from 1 to 20."}]
BURST = [   # each client's own model (adapter group), sampler, seed, stop strings, tools and streaming
    dict(model="tuned", messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=[WEATHER],
         temperature=0, max_tokens=48),
    dict(model="tuned", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=24, stream=True),
    dict(model="tuned", messages=STORY, temperature=0.9, seed=7, max_tokens=32),
    dict(model="tuned", messages=STORY, temperature=0.9, seed=8, top_p=0.9, max_tokens=32),
    dict(model="tuned", messages=COUNT, temperature=0, stop=["5", "\n\n"], max_tokens=40),
    dict(model="tuned", messages=STORY, temperature=0.7, seed=3, max_tokens=28, stream=True, stop=[" the "]),
    dict(model="base", messages=COUNT, temperature=0, max_tokens=32),
    dict(model="base", messages=STORY, temperature=1.0, seed=11, max_tokens=24, stream=True),
]


def ask(url: str, kw: dict) -> tuple:
    """What a client sees of one answer: text, tool calls, finish reason (and tokens, unless streamed)."""
    c = client(url)
    if kw.get("stream"):
        chunks = list(c.chat.completions.create(**kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return text, None, chunks[-1].choices[0].finish_reason, None
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    return m.content, calls, r.choices[0].finish_reason, r.usage.completion_tokens


def test_concurrent_requests_answer_what_each_answers_alone(server):
    alone = [ask(server, kw) for kw in BURST]
    assert alone[0][1] and alone[0][2] == "tool_calls"          # the tuned adapter calls its tool
    assert alone[4][2] == "stop" and "5" not in alone[4][0]       # cut before the stop string
    pieces = list(client(server).chat.completions.create(**BURST[1]))
    assert len(pieces) > 3                                        # streamed as it is decoded, not in one piece
    seen = []
    with ThreadPoolExecutor(len(BURST) + 1) as pool:
        futures = [pool.submit(ask, server, kw) for kw in BURST]
        while not all(f.done() for f in futures):
            seen.append(health(server)["decoding"])
            time.sleep(0.05)
        together = [f.result() for f in futures]
    assert max(seen) >= 2, seen                                   # they were decoded together
    for kw, a, b in zip(BURST, alone, together):
        if kw["temperature"] == 0:
            assert a == b, (kw, a, b)          # greedy: exactly what it answers alone
        else:
            # sampled: its own seed and settings, but llama.cpp's attention over a batch that holds
            # other sequences' cells rounds differently, and one different draw changes the rest
            # (docs/server.md, "Results"); a whole, well-formed answer within its limits
            assert b[0] and b[2] in ("stop", "length"), (kw, b)
            assert b[3] is None or b[3] <= kw["max_tokens"]
            if kw.get("stop"):
                assert not any(x in b[0] for x in kw["stop"]), (kw, b)
    h = health(server)
    assert h["decoding"] == 0 and h["waiting"] == 0 and h["parallel"] >= 2


def long_stream(url: str) -> socket.socket:
    """A streaming request for many tokens, sent on a raw socket; returns once its first tokens arrived."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": "base", "stream": True, "max_tokens": 900, "temperature": 0,
                       # greedy, the default model repeats this to the 900-token limit (about 14 s
                       # alone on 2 cores); "Count from 1 to 1000." stops after 233 tokens
                       "messages": [{"role": "user", "content": "Repeat the word hello 1000 times."}]}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    return s


@pytest.fixture(scope="module")
def one_at_a_time(run_dir):
    p, url = start(with_serving(run_dir, "one.toml", "parallel = 1\nqueue = 1\nwait_seconds = 2"), "--base-only")
    yield url
    p.terminate()
    p.wait(timeout=30)


def test_disconnect_mid_stream_frees_the_slot(one_at_a_time):
    url = one_at_a_time
    s = long_stream(url)
    assert health(url)["decoding"] == 1
    s.close()
    t0 = time.monotonic()
    while health(url)["decoding"] and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    freed = time.monotonic() - t0
    r = client(url).chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0)
    assert freed < 1.0 and r.choices[0].message.content is not None, freed


def test_busy_server_answers_429_and_a_long_wait_503(one_at_a_time):
    url = one_at_a_time
    s = long_stream(url)                  # decoding: the one slot is taken for several seconds
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(raw_post, url, json.dumps({"model": "base", "messages": COUNT,
                                                             "max_tokens": 4}).encode())
            t0 = time.monotonic()
            while health(url)["waiting"] < 1 and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            status, body = raw_post(url, json.dumps({"model": "base", "messages": COUNT}).encode())
            assert status == 429 and body["error"]["code"] == "queue_full", body
            assert "[serving].parallel = 1" in body["error"]["message"] and "[serving].queue = 1" in body["error"]["message"]
            status, body = waiting.result()
        assert status == 503 and body["error"]["code"] == "wait_timeout", body
        assert "[serving].wait_seconds = 2" in body["error"]["message"]
    finally:
        s.close()
