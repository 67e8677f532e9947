"""Out of memory is one message, not a traceback: an absurd micro-batch stops before set-up
with exit code 3, the planned peak, the memory and the cheapest change that fits; a step that
runs out anyway ends the same way; the dry run's advice halves the micro-batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.commands._memory_fit import (
    check_before_setup,
    is_out_of_memory,
    training_plan,
)
from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.layout import Layout
from tests.helpers.trainer import tiny_argv, tiny_config

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
HUGE_MBS = str(2**20)  # ~40 TiB of activations for the debug model: no host has that


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oom-cache")


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_absurd_micro_batch_stops_before_setup(tmp_path: Path) -> None:
    """As a user runs it (a subprocess): exit 3, one line, nothing written, no data prepared."""
    out = tmp_path / "run"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "scaletrain", "train", "--output", str(out),
         "--data.cache_dir", str(tmp_path / "cache"), "--training.micro_batch_size", HUGE_MBS],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    assert proc.returncode == 3, proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith("scaletrain train: this run needs an estimated ")
    assert "it would run out of memory" in line and "--training.skip_memory_check true" in line
    assert "the cheapest change that fits: --training.micro_batch_size " in line
    assert not out.exists() and not (tmp_path / "cache").exists()
    print(f"refused in {wall:.2f} s (process start included)")


def test_the_advised_change_is_one_the_check_accepts(tmp_path: Path, cache: Path) -> None:
    """The change the message names fits by the same check (and the config accepts it)."""
    import re

    from scaletrain.commands._memory_fit import RunOutOfMemory, available_bytes
    from scaletrain.config import load_config

    argv = ["--output", str(tmp_path / "run"), "--training.micro_batch_size", HUGE_MBS]
    cfg = load_config(argv)
    device = torch.device("cpu")
    with pytest.raises(RunOutOfMemory) as caught:
        check_before_setup(training_plan(cfg), device, skip=False)
    flags = re.search(r"fits: (--training\.micro_batch_size \d+ --training\.grad_accum_steps "
                      r"\d+)", str(caught.value))
    assert flags, caught.value
    fixed = load_config(argv + flags.group(1).split())
    plan = training_plan(fixed)()
    assert plan.peak_bytes <= available_bytes(device)[0]
    assert plan.layout.gbs == training_plan(cfg)().layout.gbs  # the same global batch
    check_before_setup(training_plan(fixed), device, skip=False)  # passes
    check_before_setup(training_plan(cfg), device, skip=True)  # the override


def test_a_step_that_runs_out_is_one_message(tmp_path: Path, cache: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    """A real allocator failure inside a training step (1 PiB asked of the CPU allocator, which
    fails at once) -> exit 3, one line naming the plan's peak, the memory and a change."""
    from scaletrain.train.trainer import Trainer

    def step_that_runs_out(self, batches, heartbeat):  # noqa: ANN001, ANN202
        return torch.empty(2**48, dtype=torch.float32)  # 2^50 bytes

    monkeypatch.setattr(Trainer, "_guarded_step", step_that_runs_out)
    capfd.readouterr()
    rc = main(["train", *tiny_argv(tmp_path / "run", cache)])
    line = _one_line(capfd.readouterr().err)
    assert rc == 3
    assert line.startswith("scaletrain train: out of memory (the allocator was asked for "
                           "1125899906842624 bytes): the plan estimates a peak of ")
    assert "available host RAM is" in line
    # The plan says the tiny run fits: the advice must cut its peak by a quarter at least.
    assert "the estimate is below it" in line
    assert ("the cheapest change that lowers the planned peak by a quarter of what the layout "
            "decides: --") in line
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


def test_out_of_memory_errors_are_recognized() -> None:
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**48, dtype=torch.float32)
    assert is_out_of_memory(cpu.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape '[2, 3]' is invalid for input of size 5"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_a_run_that_fits_is_not_stopped(tmp_path: Path, cache: Path) -> None:
    cfg = tiny_config(tmp_path / "run", cache)
    check_before_setup(training_plan(cfg), torch.device("cpu"), skip=False)


def test_advice_halves_the_micro_batch_down_to_what_fits() -> None:
    """A layout over budget by 4x in activations: the advice keeps the global batch and names
    the largest micro-batch that fits, with the accumulation that keeps GBS."""
    from scaletrain.plan.search.advice import advice_lines, advise

    args = get_preset("llama3.2-1b")
    lay = Layout(dims=ParallelDims(), mbs=64, seq_len=2048, gbs=128, precision="bf16")
    plan = estimate(args, lay)
    smaller = {m: estimate(args, lay.replace(mbs=m)).peak_bytes for m in (32, 16, 8, 4, 2, 1)}
    budget = (smaller[8] + smaller[16]) / 2  # 8 fits, 16 does not
    assert plan.peak_bytes > budget
    found = advise(plan, budget, limit=50)
    micro = [a for a in found if a.change.startswith("--training.micro_batch_size")]
    assert [a.change for a in micro] == ["--training.micro_batch_size 8 "
                                         "--training.grad_accum_steps 16"]
    assert micro[0].plan.layout.gbs == 128 and micro[0].plan.peak_bytes <= budget
    assert any("--training.micro_batch_size 8" in line for line in advice_lines(plan, budget))


def test_dry_run_advises_a_smaller_micro_batch(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    rc = main(["train", "--dry-run", "--output", str(tmp_path / "run"),
               "--training.micro_batch_size", HUGE_MBS])
    out = capsys.readouterr().out
    assert rc == 3
    assert "DOES NOT FIT" in out
    assert "--training.micro_batch_size" in out.split("DOES NOT FIT", 1)[1], out
    rc = main(["train", "--dry-run", "--json", "--output", str(tmp_path / "run"),
               "--training.micro_batch_size", HUGE_MBS])
    assert rc == 3 and json.loads(capsys.readouterr().out)["memory_bytes"]["peak"] > 1000 * GIB


def test_finetune_stops_before_setup_too(tmp_path: Path,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    from tests.helpers.finetune import qa_records, write_jsonl
    from tests.helpers.synth import tiny_checkpoint

    base = tiny_checkpoint(tmp_path / "base")
    data = write_jsonl(tmp_path / "sft.jsonl", qa_records(8))
    out = tmp_path / "ft"
    capfd.readouterr()
    rc = main(["finetune", "--base", str(base), "--data", str(data), "--output", str(out),
               "--training.micro_batch_size", HUGE_MBS, "--data.seq_len", "128",
               "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 3, line
    assert line.startswith("scaletrain finetune: this run needs an estimated ")
    assert "--training.micro_batch_size" in line.split("cheapest change that fits: ")[1]
    assert not out.exists()
