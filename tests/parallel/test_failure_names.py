"""Failures are named for what they are: only a communication failure becomes a lost-peer
report; an out-of-memory or shape error of this rank passes through unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scaletrain.parallel.failure import DistributedFailure, guard, is_peer_failure


class SilentPeer:
    """A heartbeat whose rank 1 stopped in its step 3."""

    last_seen = {1: "step 3: training step"}

    def silent_ranks(self) -> list[int]:
        return [1]


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x64 and 32x64)"),
    ValueError("sequence of 300 tokens exceeds max_seq_len 256"),
], ids=["oom", "shape", "value"])
def test_own_errors_pass_through(error: Exception) -> None:
    assert not is_peer_failure(error)
    with pytest.raises(type(error)) as caught, guard(SilentPeer(), 3):  # type: ignore[arg-type]
        raise error
    assert caught.value is error


@pytest.mark.parametrize("error", [
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                 "peer [127.0.0.1]:29500"),
    dist.DistBackendError("NCCL communicator was aborted on rank 0"),
    RuntimeError("Timed out waiting 60000ms for recv operation to complete"),
], ids=["gloo", "nccl", "timeout"])
def test_lost_peer_is_named(error: Exception) -> None:
    assert is_peer_failure(error)
    lost = r"at step 3: rank 1 stopped responding \(last seen at step 3: training step\)"
    with pytest.raises(DistributedFailure, match=lost), guard(SilentPeer(), 3):  # type: ignore[arg-type]
        raise error


def test_one_process_passes_everything_through() -> None:
    with pytest.raises(RuntimeError, match="Connection closed"), guard(None, 1):
        raise RuntimeError("Connection closed by peer")


@pytest.fixture
def one_process_group():  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_heartbeat_stop_waits_for_its_thread(one_process_group: None) -> None:
    """A heartbeat thread left inside a store call at interpreter exit aborts the process."""
    from scaletrain.parallel.failure import Heartbeat

    beat = Heartbeat(interval_s=0.01)
    beat.stop()
    assert not beat._thread.is_alive()


def test_heartbeat_never_names_its_own_rank(one_process_group: None) -> None:
    """On a loaded machine this rank's own beat can be late; it is alive all the same."""
    from scaletrain.parallel.failure import Heartbeat

    beat = Heartbeat(interval_s=0.01)
    beat.stop()
    beat.store.set("scaletrain/heartbeat/0", repr(0.0))  # a beat from 1970
    assert beat.silent_ranks(stale_s=0.0) == []


@pytest.mark.parametrize("verb", ["train", "finetune", "profile"])
def test_commands_end_the_process_groups_on_an_error(verb: str, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every way out of a training verb ends the process groups (a process that exits with
    them alive can abort in interpreter shutdown), here an error while building the trainer."""
    import importlib

    import scaletrain.finetune.trainer  # noqa: F401  (built on Trainer before it is replaced)
    from scaletrain.train.checkpoint import CheckpointError

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise CheckpointError("no checkpoint to resume")

    calls = []
    monkeypatch.setattr("scaletrain.parallel.mesh.shutdown_process_group",
                        lambda: calls.append(1))
    monkeypatch.setattr("scaletrain.train.trainer.Trainer", refuse)
    monkeypatch.setattr("scaletrain.finetune.trainer.FinetuneTrainer", refuse)
    argv = ["--output", str(tmp_path / "out")]
    if verb == "finetune":
        argv += ["--base", str(tmp_path), "--method", "full", "--task", "sft", "--data",
                 str(tmp_path / "d.jsonl")]
    assert importlib.import_module(f"scaletrain.commands.{verb}").main(argv) == 2
    assert calls == [1]
