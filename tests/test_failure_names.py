"""Failures are named for what they are: only a communication failure becomes a lost-peer
report; an out-of-memory or shape error of this rank passes through unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scaletrain.parallel.failure import DistributedFailure, guard, is_peer_failure


class SilentPeer:
    """A heartbeat whose rank 1 stopped."""

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
    lost = r"at step 3: rank\(s\) 1 stopped responding"
    with pytest.raises(DistributedFailure, match=lost), guard(SilentPeer(), 3):  # type: ignore[arg-type]
        raise error


def test_one_process_passes_everything_through() -> None:
    with pytest.raises(RuntimeError, match="Connection closed"), guard(None, 1):
        raise RuntimeError("Connection closed by peer")
