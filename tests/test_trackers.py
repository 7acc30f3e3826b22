"""[run].report_to with the real tracker libraries, offline: a short SFT run on the tiny model is
read back with TensorBoard's event reader, MLflow's client, the W&B offline run file and trackio's
store; a resumed run continues the same tracker runs without logging a step twice; a tracker that
breaks mid-run costs a warning and a counted error, not the run."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer import make_run

from retrograd.config import ConfigError, load
from retrograd.context import open_model
from retrograd.trackers import STATE_FILE
from retrograd.trainer import RunStopped, train

ALL = '["tensorboard", "mlflow", "wandb", "trackio"]'


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker local: W&B offline, trackio's store and MLflow's default in tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    import trackio.utils
    monkeypatch.setattr(trackio.utils, "TRACKIO_DIR", tmp_path / "trackio")
    return tmp_path


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def series(recs: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in recs if key in r]


def tensorboard_scalars(run: Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def mlflow_history(run: Path, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    st = json.loads((run / STATE_FILE).read_text())["runs"]["mlflow"]
    client = MlflowClient(st["tracking_uri"])
    return sorted((m.step, m.value) for m in client.get_metric_history(st["run_id"], key))


def wandb_history(run: Path) -> list[dict]:
    """The history rows of every W&B offline run file under RUN/wandb (the transaction log: a
    7-byte file header, then 32 KiB blocks of records with 7-byte headers, each a protobuf Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, chunks = 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:            # block trailer too short for a header: padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack_from("<IHB", data, pos)
            pos += 7
            chunks += data[pos:pos + length]
            pos += length
            if kind in (1, 4):                     # FULL or LAST: a whole record
                rec = pb.Record()
                rec.ParseFromString(chunks)
                chunks = b""
                if rec.HasField("history"):
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif kind == 0:
                break
    return rows


def trackio_steps(state: dict, key: str) -> list[tuple[int, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(state["project"], state["name"])
    return sorted((r["step"], r[key]) for r in logs if key in r)


def close(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(abs(x - y) <= 1e-5 * max(1, abs(y)) for (_, x), (_, y) in
                                                           zip(a, b))


def test_report_to_is_checked(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nreport_to = ["tensorboard", "neptune"]\n')
    with pytest.raises(ConfigError, match=r"\[run\].report_to: expected distinct entries of tensorboard"):
        load(cfg)
    cfg.write_text('[run]\nreport_to = ["mlflow", "mlflow"]\n')
    with pytest.raises(ConfigError, match="report_to"):
        load(cfg)


def test_missing_package_names_the_extra(tiny, tmp_path):
    """With the package unimportable (sys.modules[name] = None, Python's own way to say so) train stops
    before it loads anything, in one line that names the extra."""
    cfg = make_run(tmp_path, tiny("llama"), steps=2)
    text = cfg.read_text().replace('name = "t"', 'name = "t"\nreport_to = ["mlflow"]')
    cfg.write_text(text)
    code = ("import sys; sys.modules['mlflow'] = None; from retrograd.cli import main; "
            f"sys.exit(main(['train', {str(cfg)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f'error: {cfg}: [run].report_to: "mlflow" needs the mlflow package, which is not installed: '
        'pip install "retrograd[mlflow]"']
    assert not (tmp_path / "runs" / "t" / "metrics.jsonl").exists()


def _config(tmp_path: Path, tiny, steps: int = 4, every: int = 2) -> Path:
    cfg = make_run(tmp_path, tiny("llama"), steps=steps, every=every)
    cfg.write_text(cfg.read_text().replace('name = "t"', f'name = "t"\nreport_to = {ALL}'))
    return cfg


def test_every_tracker_gets_the_metrics_config_and_adapter(tiny, offline):
    cfg = load(_config(offline, tiny))
    summary = train(open_model(cfg))
    run = offline / "runs" / "t"
    recs = records(run)
    assert summary["tracker_errors"] == 0
    loss, eval_loss = series(recs, "loss"), series(recs, "eval_loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4] and [s for s, _ in eval_loss][:3] == [0, 2, 4]
    # TensorBoard: scalars at the same steps, the configuration as hparams
    assert close(tensorboard_scalars(run, "loss"), loss)
    assert close(tensorboard_scalars(run, "grad_norm"), series(recs, "grad_norm"))
    assert [s for s, _ in tensorboard_scalars(run, "eval_loss")] == [s for s, _ in eval_loss]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    from tensorboard.plugins.hparams import plugin_data_pb2
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["lora.rank"].number_value == 4 and hp["run.algorithm"].string_value == "sft"
    # MLflow: metric history, parameters, the adapter as an artifact, the run finished
    assert close(mlflow_history(run, "loss"), loss)
    from mlflow.tracking import MlflowClient
    st = json.loads((run / STATE_FILE).read_text())["runs"]
    client = MlflowClient(st["mlflow"]["tracking_uri"])
    mrun = client.get_run(st["mlflow"]["run_id"])
    assert mrun.data.params["lora.rank"] == "4" and mrun.info.status == "FINISHED"
    assert st["mlflow"]["tracking_uri"] == (run / "mlruns").resolve().as_uri()
    assert "adapter.gguf" in [a.path for a in client.list_artifacts(mrun.info.run_id)]
    # W&B offline: the run file holds the same history
    rows = wandb_history(run)
    wl = sorted((r["_step"], r["loss"]) for r in rows if "loss" in r)
    assert close(wl, loss)
    assert st["wandb"]["mode"] == "offline" and list((run / "wandb").glob(f"offline-run-*-{st['wandb']['id']}"))
    # trackio: its local store
    assert close(trackio_steps(st["trackio"], "loss"), loss)


def test_resume_continues_the_same_runs_without_duplicates(tiny, offline):
    """Stop at step 3, resume from the step-2 checkpoint: step 3 is redone by the trainer but every
    tracker has it once, in the same tracker run."""
    cfg = load(_config(offline, tiny))
    with pytest.raises(RunStopped):
        train(open_model(cfg), on_step=lambda done: done.step == 3)
    run = offline / "runs" / "t"
    first = json.loads((run / STATE_FILE).read_text())
    assert [s for s, _ in tensorboard_scalars(run, "loss")] == [1, 2, 3]
    assert (run / "checkpoints" / "step-2.state").is_dir()
    summary = train(open_model(load(_config(offline, tiny))), resume=run / "checkpoints" / "step-2.state")
    assert summary["steps"] == 4 and summary["tracker_errors"] == 0
    second = json.loads((run / STATE_FILE).read_text())
    for name in ("mlflow", "wandb", "trackio"):
        assert {k: v for k, v in second["runs"][name].items() if k != "dir"} == \
            {k: v for k, v in first["runs"][name].items() if k != "dir"}, name
    loss = series(records(run), "loss")
    assert [s for s, _ in loss] == [1, 2, 3, 4]
    assert close(tensorboard_scalars(run, "loss"), loss)
    assert close(mlflow_history(run, "loss"), loss)
    assert close(trackio_steps(second["runs"]["trackio"], "loss"), loss)
    wl = sorted((r["_step"], r["loss"]) for r in wandb_history(run) if "loss" in r)
    assert close(wl, loss)


def test_a_tracker_that_breaks_mid_run_is_counted_not_fatal(tiny, offline):
    """MLflow's run directory disappears after step 2 (a store gone): the run finishes, MLflow's
    failures are counted and warned about, TensorBoard still has every step."""
    cfg = make_run(offline, tiny("llama"), steps=4, every=2)
    cfg.write_text(cfg.read_text().replace('name = "t"', 'name = "t"\nreport_to = ["tensorboard", "mlflow"]'))
    run = offline / "runs" / "t"

    def break_mlflow(done) -> bool:
        if done.step == 2:
            st = json.loads((run / STATE_FILE).read_text())["runs"]["mlflow"]
            for d in (run / "mlruns").glob(f"*/{st['run_id']}"):
                shutil.rmtree(d)
        return False

    summary = train(open_model(load(cfg)), on_step=break_mlflow)
    assert summary["steps"] == 4 and summary["tracker_errors"] >= 1
    assert json.loads((run / STATE_FILE).read_text())["errors"]["mlflow"] >= 1
    assert [s for s, _ in tensorboard_scalars(run, "loss")] == [1, 2, 3, 4]
    assert (run / "adapter.gguf").exists()


def test_wandb_is_offline_without_a_key(monkeypatch, tmp_path):
    from retrograd.trackers import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))            # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"
    assert os.environ["WANDB_MODE"] == "disabled"
