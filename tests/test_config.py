"""Configuration: defaults, path resolution, and one clear error per mistake (exit code 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retrograd.config import ConfigError, describe, load


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def test_defaults_and_relative_paths(tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    cfg = load(write(tmp_path, '[data]\ntrain = "d.jsonl"\n[training]\nlearning_rate = 1e-3\n'))
    assert cfg.data.train == tmp_path / "d.jsonl"
    assert cfg.training.learning_rate == 1e-3
    assert cfg.lora.rank == 16 and cfg.run.algorithm == "sft"
    assert cfg.to_dict()["data"]["train"] == str(tmp_path / "d.jsonl")


@pytest.mark.parametrize("text, message", [
    ("[trainig]\nepochs = 1\n", "unknown section [trainig]"),
    ('[run]\nalgorithm = "grpo"\n[training]\nneftune_alpha = 5.0\n', "neftune_alpha applies to sft only"),
    ('[lora]\nscaling = "dora"\n', "scaling"),
    ("[training]\nepoch = 1\n", "unknown key [training].epoch"),
    ('[training]\nbatch_size = "8"\n', "[training].batch_size: expected an integer, got '8'"),
    ("[training]\nlearning_rate = -1.0\n", "[training].learning_rate: must be >= 0.0"),
    ('[lora]\ntargets = ["q", "x"]\n', "[lora].targets: expected some of"),
    ('[run]\nalgorithm = "dpo"\n', "[run].algorithm: expected one of"),
    ("[training\n", "not valid TOML"),
    ("[lora]\ndropout = 0.95\n", "[lora].dropout: must be <= 0.9"),
])
def test_errors_name_file_and_key(tmp_path, text, message):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load(p)
    assert message in str(exc.value)
    assert str(p) in str(exc.value)


def test_cli_reports_config_errors_with_exit_code_2(tmp_path):
    p = write(tmp_path, '[data]\ntrain = "missing.jsonl"\n')
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "train", str(p)], capture_output=True, text=True)
    assert out.returncode == 2
    assert "[data].train: file not found" in out.stderr and "missing.jsonl" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "retrograd.cli", "train", str(tmp_path / "nope.toml")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no such configuration file" in out.stderr


def test_describe_lists_every_section():
    text = describe()
    for section in ("[model]", "[lora]", "[run]", "[data]", "[training]", "[checkpoint]", "[evaluation]"):
        assert section in text
