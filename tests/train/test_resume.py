"""Resume by default, consistently (one process; the torchrun cases are in
tests/train/distributed/test_resilience.py):

- `checkpoint.resume auto` continues from the newest complete checkpoint, skips a damaged one,
  and starts fresh when there is none; a finished run started again trains nothing;
- a preemption signal stops the run at the next step with a checkpoint and exit 75, and the
  rerun equals the uninterrupted run;
- a resume that would change the data order, the global batch, the learning rate of a step
  both schedules share (a finished decaying schedule extended included) or the update
  (optimizer, clipping, precision) is refused with exit 2 and one line, before the data or
  model are built, and writes nothing; the overrides continue as asked; a checkpoint of another
  model is named once, for the newest checkpoint;
- background (async) checkpoints equal synchronous ones file for file, and a process killed
  while one is written leaves the previous checkpoint to resume from.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scaletrain.cli import main
from scaletrain.train.preemption import EXIT_PREEMPTED
from scaletrain.train.trainer import Trainer
from tests.helpers.proc import scaled
from tests.helpers.trainer import tiny_argv

ROOT = Path(__file__).resolve().parents[2]
BASE = ("--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_last", "3")


def train(out: Path, cache: Path, *extra: str) -> int:
    return main(["train", *tiny_argv(out, cache, *BASE, *extra)])


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def shard_hashes(checkpoint: Path) -> dict[str, str]:
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    return {k: v["xxh3_128"] for k, v in files.items() if k.endswith(".distcp")}


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume-cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    out = tmp_path_factory.mktemp("resume-ref") / "run"
    assert train(out, cache) == 0
    return out


def preempt_at(monkeypatch: pytest.MonkeyPatch, step: int, sig: int = signal.SIGUSR1) -> None:
    """The process receives `sig` during step `step` (as from Slurm or torchrun)."""
    original = Trainer.run_step

    def step_fn(self: Any, batches: Any) -> Any:
        if self.step + 1 == step:
            os.kill(os.getpid(), sig)
        return original(self, batches)

    monkeypatch.setattr(Trainer, "run_step", step_fn)


def preempted_run(out: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, step: int) -> Path:
    """A run of BASE stopped by SIGUSR1 during step `step` (exit 75, checkpoint at `step`)."""
    with monkeypatch.context() as m:
        preempt_at(m, step)
        assert train(out, cache) == EXIT_PREEMPTED
    return out


def test_signal_stops_with_a_checkpoint_and_the_rerun_equals_the_uninterrupted_run(
        reference: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = preempted_run(tmp_path / "run", cache, monkeypatch, 3)
    err = capsys.readouterr().err
    assert "stopped by SIGUSR1 after step 3" in err
    marker = json.loads((out / "preempted.json").read_text())
    assert marker["step"] == 3 and marker["checkpoint"].endswith("step-0000003")
    assert train(out, cache) == 0  # auto resume
    assert not (out / "preempted.json").exists()
    assert losses(out) == losses(reference)
    final = out / "checkpoints" / "step-0000004"
    assert shard_hashes(final) == shard_hashes(reference / "checkpoints" / "step-0000004")


def test_a_finished_run_started_again_trains_nothing(reference: Path, cache: Path,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train(out, cache) == 0
    before = snapshot(out / "checkpoints")
    rows = losses(out)
    assert train(out, cache) == 0
    assert snapshot(out / "checkpoints") == before and losses(out) == rows


def test_resume_false_starts_fresh_and_true_without_checkpoint_is_an_error(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train(tmp_path / "a", cache, "--checkpoint.resume", "true") == 2
    assert "no complete checkpoint exists" in capsys.readouterr().err
    assert train(tmp_path / "b", cache, "--training.steps", "2") == 0
    assert train(tmp_path / "b", cache, "--training.steps", "2", "--checkpoint.resume",
                 "false") == 0
    assert [s for s, _ in losses(tmp_path / "b")] == [1, 2]  # trained again from step 1


@pytest.fixture
def stopped_at_2(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run preempted after step 2 of 4 (checkpoint step-0000002)."""
    return preempted_run(tmp_path / "run", cache, monkeypatch, 2)


@pytest.mark.parametrize("change, said", [
    (("--training.steps", "8"), "training.steps 4 (this run: 8): the learning rate of step 3 "
                                "would be 0.00282 instead of 0.00165"),  # as docs/train.md shows
    (("--optimizer.lr", "0.01"), "optimizer.lr"),
    (("--lr_schedule.min_lr_ratio", "0.5"), "lr_schedule.min_lr_ratio 0.1 (this run: 0.5)"),
    (("--training.micro_batch_size", "2"), "global batch of 4 samples, this run uses 2"),
    (("--data.seq_len", "16"), "data.seq_len 32, this run sets 16"),
    (("--training.seed", "7"), "training.seed"),
    (("--optimizer.weight_decay", "0.5"), "optimizer.weight_decay 0.1 (this run: 0.5): the "
                                          "update of every remaining step would change"),
    (("--training.max_grad_norm", "0.5"), "training.max_grad_norm 1.0 (this run: 0.5)"),
    (("--precision.dtype", "bf16"), "precision.dtype fp32 (this run: bf16)"),
    (("--optimizer.name", "sgd"), "optimizer.name adamw (this run: sgd)"),
], ids=["steps", "lr", "min_lr", "batch", "seq_len", "seed", "weight_decay", "clipping",
        "precision", "optimizer"])
def test_a_resume_that_changes_the_run_is_refused_before_anything_is_built(
        stopped_at_2: Path, cache: Path, change: tuple[str, ...], said: str,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    before = snapshot(stopped_at_2)

    def no_data(self: Any) -> None:
        raise AssertionError("the data were built before the resume was checked")

    monkeypatch.setattr(Trainer, "_build_data", no_data)
    assert train(stopped_at_2, cache, *change) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert snapshot(stopped_at_2) == before  # nothing written, config.toml included


def test_the_overrides_continue_with_the_new_schedule_and_batch(
        stopped_at_2: Path, cache: Path) -> None:
    assert train(stopped_at_2, cache, "--training.steps", "6", "--training.micro_batch_size",
                 "2", "--checkpoint.allow_schedule_change", "true",
                 "--checkpoint.allow_batch_change", "true") == 0
    run = json.loads((stopped_at_2 / "checkpoints" / "step-0000006" / "run.json").read_text())
    assert run["consumed_samples"] == 2 * 4 + 4 * 2  # by samples consumed, as Megatron does
    assert [s for s, _ in losses(stopped_at_2)] == list(range(1, 7))


def test_extending_a_finished_decaying_schedule_is_refused(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The finished steps were trained with the 4-step cosine; continuing them with an 8-step
    one would follow neither schedule."""
    out = tmp_path / "run"
    assert train(out, cache) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert train(out, cache, "--training.steps", "8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.steps 4 (this run: 8): the learning rate of step 3 " \
        "would have been (it is trained) 0.00282 instead of 0.00165" in err[0], err
    assert snapshot(out) == before
    assert train(out, cache, "--training.steps", "6", "--checkpoint.allow_schedule_change",
                 "true") == 0
    assert [s for s, _ in losses(out)] == list(range(1, 7))


def test_the_update_override_continues_with_the_new_settings(stopped_at_2: Path,
                                                             cache: Path) -> None:
    assert train(stopped_at_2, cache, "--optimizer.weight_decay", "0.5",
                 "--checkpoint.allow_update_change", "true") == 0
    run = json.loads((stopped_at_2 / "checkpoints" / "step-0000004" / "run.json").read_text())
    assert run["update"]["optimizer.weight_decay"] == 0.5
    assert [s for s, _ in losses(stopped_at_2)] == [1, 2, 3, 4]


def test_another_model_is_named_once_for_the_newest_checkpoint(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A sound checkpoint of another model is no damage: `auto` does not walk back through the
    older ones (re-verifying each), it names the newest once."""
    out = preempted_run(tmp_path / "run", cache, monkeypatch, 3)  # step-0000002, step-0000003
    capsys.readouterr()

    def no_verify(*a: Any, **k: Any) -> None:
        raise AssertionError("a checkpoint of another model was verified")

    monkeypatch.setattr("scaletrain.train.checkpoint.verify_manifest", no_verify)
    assert train(out, cache, "--model.n_layers", "3") == 2
    err = capsys.readouterr().err
    assert "step-0000003" in err and "different model" in err and "n_layers" in err, err
    assert "step-0000002" not in err and "checkpoint before it" not in err, err


def test_a_constant_schedule_may_be_extended(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    constant = ("--lr_schedule.decay", "constant")
    assert train(out, cache, *constant, "--training.steps", "2") == 0
    assert train(out, cache, *constant, "--training.steps", "4") == 0  # same lr at steps 3-4
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4]


def test_auto_skips_a_damaged_newest_checkpoint(
        reference: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = preempted_run(tmp_path / "run", cache, monkeypatch, 3)
    shard = next((out / "checkpoints" / "step-0000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    assert train(out, cache, "--checkpoint.resume", "true") == 2  # explicit: no fallback
    assert "truncated or damaged" in capsys.readouterr().err
    assert train(out, cache) == 0  # auto: from step-0000002, with a warning
    assert losses(out) == losses(reference)


def test_timed_checkpoints(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train(out, cache, "--checkpoint.interval", "0", "--checkpoint.interval_minutes",
                 "1e-9") == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
        [f"step-000000{s}" for s in (2, 3, 4)]  # keep_last 3; every step was due


def test_background_checkpoints_equal_synchronous_ones(reference: Path, cache: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train(out, cache, "--checkpoint.async_save", "true") == 0
    for step in ("step-0000002", "step-0000004"):
        assert shard_hashes(out / "checkpoints" / step) == \
            shard_hashes(reference / "checkpoints" / step), step
    assert not list((out / "checkpoints").glob("*.tmp"))


KILLED_IN_WRITE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from torch.distributed.checkpoint import FileSystemWriter
from scaletrain.cli import main
from tests.helpers.trainer import tiny_argv

write = FileSystemWriter.write_data
def dying_write(self, plan, planner):
    if str(self.path).endswith("step-0000004.tmp"):  # the last background save
        os.kill(os.getpid(), signal.SIGKILL)
    return write(self, plan, planner)
FileSystemWriter.write_data = dying_write
sys.exit(main(["train", *tiny_argv(*{args!r})]))
"""


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(
        reference: Path, cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [str(out), str(cache), *BASE, "--checkpoint.async_save", "true"]
    script = KILLED_IN_WRITE.format(root=str(ROOT), args=args)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(300))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "checkpoints" / "step-0000004.tmp").is_dir()
    assert Trainer.checkpointer_cls.steps_in(out / "checkpoints") == [2]
    assert train(out, cache) == 0
    assert losses(out) == losses(reference)


def test_a_signal_during_start_up_stops_before_the_first_step(
        reference: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM while the trainer is built (loading a large base takes minutes): the marker is
    written at once, so a job killed before the loop is still requeued; the loop then stops
    before its first step with exit 75, and the rerun equals the uninterrupted run."""
    out = tmp_path / "run"
    marker_at_once = []
    original = Trainer.__init__

    def build(self: Any, *a: Any, **k: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        marker_at_once.append((out / "preempted.json").is_file())
        original(self, *a, **k)

    before = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as m:
        m.setattr(Trainer, "__init__", build)
        assert train(out, cache) == EXIT_PREEMPTED
    assert marker_at_once == [True] and signal.getsignal(signal.SIGTERM) == before
    assert "stopped by SIGTERM during start-up, before step 1; nothing was trained" in \
        capsys.readouterr().err
    marker = json.loads((out / "preempted.json").read_text())
    assert marker["step"] == 0 and marker["checkpoint"] is None
    assert not list((out / "checkpoints").glob("step-*"))
    assert train(out, cache) == 0
    assert losses(out) == losses(reference)
