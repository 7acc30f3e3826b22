"""[distributed] on a local Ray cluster of two workers (1 thread each): data-parallel SFT equals the
one-process run, GRPO samples on the workers and resumes exactly, a killed worker is replaced
without changing the result, a killed driver is a resumable crash. Replica, the worker's body, is
also driven in-process against the engine directly."""

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
from test_grpo import make_run as make_grpo_run
from test_grpo import metrics as grpo_metrics
from test_trainer import losses, make_run

from retrograd import adapter as adapter_io
from retrograd import native
from retrograd.batch import Tally
from retrograd.config import load
from retrograd.context import open_model
from retrograd.distributed import ClusterError
from retrograd.distributed.cluster import split_balanced
from retrograd.distributed.remote_gen import split_even
from retrograd.distributed.replica import Replica, digest, read_state
from retrograd.trainer import train

pytest.importorskip("ray", reason="Ray is part of the test extra (pip install -e '.[test]')")

#: a test that starts a local Ray cluster is `slow`; the in-process Replica and the refusals are not
STARTS_RAY = pytest.mark.slow

RAY = """
[distributed]
backend = "ray"
workers = 2
threads_per_worker = 1
check_every = {check}
"""


def adapter(run: Path) -> dict[str, np.ndarray]:
    return adapter_io.read(run / "adapter.gguf").tensors


def test_splits_are_balanced_and_deterministic():
    assert split_balanced([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]        # 8 and 7 tokens, each in order
    assert split_balanced([3], 2) == [[0], []]
    assert [list(r) for r in split_even(5, 2)] == [[0, 1, 2], [3, 4]]
    assert sum(len(r) for r in split_even(7, 3)) == 7


def test_replica_gradients_and_step_equal_the_driver(tiny, tmp_path):
    """Two in-process replicas each take half the micro-batches; their summed gradient and the
    applied step give the driver's adapter bit for bit (float32 sum order aside: compared at 1e-6)."""
    cfg = load(make_run(tmp_path, tiny("llama"), steps=1))
    ctx = open_model(cfg)
    from retrograd.algorithms import recipe_for

    work = recipe_for("sft")(ctx).next_step()
    assert len(work.micro) >= 2
    tr = ctx.trainable
    hp = {"lr": 1e-2, "step": 1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0,
          "lr_b_ratio": 1.0}
    reps = [Replica(r, str(tr.model_path), tr.spec, "cpu", 1) for r in range(2)]
    for rep in reps:
        assert rep.load_state(read_state(tr)) == digest(tr)
    parts = [reps[0].gradients(work.micro[0::2]), reps[1].gradients(work.micro[1::2])]
    summed = [a + b for a, b in zip(parts[0]["grads"], parts[1]["grads"])]
    tally = Tally()
    for mb in work.micro:
        tr.accumulate(mb.batch, lambda inp, mb=mb: mb.loss(inp, tally))
    local = [tr.lora.read(t.index, native.SLOT_GRAD) for t in tr.lora.tensors]
    for a, b in zip(local, summed):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    merged = Tally()
    for p in parts:
        merged.merge(p["tally"])
    assert merged.result()["loss"] == pytest.approx(tally.result()["loss"], rel=1e-9)
    # the same summed gradient gives every replica the same bits
    for t, g in zip(tr.lora.tensors, summed):
        tr.lora.write(t.index, g, native.SLOT_GRAD)
    norm = tr.optimizer_step(**hp)
    assert [rep.apply(summed, hp) for rep in reps] == [norm, norm]
    assert {rep.digest() for rep in reps} == {digest(tr)}
    for rep in reps:
        rep.close()
    tr.close()


@pytest.fixture(scope="module")
def sft_pair(tiny, tmp_path_factory):
    """The same SFT run in one process and on two Ray workers (check_every = 2)."""
    out = {}
    for name, extra in (("one", ""), ("ray", RAY.format(check=2))):
        d = tmp_path_factory.mktemp(name)
        train(open_model(load(make_run(d, tiny("llama"), steps=8, every=4, extra=extra))))
        out[name] = d / "runs" / "t"
    return out


@STARTS_RAY
def test_sft_on_two_workers_equals_one_process(sft_pair):
    one, ray = sft_pair["one"], sft_pair["ray"]
    la, lb = losses(one), losses(ray)
    assert la.keys() == lb.keys()
    for k in la:
        assert lb[k] == pytest.approx(la[k], rel=1e-4), k
    a, b = adapter(one), adapter(ray)
    scale = max(float(np.abs(v).max()) for v in a.values())
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert 0 < worst <= 1e-3 * scale        # float32 sums in another order, nothing more
    recs = [json.loads(x) for x in (ray / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    for r in recs:
        assert r["dist_workers"] == 2 and r["dist_compute_s"] > 0 and r["dist_comm_s"] >= 0
        assert r["dist_w0_s"] > 0 and r["dist_w1_s"] > 0
    pids = json.loads((ray / "workers.json").read_text())
    assert sorted(pids) == ["0", "1"] and len(set(pids.values())) == 2


@STARTS_RAY
def test_grpo_samples_on_the_workers_and_resumes_exactly(tiny, tmp_path):
    model = tiny("qwen3", n_layer=2)
    runs = {}
    for name, steps, resume, dist in (("local", 4, False, False), ("a", 4, False, True), ("b", 2, False, True),
                                      ("b", 4, True, True)):
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        cfg = make_grpo_run(d, model, steps=steps, iterations=2, every=1)
        if dist:
            cfg.write_text(cfg.read_text() + RAY.format(check=1))
        train(open_model(load(cfg)), resume=resume)
        runs[name] = d
    local, a, b = (grpo_metrics(runs[n]) for n in ("local", "a", "b"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y, z in zip(local, a, b):
        for k in ("loss", "reward_mean", "kl"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), (x["step"], k)
                assert z[k] == pytest.approx(y[k], rel=1e-9, abs=1e-12), (x["step"], k)
    assert all(r["dist_gen_s"] > 0 for r in a if "reward_mean" in r)      # sampled on the workers
    assert (runs["a"] / "runs/g/adapter.gguf").read_bytes() == (runs["b"] / "runs/g/adapter.gguf").read_bytes()


def _start(cfg: Path) -> subprocess.Popen:
    env = {**os.environ, "RETRO_THREADS": str(THREADS)}
    return subprocess.Popen([sys.executable, "-m", "retrograd.cli", "train", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-2000:]}")
        m = run / "metrics.jsonl"
        if (run / "workers.json").exists() and m.exists() and losses(run) and max(losses(run)) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _kill_worker_1_at_step_5(cfg: Path, run: Path) -> tuple[subprocess.Popen, str]:
    """`retrograd train cfg` with worker 1 SIGKILLed once step 5 is logged; the finished process
    and its stderr."""
    proc = _start(cfg)
    try:
        _wait_for_step(run, 5, proc)
        os.kill(json.loads((run / "workers.json").read_text())["1"], signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, err


def long_run(d: Path, model: Path) -> Path:
    return make_run(d, model, steps=60, every=20, extra=RAY.format(check=5))


@STARTS_RAY
def test_a_killed_worker_is_replaced_and_the_result_is_unchanged(tiny, tmp_path):
    model = tiny("llama")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train(open_model(load(long_run(tmp_path / "a", model))))
    run = tmp_path / "b/runs/t"
    proc, err = _kill_worker_1_at_step_5(long_run(tmp_path / "b", model), run)
    assert proc.returncode == 0, err[-3000:]
    assert "worker 1 died; replaced by worker 2" in err
    assert max(losses(run)) == 60
    assert sorted(json.loads((run / "workers.json").read_text())) == ["0", "2"]
    assert (tmp_path / "a/runs/t/adapter.gguf").read_bytes() == (run / "adapter.gguf").read_bytes()


@STARTS_RAY
def test_a_killed_driver_is_a_resumable_crash(tiny, tmp_path):
    model = tiny("llama")
    cfg = long_run(tmp_path, model)
    run = tmp_path / "runs/t"
    proc = _start(cfg)
    try:
        _wait_for_step(run, 25, proc)      # past the checkpoint of step 20
        pids = json.loads((run / "workers.json").read_text()).values()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the workers do not outlive their driver
    end = time.monotonic() + 60
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "train", str(cfg), "--resume"], capture_output=True,
                         text=True, env={**os.environ, "RETRO_THREADS": str(THREADS)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed at step 20" in out.stderr and max(losses(run)) == 60


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:      # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_without_ray_the_error_says_how_to_install_it(tiny, tmp_path, monkeypatch):
    cfg = load(make_run(tmp_path, tiny("llama"), steps=1, extra=RAY.format(check=0)))
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ClusterError, match=r"pip install \"retrograd\[ray\]\""):
        train(open_model(cfg))


@STARTS_RAY
def test_profile_shows_each_worker_and_the_communication(tiny, tmp_path):
    cfg = make_run(tmp_path, tiny("llama"), steps=4, extra=RAY.format(check=0))
    cmd = [sys.executable, "-m", "retrograd.commands.profile", str(cfg), "--steps", "2", "--threads", str(THREADS)]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout)
    assert rep["workers"] == 2 and rep["algorithm"] == "sft"
    med = rep["median"]
    assert med["dist_w0_s"] > 0 and med["dist_w1_s"] > 0 and med["dist_comm_s"] >= 0
    assert med["dist_compute_s"] == pytest.approx(max(med["dist_w0_s"], med["dist_w1_s"]), rel=0.5)
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "on 2 Ray workers x 1 threads: gradient per worker: w0" in text.stdout and "communication" in text.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("body, key", [('backend = "mpi"', "backend"), ("workers = 0", "workers"),
                                       ("threads_per_worker = 0", "threads_per_worker"), ("rollouts = 1", "rollouts")])
def test_distributed_keys_are_checked(tmp_path, body, key):
    from retrograd.config import ConfigError

    cfg = tmp_path / "run.toml"
    cfg.write_text(f"[distributed]\n{body}\n")
    with pytest.raises(ConfigError, match=rf"\[distributed\]\.{key}|distributed\.{key}"):
        load(cfg)


@STARTS_RAY
def test_ppo_samples_on_the_workers_and_keeps_its_gradients_here(tiny, tmp_path):
    """PPO's value head trains inside its loss, in the driver: its rollouts are split between the
    workers, its gradients are not; a batch's two updates equal the one-process run's, the adapter
    and the value head byte for byte.

    One batch, not several: llama.cpp's decoding rounds differently with how prompts are chunked
    (a worker decodes its share of the prompts, the one process all of them together: 4e-3 nats
    on this tiny model's sampling log-probs), so once the adapter has moved, a later batch may
    draw another token somewhere (docs/distributed.md: equal "beyond rounding")."""
    from test_ppo import make_run as ppo_run
    from test_ppo import rows as ppo_rows

    model = tiny("llama", n_layer=2)
    for name, dist in (("one", False), ("ray", True)):
        d = tmp_path / name
        d.mkdir()
        cfg = ppo_run(d, model, steps=2)
        if dist:
            cfg.write_text(cfg.read_text() + RAY.format(check=0))
        train(open_model(load(cfg)))
    one, ray = ppo_rows(tmp_path / "one"), ppo_rows(tmp_path / "ray")
    assert len(one) == len(ray) == 2
    for x, y in zip(one, ray):
        for k in ("reward_mean", "pg_loss", "value_loss", "kl"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), (x["step"], k)
    assert all(r["dist_gen_s"] > 0 for r in ray if "reward_mean" in r)
    assert not any("dist_w0_s" in r for r in ray)          # no gradients computed on the workers
    out = {name: tmp_path / name / "runs/p" for name in ("one", "ray")}
    assert (out["one"] / "adapter.gguf").read_bytes() == (out["ray"] / "adapter.gguf").read_bytes()
    heads = [json.loads((o / "checkpoints/step-2.state/state.json").read_text())["trainer"]["recipe"]["value_head"]
             for o in out.values()]
    assert heads[0] == heads[1] and heads[0]["t"] == 2


@STARTS_RAY
def test_without_replacements_the_survivors_carry_on(tiny, tmp_path):
    """max_restarts = 0: a killed worker is not replaced; the step is redone on the survivor and the
    run ends with the adapter of the same run on one worker's split (float32 sums aside)."""
    model = tiny("llama")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    cfg_a = long_run(tmp_path / "a", model)
    train(open_model(load(cfg_a)))
    cfg_b = long_run(tmp_path / "b", model)
    cfg_b.write_text(cfg_b.read_text() + "max_restarts = 0\n")
    run = tmp_path / "b/runs/t"
    proc, err = _kill_worker_1_at_step_5(cfg_b, run)
    assert proc.returncode == 0, err[-3000:]
    assert "worker 1 died; no replacement left (max_restarts = 0): 1 workers carry on" in err
    assert max(losses(run)) == 60 and sorted(json.loads((run / "workers.json").read_text())) == ["0"]
    a, b = adapter(tmp_path / "a/runs/t"), adapter(run)
    scale = max(float(np.abs(v).max()) for v in a.values())
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= 1e-3 * scale
