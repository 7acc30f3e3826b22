"""The Vulkan build on Mesa's lavapipe (scripts/build_vulkan.sh makes .venv-vulkan): the GPU device is
found, preflight names the training-graph ops Vulkan lacks, a few SFT steps on the device give the
losses of the CPU within a stated tolerance, require_gpu_resident refuses exactly when ops would
fall back, and a stress check trains on the device ten times in a row (the crash of issue 38 came
in 10 of 36 runs; docs/building.md). Slow (the build takes 20-30 minutes on 2
cores): run only when asked, RETRO_CI_VULKAN=1 bash .ci/run (which builds it first) or
RETRO_CI_VULKAN=1 pytest tests/test_vulkan.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import THREADS

ROOT = Path(__file__).resolve().parent.parent
VK = ROOT / ".venv-vulkan" / "bin"

pytestmark = pytest.mark.skipif(os.environ.get("RETRO_CI_VULKAN") != "1",
                                reason="the Vulkan build is tested only when asked: RETRO_CI_VULKAN=1")

LOSS_RTOL = 2e-2      # a different device's kernels (F16/F32 accumulation orders) over 3 steps


def device_env() -> dict:
    """The variables every device run gets: lavapipe made visible, the test's threads, and Mesa 25's
    lavapipe where scripts/build_vulkan.sh unpacked it (.vulkan-mesa/env; the system's otherwise)."""
    env = {"GGML_VK_VISIBLE_DEVICES": "0", "RETRO_THREADS": str(THREADS)}
    mesa = ROOT / ".vulkan-mesa" / "env"
    if mesa.exists() and "VK_ICD_FILENAMES" not in os.environ:
        env.update(kv.split("=", 1) for kv in mesa.read_text().split())
    return env


def vk(*args: str, cwd: Path, env: dict | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    if not (VK / "retrograd").exists():
        pytest.fail("no .venv-vulkan: run bash scripts/build_vulkan.sh")
    full = {**os.environ, **device_env(), **(env or {})}
    return subprocess.run([str(VK / "retrograd"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=full)


def write_run(d: Path, model, device: str, data: Path, *, max_steps: int = 3, every_steps: int = 0) -> Path:
    """d/run.toml: SFT of `model` on `device` with the tests' small LoRA, on `data` (written by
    write_data), `max_steps` steps of 2 rows, a checkpoint every `every_steps` (0: at the end)."""
    cfg = d / "run.toml"
    cfg.write_text(f'[model]\npath = "{model}"\nctx = 128\ndevice = "{device}"\n[lora]\nrank = 4\nalpha = 8\n'
                   f'[data]\ntrain = "{data}"\nshuffle = false\n[training]\nmax_steps = {max_steps}\n'
                   f'batch_size = 2\nlearning_rate = 1e-3\n[checkpoint]\nevery_steps = {every_steps}\n')
    return cfg


def write_data(d: Path) -> Path:
    """Twelve chat rows that all answer ZEBRA-7."""
    rows = [{"messages": [{"role": "user", "content": f"Code {i}?"}, {"role": "assistant", "content": "ZEBRA-7"}]}
            for i in range(12)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "train.jsonl"


def test_inspect_and_preflight_on_the_vulkan_device(smollm, tmp_path):
    out = vk("inspect", "--model", str(smollm), "--device", "gpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    device = next(line for line in out.stdout.splitlines() if line.startswith("device"))
    assert "Vulkan" in device or "llvmpipe" in device.lower(), device
    out = vk("preflight", "--model", str(smollm), "--device", "gpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "every op of the training graph" in out.stdout or "fall back" in out.stdout, out.stdout
    # lavapipe is a software driver, and the CPU-only F16 kernels are not there: both named, with why
    assert "software GPU driver" in out.stdout and "base weight -> F32 transposed copy" in out.stdout, out.stdout
    assert "LM head backward in F32" in out.stdout, out.stdout


def test_sft_on_the_device_matches_the_cpu_and_residency_is_enforced(smollm, tmp_path):
    data = write_data(tmp_path)
    losses = {}
    for device in ("cpu", "gpu"):
        d = tmp_path / device
        d.mkdir()
        out = vk("train", str(write_run(d, smollm, device, data)), cwd=d)
        assert out.returncode == 0, out.stderr
        losses[device] = [json.loads(line)["loss"] for line in (d / "runs" / "run" / "metrics.jsonl").read_text()
                          .splitlines() if "loss" in json.loads(line)]
    assert len(losses["gpu"]) == 3
    for a, b in zip(losses["cpu"], losses["gpu"]):
        assert abs(a - b) <= LOSS_RTOL * abs(a), losses
    pre = vk("preflight", "--model", str(smollm), "--device", "gpu", cwd=tmp_path)
    falls_back = "every op of the training graph" not in pre.stdout
    strict = vk("train", str(tmp_path / "gpu" / "run.toml"), cwd=tmp_path / "gpu",
                env={"RETRO_REQUIRE_GPU_RESIDENT": "1"})
    if falls_back:
        assert strict.returncode == 1 and "require_gpu_resident" in strict.stderr, strict.stderr
    else:
        assert strict.returncode == 0, strict.stderr


STRESS_RUNS = int(os.environ.get("RETRO_VK_STRESS_RUNS", "10"))


def test_device_training_survives_repeated_runs(tiny, tmp_path):
    """The device training of a small synthetic model, STRESS_RUNS times in a row, the first from an
    empty Mesa shader cache (every pipeline compiled while the device executes). Before the fix
    10 of 36 runs died (issue 38: lavapipe's queue thread faulting on a freed object), so ten
    passes by luck have a chance of about 4% ((26/36)^10). Each run must finish its steps, exit 0."""
    model = tiny("llama", n_layer=4, n_embd=128)
    write_run(tmp_path, model, "gpu", write_data(tmp_path))
    cache = tempfile.mkdtemp(dir=tmp_path)
    for run in range(STRESS_RUNS):
        out = vk("train", str(tmp_path / "run.toml"), cwd=tmp_path, timeout=900,
                 env={"MESA_SHADER_CACHE_DIR": cache, "RETRO_REQUIRE_GPU_RESIDENT": "1", "PYTHONFAULTHANDLER": "1"})
        last = (out.stderr.strip().splitlines() or [""])[-1]
        assert out.returncode == 0, f"run {run + 1} of {STRESS_RUNS}: exit {out.returncode}, last line {last!r}\n" \
                                    + out.stderr[-3000:]
        assert "done: 3 steps" in out.stdout, out.stdout


def test_a_driver_fault_leaves_a_plain_note_and_a_resumable_run(tiny, tmp_path):
    """The containment of issue 38: a device training killed by SIGSEGV (as lavapipe's queue thread
    faulting kills it) says on stderr what happened, which checkpoint is intact and the command
    that continues the run, and that command finishes the run from there."""
    model = tiny("llama", n_layer=4, n_embd=128)
    cfg = write_run(tmp_path, model, "gpu", write_data(tmp_path), max_steps=40, every_steps=1)
    env = {**os.environ, **device_env()}
    proc = subprocess.Popen([str(VK / "retrograd"), "train", str(cfg)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ckpts = tmp_path / "runs" / "run" / "checkpoints"
    deadline = time.monotonic() + 900
    while not list(ckpts.glob("step-2.state")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGSEGV)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, err[-2000:])
    assert "died of a fatal signal while training on Vulkan0" in err, err[-2000:]
    assert f"retrograd train {cfg} --resume" in err, err[-2000:]
    named = err.split("its last checkpoint, ")[1].split(", is intact")[0]
    assert Path(named).is_dir() and Path(named).name.startswith("step-"), named
    out = vk("train", str(cfg), "--resume", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed at step {Path(named).name.split('-')[1].split('.')[0]}" in out.stdout + out.stderr
    assert "done: 40 steps" in out.stdout, out.stdout[-2000:]
