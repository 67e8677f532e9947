"""The entry point torchrun starts (`python -m scaletrain`): a rank of a distributed verb
leaves with os._exit after the verb returns, with its exit code and its output flushed; other
verbs and single-process runs exit the normal way. The whole torchrun path (2 ranks training
and writing metrics) is tests/plan/search/distributed/test_plan_commands.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(world: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": world, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONUNBUFFERED", None)  # stdout block-buffered, as in a torchrun rank's pipe
    return subprocess.run([sys.executable, "-m", "scaletrain", *argv], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("world", ["1", "2"])
def test_exit_code_and_output_survive_the_hard_exit(world: str) -> None:
    res = _run(world, "train", "--no-such.flag", "1")
    assert res.returncode == 2
    assert "no-such" in res.stderr  # written before os._exit, and flushed


def test_buffered_stdout_survives_the_hard_exit() -> None:
    res = _run("2", "train", "--dry-run", "--training.device", "cpu")  # stdout is a pipe
    assert res.returncode == 0, res.stderr
    assert "layout:" in res.stdout and "memory (most loaded rank)" in res.stdout


def test_other_verbs_exit_normally() -> None:
    res = _run("2", "models")
    assert res.returncode == 0 and "llama3.2-1b" in res.stdout
