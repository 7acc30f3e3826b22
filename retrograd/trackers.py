"""Experiment trackers (`[run].report_to`): every record the trainer appends to metrics.jsonl is
forwarded, as it is written and at the same step, to TensorBoard, MLflow, Weights & Biases and
trackio; the resolved configuration goes in as parameters (hparams), the final adapter (and
merged.gguf) as artifacts where the tracker has them.

Local by default: TensorBoard event files in RUN/tensorboard/, MLflow's file store in RUN/mlruns/
unless MLFLOW_TRACKING_URI names another, W&B in RUN/wandb/ in the mode WANDB_MODE says (offline
when it is unset and no API key is configured), trackio in its own local store.

Resume: RUN/trackers.json keeps each tracker's run id and how many records of metrics.jsonl were
forwarded. A resumed run reopens the same tracker runs and skips the records they already have
(the trainer redoes the steps after the checkpoint with the same results), so no step is logged
twice. A tracker that fails (disk full, server gone) costs a warning and a counted error, never the
training run; after MAX_FAILURES errors it is dropped for the rest of the run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import netrc
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrograd.errors import ConfigError
from retrograd.fsutil import atomic_write
from retrograd.sections import TRACKERS

STATE_FILE = "trackers.json"
MAX_FAILURES = 3
#: tracker -> (the module it needs, the extra that installs it)
NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb"),
         "trackio": ("trackio", "trackio")}
assert set(NEEDS) == set(TRACKERS)


def check_installed(names: list[str], label: str = "<config>") -> None:
    """Each tracker's package is importable, else one line naming the extra that installs it."""
    for name in names:
        module, extra = NEEDS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f'{label}: [run].report_to: "{name}" needs the {module} package, which is not '
                              f'installed: pip install "retrograd[{extra}]"')


def scalars(record: dict) -> dict[str, float]:
    """The numeric metrics of a metrics.jsonl record (not its step, time or flags)."""
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


def flat_config(cfg: dict, prefix: str = "") -> dict[str, Any]:
    """{"lora.rank": 16, ...}: nested sections flattened, lists as JSON text."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


class TensorBoard:
    """Scalars, the configuration as hparams and as text, written with tensorboard's own event writer."""

    name = "tensorboard"

    def __init__(self, out: Path, run_name: str, config: dict, state: dict | None) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self.dir = out / "tensorboard"
        self.writer = EventFileWriter(str(self.dir))
        self.state = {"dir": str(self.dir)}
        if state is None:
            self._write(0, self._hparams(config))
            self._write(0, self._text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```"))
        self.writer.flush()

    def _write(self, step: int, summary) -> None:
        self.writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def _hparams(self, config: dict):
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.plugins.hparams import plugin_data_pb2

        info = plugin_data_pb2.SessionStartInfo()
        for k, v in flat_config(config).items():
            if isinstance(v, bool):
                info.hparams[k].bool_value = v
            elif isinstance(v, (int, float)):
                info.hparams[k].number_value = float(v)
            else:
                info.hparams[k].string_value = str(v)
        content = plugin_data_pb2.HParamsPluginData(session_start_info=info, version=0).SerializeToString()
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content))
        return self._summary(value=[self._summary.Value(tag="_hparams_/session_start_info", metadata=meta)])

    def _text(self, tag: str, text: str):
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        tensor = TensorProto(dtype=7, string_val=[text.encode()],      # 7: DT_STRING
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        return self._summary(value=[self._summary.Value(tag=tag, metadata=meta, tensor=tensor)])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]))
        self.writer.flush()

    def artifact(self, path: Path) -> None:
        """TensorBoard has no artifacts: the file's path goes in as text."""
        self._write(0, self._text(f"artifacts/{path.name}", str(path)))

    def finish(self, ok: bool) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run through its client: metrics, parameters, artifacts; the store in RUN/mlruns
    unless MLFLOW_TRACKING_URI names another, the experiment MLFLOW_EXPERIMENT_NAME or the run's name."""

    name = "mlflow"

    def __init__(self, out: Path, run_name: str, config: dict, state: dict | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:         # MLflow 3 keeps its file store in "maintenance mode" and refuses it unless asked
            uri = (out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if state:
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run_name
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(exp_name)
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags={"retrograd": "1"}).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items()]
            for i in range(0, len(params), 100):                    # MLflow takes 100 parameters a call
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.state = {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(k), v, ts, step) for k, v in metrics.items()])

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _mlflow_key(k: str) -> str:
    return re.sub(r"[^\w\-. /]", "_", k)


def wandb_mode() -> str:
    """WANDB_MODE when set; otherwise online only when an API key is configured (WANDB_API_KEY or
    ~/.netrc), so a run never waits on a login prompt or a network."""
    mode = os.environ.get("WANDB_MODE", "").strip()
    if mode:
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandB:
    """A W&B run (project WANDB_PROJECT, default "retrograd"), its files in RUN/wandb unless WANDB_DIR."""

    name = "wandb"

    def __init__(self, out: Path, run_name: str, config: dict, state: dict | None) -> None:
        import wandb

        run_id = state["id"] if state else secrets.token_hex(4)
        kw: dict[str, Any] = {} if os.environ.get("WANDB_DIR") else {"dir": str(out)}
        self.mode = wandb_mode()
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "retrograd", name=run_name, id=run_id,
                              # WANDB_MODE as the user wrote it: wandb checks it, its stubs list today's modes
                              resume="allow", config=config, mode=self.mode, reinit=True,  # type: ignore[arg-type]
                              settings=wandb.Settings(console="off", silent=True), **kw)
        self.state = {"id": run_id, "mode": self.mode, "dir": str(self.run.dir)}
        self._wandb = wandb
        self._run_name = run_name

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def artifact(self, path: Path) -> None:
        name = re.sub(r"[^\w\-.]", "-", f"{self._run_name}-{path.stem}")
        art = self._wandb.Artifact(name, type="model")
        art.add_file(str(path))
        self.run.log_artifact(art)

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class Trackio:
    """A trackio run in its local store (project TRACKIO_PROJECT, default "retrograd")."""

    name = "trackio"

    def __init__(self, out: Path, run_name: str, config: dict, state: dict | None) -> None:
        import trackio

        name = state["name"] if state else f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        project = os.environ.get("TRACKIO_PROJECT") or "retrograd"
        with contextlib.redirect_stdout(sys.stderr):       # its notes, not the command's output
            self.run = trackio.init(project=project, name=name, config=flat_config(config),
                                    resume="must" if state else "never")
        self._trackio = trackio
        self.state = {"name": name, "project": project}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def artifact(self, path: Path) -> None:
        """trackio has no artifacts: the file's path goes in the run's configuration."""

    def finish(self, ok: bool) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.run.finish()


KINDS: dict[str, type] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB, "trackio": Trackio}


class Trackers:
    """The trackers of a run, fed by MetricsLog.append (`__call__`). `already` is how many records
    metrics.jsonl holds now (after a resume's truncation)."""

    def __init__(self, names: list[str], out: Path, run_name: str, config: dict, *, resume: bool, already: int = 0,
                 warn: Callable[[str], None] = print) -> None:
        self.out, self.warn = Path(out), warn
        self.path = self.out / STATE_FILE
        old = _read_state(self.path) if resume else {}
        self.forwarded = int(old.get("forwarded", 0))
        self.seen = already
        self.errors: dict[str, int] = {n: int(v) for n, v in old.get("errors", {}).items()}
        self.dropped: dict[str, int] = {}
        self.runs: dict[str, dict] = dict(old.get("runs", {}))
        self.active: list = []
        for name in names:
            t = self._guard(name, "start", functools.partial(KINDS[name], self.out, run_name, config,
                                                             self.runs.get(name)))
            if t is not None:
                self.active.append(t)
                self.runs[name] = t.state
        self._save()

    def _guard(self, name: str, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:        # a tracker never stops the training run
            self.errors[name] = self.errors.get(name, 0) + 1
            first = self.errors[name] == 1
            dropped = what == "start" or self.errors[name] >= MAX_FAILURES
            if first or dropped:
                more = "; it is dropped for the rest of the run" if dropped else ""
                self.warn(f"warning: tracker {name}: {what} failed ({type(exc).__name__}: {exc}){more}")
            if dropped:
                self.active = [t for t in self.active if t.name != name]
                self.dropped[name] = 1
            return None

    def __call__(self, record: dict) -> None:
        index, self.seen = self.seen, self.seen + 1
        if index < self.forwarded:      # resumed: the tracker runs have this record already
            return
        metrics = scalars(record)
        step = int(record.get("step", 0))
        if metrics:
            for t in list(self.active):
                self._guard(t.name, f"log at step {step}", functools.partial(t.log, step, metrics))
        self.forwarded = self.seen
        self._save()

    def artifacts(self, paths: list[Path]) -> None:
        for p in paths:
            if Path(p).is_file():
                for t in list(self.active):
                    self._guard(t.name, f"artifact {Path(p).name}", functools.partial(t.artifact, Path(p)))

    def finish(self, ok: bool = True) -> int:
        """Close every tracker run; returns the number of tracker errors in the run (resumes included)."""
        for t in list(self.active):
            self._guard(t.name, "finish", functools.partial(t.finish, ok))
        self.active = []
        self._save()
        return sum(self.errors.values())

    def _save(self) -> None:
        try:
            atomic_write(self.path, json.dumps({"forwarded": self.forwarded, "runs": self.runs, "errors": self.errors},
                                               indent=2, sort_keys=True))
        except OSError as exc:
            self.warn(f"warning: trackers: cannot write {self.path}: {exc}")


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
