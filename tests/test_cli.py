"""The command line on the real default model: --help, inspect, preflight, bench, chat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import THREADS, train_sft

from retrograd import native

#: the flags and environment variables the specification's command reference names
SPEC_FLAGS = ("--adapter --allow-unverified --api --api-key --base-only --checkpoint --compare --ctx --data --device "
              "--dry-run --fixtures --force --format --help --host --json --k --keep --limit --max-new-tokens "
              "--min-gap --min-reward --model --model-name --no-connect --out --pairs --port --raw --report "
              "--require-verified --resume --seed --strict --system --targets --temp --top-p").split()
SPEC_ENV = ("RETRO_DEVICE_LOGPROBS", "RETRO_DEVICE_SAMPLING", "RETRO_FAST_TOP_P", "RETRO_REQUIRE_GPU_RESIDENT",
            "RETRO_THREADS", "RUST_LOG")
SPEC_COMMANDS = ["train", "bench", "chat", "serve", "inspect", "preflight", "distill-teacher", "tools", "scenarios",
                 "judge", "collect"]


def cli(*args: str, stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RETRO_THREADS": str(THREADS)}
    return subprocess.run([sys.executable, "-m", "retrograd.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_help_lists_every_command_of_the_specification():
    out = cli("--help")
    assert out.returncode == 0
    for c in SPEC_COMMANDS:
        assert c in out.stdout, c
    # every flag and environment variable the specification names is in the help
    import re

    helps = out.stdout + "".join(subprocess.run([sys.executable, "-m", m, "--help"], capture_output=True, text=True,
                                                timeout=60).stdout
                                 for m in ("retrograd.commands.server", "retrograd.commands.profile"))
    assert not [f for f in SPEC_FLAGS if not re.search(re.escape(f) + r"(?![\w-])", helps)]
    assert not [e for e in SPEC_ENV if e not in out.stdout]
    # two of them are named there only: nothing reads them (sampling runs on the host on every device)
    package = Path(native.__file__).parent
    readers = [p.name for p in package.rglob("*.py") if p.name != "cli.py" and "RETRO_DEVICE_" in p.read_text()]
    assert readers == []


def test_inspect(smollm):
    out = cli("inspect", "--model", str(smollm))
    assert out.returncode == 0, out.stderr
    for text in ("architecture llama", "Q4_1 x210", "Q8_0 x1", "LoRA targets q,k,v,o,gate,up,down", "device       CPU",
                 "30, width 576"):
        assert text in out.stdout, text


def test_inspect_gemma(gemma):
    out = cli("inspect", "--model", str(gemma))
    assert out.returncode == 0, out.stderr
    assert "architecture gemma3" in out.stdout and "sliding window 512 on 15 layers" in out.stdout


def test_preflight_and_missing_model(smollm, tmp_path):
    out = cli("preflight", "--model", str(smollm), "--targets", "q,v", "--strict")
    assert out.returncode == 0 and "every op of the training graph" in out.stdout
    assert "slow paths" not in out.stdout, out.stdout      # the CPU build's own route for every op
    kernel = native.matmul_kernel("auto")                     # and which product route auto takes, and why
    assert f"packed kernel {kernel}" in out.stdout and ("AVX" in out.stdout or "AMX" in out.stdout
                                                        or kernel == "ggml"), out.stdout
    out = cli("preflight", "--model", str(tmp_path / "nope.gguf"))
    assert out.returncode == 1 and "no such model file" in out.stderr and "Traceback" not in out.stderr
    out = cli("preflight", "--model", str(smollm), "--targets", "q,zz")
    assert out.returncode == 2 and "--targets" in out.stderr
    out = cli("inspect", "--model", str(smollm), "--device", "gpu")
    assert out.returncode == 1 and "no GPU device" in out.stderr


@pytest.fixture(scope="module")
def trained(smollm, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    recs = [{"messages": [{"role": "user", "content": f"Code {i}?"}, {"role": "assistant", "content": "ZEBRA-7"}]}
            for i in range(16)]
    return train_sft(d, recs, smollm, name="c", ctx=256, steps=6, extra="eval_split = 0.25")


def test_bench_base_and_adapter(trained):
    adapter = trained / "runs/c/adapter.gguf"
    out = cli("bench", str(trained / "run.toml"), "--adapter", str(adapter), "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["examples"] == 4
    assert rep["results"]["adapter"]["eval_loss"] < rep["results"]["base"]["eval_loss"] * 0.5
    out = cli("bench", str(trained / "run.toml"), "--format", "text", "--limit", "2")
    assert out.returncode == 0 and "perplexity" in out.stdout and "adapter" not in out.stdout


def test_chat_piped_compare_reset_exit(trained):
    out = cli("chat", str(trained / "run.toml"), "--compare", "--temp", "0", "--max-new-tokens", "12",
              stdin="Code 99?\n/reset\nCode 5?\n/exit\nnever read\n")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum(line.startswith("[base]") for line in lines) == 2
    adapter_lines = [line for line in lines if line.startswith("[adapter]")]
    assert len(adapter_lines) == 2 and all("ZEBRA" in line for line in adapter_lines)
    assert "(history cleared)" in lines
    out = cli("chat", str(trained / "run.toml"), "--base-only", "--temp", "0", "--max-new-tokens", "8",
              stdin="hello\n")
    assert out.returncode == 0 and out.stdout.strip()


@pytest.mark.parametrize("command", [["chat", "--base-only"], ["serve", "--base-only"], ["bench"]])
def test_device_gpu_without_a_gpu_fails_the_same_everywhere(trained, command):
    from retrograd import native

    if any(d.kind in ("gpu", "igpu") for d in native.devices()):
        pytest.skip("this machine has a GPU")
    out = cli(command[0], str(trained / "run.toml"), *command[1:], "--device", "gpu", stdin="hi\n", timeout=120)
    assert out.returncode == 1 and "--device gpu: no GPU device" in out.stderr and "Traceback" not in out.stderr


def test_man_pages_match_the_parsers():
    """man/man1 is what scripts/make_manpages.py writes from the argparse parsers now (run it after
    changing a flag); every command of the specification has a page, and man can format each."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "scripts" / "make_manpages.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pages = {p.stem for p in (root / "man" / "man1").glob("*.1")}
    assert {f"retrograd-{c}" for c in SPEC_COMMANDS} | {"retrograd", "retrograd-server", "retrograd-profile"} <= pages
    text = (root / "man" / "man1" / "retrograd-train.1").read_text()
    assert "\\-\\-resume" in text and "\\-\\-device" in text
    if shutil.which("man"):
        shown = subprocess.run(["man", "-l", str(root / "man" / "man1" / "retrograd-server.1")], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "MANPAGER": "cat", "MANWIDTH": "100"})
        assert shown.returncode == 0 and "--state-dir" in shown.stdout
        # installed where man looks for the environment's commands (setup.sh copies them into the
        # venv for an editable install; a wheel installs them as data files)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("MANPATH", None)
        where = subprocess.run(["man", "-w", "retrograd-train"], capture_output=True, text=True, timeout=60, env=env)
        assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(Path(sys.prefix)), where


@pytest.mark.parametrize("env, shown", [
    ({}, False), ({"RUST_LOG": "info"}, True), ({"RETRO_LOG": "debug"}, True),
    ({"RUST_LOG": "warn,retrograd=info"}, True), ({"RUST_LOG": "retrograd=error"}, False)])
def test_rust_log_sets_retrograds_own_level(smollm, env, shown):
    clean = {k: v for k, v in os.environ.items() if k not in ("RUST_LOG", "RETRO_LOG")}
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "inspect", "--model", str(smollm)], capture_output=True,
                         text=True, timeout=120, env={**clean, **env})
    assert out.returncode == 0, out.stderr
    assert ("INFO retrograd] model" in out.stderr) == shown, out.stderr


def test_rust_log_without_a_level_says_so(smollm):
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "inspect", "--model", str(smollm)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "RUST_LOG": "loud"})
    assert out.returncode == 0 and "names no level" in out.stderr

