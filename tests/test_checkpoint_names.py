"""Checkpoint names are read in one place (retrograd.checkpoint) and the users of the names agree
with it: training's prune and latest, retrograd-server's RUN@... models and its list of saved
steps, export's --checkpoint. Directories only, no model."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrograd import checkpoint as ckpt
from retrograd.serve.openai_api import ApiError
from retrograd.serve.runs import RunStore
from retrograd.serve.server import split_ref


def states(d: Path, *names: str, adapter: bool = True) -> None:
    for n in names:
        (d / n).mkdir(parents=True)
        if adapter:
            (d / n / "adapter.gguf").write_bytes(b"GGUF")


def test_step_of_reads_only_step_directories():
    assert ckpt.step_of("step-12.state") == 12 and ckpt.step_of(Path("/x/step-007.state")) == 7
    for name in ("step-12", "best.state", "step-.state", "step-x.state", ".step-3.state.tmp", "step-\u00b2.state",
                 "step-1.gguf", "step--1.state"):
        assert ckpt.step_of(name) is None, name
    assert ckpt.step_of(ckpt.step_ref(40) + ".state") == 40


def test_step_states_sorts_by_number_and_skips_the_rest(tmp_path):
    states(tmp_path, "step-10.state", "step-9.state", "step-100.state", "step-x.state", "best.state",
           ".step-11.state.tmp", "step-\u00b2.state")
    assert [p.name for p in ckpt.step_states(tmp_path)] == ["step-9.state", "step-10.state", "step-100.state"]
    assert ckpt.step_states(tmp_path / "absent") == []


def test_latest_and_prune_follow_the_names(tmp_path):
    states(tmp_path, "step-2.state", "step-10.state", "step-x.state")
    (tmp_path / "step-2.gguf").write_bytes(b"GGUF")
    assert ckpt.latest(tmp_path).name == "step-10.state"        # by number, not by text
    (tmp_path / "latest").write_text("step-2.state\n")
    assert ckpt.latest(tmp_path).name == "step-2.state"         # the pointer wins while it names a directory
    ckpt.prune(tmp_path, keep=1)                                # the odd name neither breaks prune nor goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-10.state", "step-x.state"]


@pytest.mark.parametrize("ref, also, want", [
    ("best", (), "best"), ("latest", (), "latest"), ("step-3", (), "step-3"), ("step-007", (), "step-7"),
    ("final", (), None), ("final", ("final", "base"), "final"), ("base", ("final", "base"), "base"),
    ("step-", (), None), ("step-x", (), None), ("step-\u00b2", (), None), ("step-3.state", (), None),
    ("newest", (), None), ("", (), None)])
def test_parse_ref(ref, also, want):
    assert ckpt.parse_ref(ref, also) == want


def test_find(tmp_path):
    states(tmp_path, "step-4.state", "step-6.state", "best.state")
    assert ckpt.find(tmp_path, "step-4") == tmp_path / "step-4.state"
    assert ckpt.find(tmp_path, "best") == tmp_path / "best.state"
    assert ckpt.find(tmp_path, "latest") == tmp_path / "step-6.state"
    assert ckpt.find(tmp_path, "step-5") is None
    assert ckpt.find(tmp_path / "absent", "latest") is None


def test_the_servers_model_names(tmp_path):
    assert split_ref("r") == ("r", None)
    assert split_ref("r@final") == ("r", "final") and split_ref("r@base") == ("r", "base")
    assert split_ref("r@step-08") == ("r", "step-8") and split_ref("r@latest") == ("r", "latest")
    for bad in ("r@step-x", "r@step-\u00b2", "r@newest", "r@step-1.state"):
        with pytest.raises(ApiError) as err:
            split_ref(bad)
        assert err.value.status == 404 and "unknown weights" in err.value.message
    store = RunStore(tmp_path)
    cdir = store.checkpoints("r")
    states(cdir, "step-2.state", "step-12.state", "step-x.state", "best.state")
    states(cdir, "step-4.state", adapter=False)                 # not complete: not offered
    (cdir / "best.gguf").write_bytes(b"GGUF")
    assert store.steps("r") == [2, 12]
    assert store.adapter("r", "step-12") == cdir / "step-12.state" / "adapter.gguf"
    assert store.adapter("r", "latest") == cdir / "step-12.state" / "adapter.gguf"
    assert store.adapter("r", "best") == cdir / "best.gguf"
    assert store.adapter("r", "step-4") is None and store.adapter("r", "final") is None
