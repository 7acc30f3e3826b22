"""Checkpoints: `step-N.state/` directories holding everything a run needs to continue exactly
where it stopped: the adapter (llama.cpp GGUF), the AdamW moments, the step, the recipe's state
(data position, rollout counters, a batch of rollouts between its updates; every random draw is
derived from the run seed and these counters, so no RNG state is stored) and the resolved
configuration. Each is written under a temporary name and renamed, so a kill at any moment leaves
the previous checkpoint intact; `latest` names the newest, `best.state` the best by the configured
metric, and the adapter is also exported beside each directory (`step-N.gguf`).

The names are read here and nowhere else: `step_of` parses a step-N.state directory, `step_states`
lists them in step order, `parse_ref` reads a checkpoint as a user names it (best, latest, step-N;
retrograd-server's RUN@... models add final and base) and `find` resolves one to its directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from retrograd import adapter as adapter_io
from retrograd import native
from retrograd.errors import RetrogradError
from retrograd.fsutil import atomic_copy, atomic_open, atomic_write, fsync_tree, replace_dir

STATE_VERSION = 1
_STEP = re.compile(r"step-([0-9]+)")      # ASCII digits only: int() must read what matched


def step_ref(step: int) -> str:
    """How checkpoint `step` is named: step-N (its directory is step-N.state, its adapter step-N.gguf)."""
    return f"step-{step}"


def step_of(path: Path | str) -> int | None:
    """N for a step-N.state directory (a path or a name), None for anything else."""
    name = Path(path).name
    m = _STEP.fullmatch(name.removesuffix(".state")) if name.endswith(".state") else None
    return int(m.group(1)) if m else None


def step_states(directory: Path) -> list[Path]:
    """The step-N.state directories in `directory`, the earliest step first (none when it does not exist)."""
    found = [(step_of(p), p) for p in Path(directory).glob("step-*.state")]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None)]


def parse_ref(ref: str, also: tuple[str, ...] = ()) -> str | None:
    """A checkpoint as a user names it: best, latest or step-N (step-007 reads as step-7), or one of
    the names in `also` the caller knows (retrograd-server: final, base); None for anything else."""
    if ref in ("best", "latest") or ref in also:
        return ref
    m = _STEP.fullmatch(ref)
    return step_ref(int(m.group(1))) if m else None


def find(directory: Path, ref: str) -> Path | None:
    """The .state directory that best, latest or step-N (as parse_ref returns it) names in `directory`,
    or None when there is none."""
    directory = Path(directory)
    state = latest(directory) if ref == "latest" else directory / f"{ref}.state"
    return state if state is not None and state.is_dir() else None


class CheckpointError(RetrogradError, ValueError):
    pass


def _write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True))


def model_identity(trainable) -> dict:
    info = trainable.info
    st = os.stat(trainable.model_path)
    return {"path": str(trainable.model_path), "size": st.st_size, "arch": info.arch,
            "n_layer": info.n_layer, "n_embd": info.n_embd, "n_vocab": info.n_vocab}


def lora_identity(trainable) -> dict:
    s = trainable.spec
    return {"rank": s.rank, "alpha": s.alpha, "targets": list(s.targets), "scaling": s.scaling, "variant": s.variant}


def save(directory: Path, step: int, trainable, trainer_state: dict, config: dict) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{step_ref(step)}.state"
    tmp = directory / f".{step_ref(step)}.state.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    data = trainable.adapter_bytes()
    adapter_io.write(tmp / "adapter.gguf", data)
    lora = trainable.lora
    with atomic_open(tmp / "optimizer.npz") as fh:
        np.savez(fh, **{f"m:{t.name}": lora.read(t.index, native.SLOT_ADAM_M) for t in lora.tensors},
                 **{f"v:{t.name}": lora.read(t.index, native.SLOT_ADAM_V) for t in lora.tensors})
    _write_json(tmp / "state.json", {"version": STATE_VERSION, "step": step, "model": model_identity(trainable),
                                     "lora": lora_identity(trainable), "trainer": trainer_state})
    _write_json(tmp / "config.json", config)
    fsync_tree(tmp)
    replace_dir(tmp, final)
    adapter_io.write(directory / f"{step_ref(step)}.gguf", data)
    atomic_write(directory / "latest", final.name + "\n")
    return final


def mark_best(directory: Path, state_dir: Path) -> Path:
    """Copy a checkpoint to best.state (atomically) and export its adapter as best.gguf."""
    directory = Path(directory)
    tmp = directory / ".best.state.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(state_dir, tmp)
    fsync_tree(tmp)
    replace_dir(tmp, directory / "best.state")
    atomic_copy(state_dir / "adapter.gguf", directory / "best.gguf")
    return directory / "best.state"


def prune(directory: Path, keep: int) -> None:
    states = step_states(directory)
    for p in states[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
        gguf = p.with_suffix(".gguf")
        if gguf.exists():
            gguf.unlink()


def latest(directory: Path) -> Path | None:
    directory = Path(directory)
    pointer = directory / "latest"
    if pointer.exists():
        p = directory / pointer.read_text().strip()
        if p.is_dir():
            return p
    states = step_states(directory)
    return states[-1] if states else None


def adapter_of(state_dir: Path) -> Path:
    """The adapter exported for a .state directory (serve/chat --checkpoint)."""
    state_dir = Path(state_dir)
    inside = state_dir / "adapter.gguf"
    if not inside.exists():
        raise CheckpointError(f"{state_dir}: not a checkpoint (no adapter.gguf inside)")
    return inside


def load(state_dir: Path, trainable) -> dict:
    """Restore adapter and moments into `trainable`; returns the trainer state. Refuses checkpoints
    of another model or an incompatible LoRA configuration, saying which."""
    state_dir = Path(state_dir)
    try:
        meta = json.loads((state_dir / "state.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{state_dir}: not a checkpoint (no state.json)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{state_dir}/state.json is corrupt: {exc}") from None
    want, have = meta.get("model", {}), model_identity(trainable)
    for key in ("arch", "n_layer", "n_embd", "n_vocab", "size"):
        if want.get(key) != have.get(key):
            raise CheckpointError(f"{state_dir}: checkpoint is for another model ({key} {want.get(key)!r} in the "
                                  f"checkpoint, {have.get(key)!r} for {have['path']})")
    want_l, have_l = meta.get("lora", {}), lora_identity(trainable)
    want_l.setdefault("scaling", "standard")        # checkpoints from before [lora].scaling
    want_l.setdefault("variant", "lora")            # ... and before [lora].variant
    for key in ("rank", "alpha", "targets", "scaling", "variant"):
        if want_l.get(key) != have_l.get(key):
            raise CheckpointError(f"{state_dir}: incompatible [lora].{key}: checkpoint has {want_l.get(key)!r}, "
                                  f"the configuration {have_l.get(key)!r}")
    trainable.load_adapter(state_dir / "adapter.gguf")
    moments = np.load(state_dir / "optimizer.npz")
    lora = trainable.lora
    for t in lora.tensors:
        lora.write(t.index, moments[f"m:{t.name}"], native.SLOT_ADAM_M)
        lora.write(t.index, moments[f"v:{t.name}"], native.SLOT_ADAM_V)
    lora.zero(native.SLOT_GRAD)
    return meta["trainer"] | {"step": meta["step"]}


# what a finished or interrupted run leaves in its run directory and in its checkpoint directory
RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "adapter.gguf", "merged.gguf", "trackers.json", "tensorboard")
CHECKPOINT_GLOBS = ("step-*.state", "step-*.gguf", "best.state", "best.gguf", "latest")


def set_aside_previous_run(out: Path, directory: Path) -> Path | None:
    """Before a fresh (not resumed) run: move what an earlier run left in `out` and its checkpoint
    `directory` into `out/previous/<n>/`, and return that folder (None when there was nothing).
    Left in place, the earlier run's metrics would be appended to, its checkpoints at higher steps
    would make `prune` delete the new run's and `--resume` continue the old run, and its adapter
    would look like this run's until overwritten."""
    out, directory = Path(out), Path(directory)
    files = [out / name for name in RUN_FILES if (out / name).exists()]
    states = [p for g in CHECKPOINT_GLOBS for p in sorted(directory.glob(g))] if directory.is_dir() else []
    if not (out / "metrics.jsonl").exists() and not any(p.name.startswith("step-") for p in states):
        return None
    root = out / "previous"
    n = 1 + max((int(p.name) for p in root.glob("*") if p.name.isdigit()), default=0) if root.is_dir() else 1
    dest = root / str(n)
    dest.mkdir(parents=True)
    if states:
        (dest / "checkpoints").mkdir()
    for p in files:
        shutil.move(str(p), str(dest / p.name))
    for p in states:
        shutil.move(str(p), str(dest / "checkpoints" / p.name))
    return dest
