"""The workers of a distributed run, on Ray: starting them, splitting a step's micro-batches and a
rollout's groups among them, summing their gradients, keeping their replicas identical, and
replacing a worker that dies.

The driver (the `retrograd train` process) keeps its own replica of the adapter: it sums the
workers' gradients, takes the AdamW step, writes checkpoints and evaluates, exactly as a run
without [distributed] does. The workers compute, the driver decides. A worker that dies while
computing a step's gradient is replaced by a new one loaded with the driver's state and the step's
gradient is computed again with the same split, so the run's result does not depend on the death;
when no replacement is left (max_restarts) the step is redone on the survivors.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from retrograd import native
from retrograd.batch import Tally
from retrograd.config import Config
from retrograd.context import RunContext
from retrograd.distributed.remote_gen import RemoteGenerator
from retrograd.distributed.replica import Replica, digest, read_state, write_grads
from retrograd.engine import Trainable
from retrograd.errors import RetrogradError
from retrograd.fsutil import atomic_write
from retrograd.logs import log

START_TIMEOUT_S = 600.0


class ClusterError(RetrogradError):
    pass


def import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError('[distributed].backend = "ray" needs Ray: pip install "retrograd[ray]"') from None
    return ray


def split_balanced(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `sizes` in `parts` shares of about equal total size (largest first to the lightest
    share), each share in its original order; deterministic, so a redone step splits the same way."""
    load = [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(parts), key=lambda k: (load[k], k))
        shares[k].append(i)
        load[k] += sizes[i]
    return [sorted(s) for s in shares]


class Cluster:
    def __init__(self, cfg: Config, trainable: Trainable, out: Path, note: Callable[[str], None]) -> None:
        self.d = cfg.distributed
        self.tr = trainable
        self.out = out
        self.note = note
        self.ray = ray = import_ray()
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            logging.getLogger("ray").setLevel(logging.ERROR)
            opts = {"include_dashboard": False, "logging_level": logging.ERROR,
                    "log_to_driver": log.isEnabledFor(logging.DEBUG)}
            try:
                if self.d.address == "local":
                    cpus = max(os.cpu_count() or 1, self.d.workers * self.d.threads_per_worker)
                    ray.init(num_cpus=cpus, object_store_memory=512 << 20, **opts)
                else:
                    ray.init(address=self.d.address, **opts)
            except Exception as exc:     # Ray raises ConnectionError, RuntimeError, ValueError...
                raise ClusterError(f"[distributed].address = {self.d.address!r}: could not start or reach "
                                   f"Ray: {exc}") from None
        self.actor = ray.remote(Replica)
        self.spec = trainable.spec
        self.device = cfg.model.device
        self.recompute = cfg.training.activation_checkpointing
        self.matmul = cfg.training.matmul_precision
        self.restarts = 0
        self.synced = False
        self.timings: dict[str, float] = {}
        self.gen_s = 0.0
        self.workers: list = []
        self.ranks: list[int] = []
        self.next_rank = 0
        for _ in range(self.d.workers):
            self._add()
        self._wait_started()
        self._write_roster()

    # ---- workers -------------------------------------------------------------------------------
    def _add(self):
        rank = self.next_rank
        self.next_rank += 1
        w = self.actor.options(num_cpus=self.d.threads_per_worker, max_restarts=0).remote(
            rank, str(self.tr.model_path), self.spec, self.device, self.d.threads_per_worker, self.recompute,
            self.matmul)
        self.workers.append(w)
        self.ranks.append(rank)
        return w

    def _wait_started(self) -> None:
        try:
            self.pids = dict(zip(self.ranks, self.ray.get([w.pid.remote() for w in self.workers],
                                                          timeout=START_TIMEOUT_S)))
        except self.ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the Ray workers did not start within {START_TIMEOUT_S:.0f} s: the cluster needs "
                               f"{self.d.workers} x {self.d.threads_per_worker} free CPUs") from None
        except self.ray.exceptions.RayActorError as exc:
            raise ClusterError(f"a Ray worker failed to start: {exc}") from None

    def _write_roster(self) -> None:
        """workers.json in the run directory: rank and process id of each live worker."""
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.out / "workers.json", json.dumps({str(r): p for r, p in self.pids.items()}))

    def _replace(self, dead: list[int]) -> None:
        """Replace the workers at positions `dead` (a new process loaded with the driver's state), or
        drop them once max_restarts is spent."""
        state = read_state(self.tr)
        for pos in sorted(dead, reverse=True):
            rank = self.ranks[pos]
            del self.workers[pos], self.ranks[pos]
            self.pids.pop(rank, None)
            if self.restarts < self.d.max_restarts:
                self.restarts += 1
                w = self._add()
                self.ray.get(w.load_state.remote(state), timeout=START_TIMEOUT_S)
                self.pids[self.ranks[-1]] = self.ray.get(w.pid.remote())
                self.note(f"worker {rank} died; replaced by worker {self.ranks[-1]} "
                          f"({self.restarts}/{self.d.max_restarts} replacements)")
            else:
                self.note(f"worker {rank} died; no replacement left (max_restarts = {self.d.max_restarts}): "
                          f"{len(self.workers)} workers carry on")
        if not self.workers:
            raise ClusterError("every Ray worker died; the run stops here (resume it with --resume)")
        self._write_roster()

    def _gather(self, calls: list[tuple[int, Callable]]) -> tuple[dict[int, Any], list[int]]:
        """Run calls [(worker position, lambda worker: remote call)] and wait for all; returns the
        results by position (whatever the remote method returned, through ray.get) and the
        positions whose worker died."""
        refs = [(pos, make(self.workers[pos])) for pos, make in calls]
        results: dict[int, Any] = {}
        dead: list[int] = []
        for pos, ref in refs:
            try:
                results[pos] = self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                dead.append(pos)
        return results, dead

    def sync(self) -> None:
        """Load the driver's adapter and optimizer state into every worker (at the start, and after a
        resume)."""
        state = read_state(self.tr)
        _, dead = self._gather([(pos, lambda w: w.load_state.remote(state)) for pos in range(len(self.workers))])
        if dead:
            self._replace(dead)
        self.synced = True

    # ---- a training step ---------------------------------------------------------------------
    def train_step(self, micro: list, tally: Tally, hp: dict) -> float:
        """The step's gradient computed on the workers and summed into the driver's replica, the
        driver's AdamW step, then the same step on every worker. Returns the gradient norm; a
        non-finite loss or gradient raises native.NativeError (the trainer skips the step)."""
        if not self.synced:
            self.sync()
        t0 = time.monotonic()
        while True:
            shares = split_balanced([mb.batch.n_tokens for mb in micro], len(self.workers))
            calls = [(pos, lambda w, s=[micro[i] for i in share]: w.gradients.remote(s))
                     for pos, share in enumerate(shares) if share]
            results, dead = self._gather(calls)
            if not dead:
                break
            self._replace(dead)          # and compute the whole step again, split the same way
        gather_s = time.monotonic() - t0
        parts = [results[pos] for pos, _ in calls]
        for r in parts:
            tally.merge(r["tally"])
        failed = [r["failure"] for r in parts if r["failure"]]
        if failed:
            raise native.NativeError(native.STATUS_NONFINITE, failed[0])
        summed = [np.array(g, copy=True) for g in parts[0]["grads"]]
        for r in parts[1:]:
            for acc, g in zip(summed, r["grads"]):
                acc += g
        write_grads(self.tr, summed)
        gnorm = self.tr.optimizer_step(**hp)
        t1 = time.monotonic()
        ref = self.ray.put(summed)
        _, dead = self._gather([(pos, lambda w: w.apply.remote(ref, hp)) for pos in range(len(self.workers))])
        if dead:
            self._replace(dead)          # the replacements start from the driver's state after this step
        slowest = max(r["seconds"] for r in parts)
        self.timings = {"dist_compute_s": slowest,
                        "dist_comm_s": max(0.0, gather_s - slowest) + (time.monotonic() - t1),
                        "dist_grad_mb": sum(g.nbytes for g in summed) / 1e6,
                        **{f"dist_w{r['rank']}_s": r["seconds"] for r in parts},
                        **{f"dist_w{r['rank']}_peak_mib": r["peak_mib"] for r in parts}}
        step = int(hp["step"])
        if self.d.check_every and step % self.d.check_every == 0:
            self.check(step)
        return gnorm

    def check(self, step: int) -> None:
        """Every replica's adapter and optimizer state hash equals the driver's."""
        want = digest(self.tr)
        results, dead = self._gather([(pos, lambda w: w.digest.remote()) for pos in range(len(self.workers))])
        for pos, got in results.items():
            if got != want:
                raise ClusterError(f"after step {step}, worker {self.ranks[pos]}'s adapter differs from the driver's "
                                   f"(hash {got[:12]} vs {want[:12]}): the replicas drifted")
        if dead:
            self._replace(dead)
        log.info("step %d: %d replicas identical (%s)", step, len(results), want[:12])

    # ---- generation --------------------------------------------------------------------------
    def generate(self, key: tuple, version: int, adapter: list, calls: list[tuple[str, tuple]]) -> list:
        """Generator.<method>(*args) for each (method, args), one per worker, in order; a call whose
        worker died runs again on its replacement (the sampling is seeded, so it draws the same), or
        in a later round on a survivor when no replacement is left."""
        t0 = time.monotonic()
        results: dict[int, object] = {}
        todo = list(range(len(calls)))
        while todo:
            now = todo[:len(self.workers)]
            jobs = [(pos, lambda w, c=calls[i]: w.generate.remote(key, version, adapter, c[0], c[1]))
                    for pos, i in enumerate(now)]
            got, dead = self._gather(jobs)
            for pos, i in enumerate(now):
                if pos in got:
                    results[i] = got[pos]
            todo = [i for i in todo if i not in results]
            if dead:
                self._replace(dead)
        self.gen_s += time.monotonic() - t0
        return [results[i] for i in range(len(calls))]

    def step_timings(self) -> dict[str, float]:
        """What the workers did since the last call: the gradient step's compute and communication
        times (per worker too) and the time spent sampling on them; logged with the step."""
        out = {"dist_workers": float(len(self.workers)), **self.timings}
        if self.gen_s:
            out["dist_gen_s"] = self.gen_s
        self.timings, self.gen_s = {}, 0.0
        return out

    @property
    def size(self) -> int:
        return len(self.workers)

    def generator(self, path, *, n_ctx: int = 2048, n_seq: int = 1, threads: int | None = None,
                  device: str = "auto", kv_cells: int | None = None):
        """A generator with Generator's interface whose sampling runs on the workers (each sizes its
        own KV cache for its share of the sequences, so kv_cells is not passed on)."""
        return RemoteGenerator(self, path, n_ctx=n_ctx, n_seq=n_seq, device=device)

    def put(self, value):
        return self.ray.put(value)

    def close(self) -> None:
        for w in self.workers:
            try:
                self.ray.kill(w)
            except Exception:       # already gone
                pass
        self.workers = []
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()


@contextmanager
def workers_for(ctx: RunContext) -> Iterator[Cluster | None]:
    """The run's workers while the block runs, when [distributed].backend asks for them (None when
    it does not): the trainer is given them (Trainer's `cluster`)."""
    if ctx.cfg.distributed.backend != "ray":
        yield None
        return
    cluster = Cluster(ctx.cfg, ctx.trainable, ctx.out, ctx.notes.append)
    try:
        yield cluster
    finally:
        cluster.close()
