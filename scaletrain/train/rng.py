"""Random-number state of training: each rank's own stream, saved and restored per rank.

Model initialization draws from `training.seed` alone, identically on every rank (and in one
process). After the model is built, `seed_training_rng` reseeds the torch (CPU and CUDA), numpy
and Python generators from (seed, stream, step), where `stream` is the rank's data-parallel
position (`rng_stream`): dropout masks are independent across ranks that see different data.

Which ranks share a stream: the rank's stream is its coordinate over the data-parallel ranks
(dp_replicate x dp_shard, expert-parallel ranks included), times context parallelism (each
context-parallel rank holds another slice of the sequence) and pipeline stages (different
layers); tensor-parallel ranks share it, so they draw the same masks on the activations they
compute replicated. Dropout with tensor parallelism is refused all the same
(`parallel/feasibility.py`): under sequence parallelism the activations are sharded and torch's
DTensor RNG tracker (which offsets a Philox generator per shard, CUDA only) would be needed.

Checkpoints: DCP writes one copy of every entry whose key is the same on all ranks (it
deduplicates plain tensors and non-tensor objects by key), so one "rng" entry brought one
rank's state back on every rank. Here each rank saves its state as tensors under its own key
`rng/rank<r>` (every rank writes its own entry) together with the layout it ran in, and loads
only its own. When the checkpoint holds no state saved by this rank in this layout (another
world size or layout, or a checkpoint written before per-rank states), the exact states cannot
exist: every rank warns and reseeds deterministically from (seed, stream, resumed step), so
resuming the same checkpoint in the same new layout twice gives the same run.
"""

from __future__ import annotations

import logging
import random
import struct
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_MT_WORDS = 624  # Mersenne Twister state words of numpy's MT19937 and Python's random


def rng_stream(dp_rank: int, cp_rank: int, cp: int, pp_rank: int, dp: int) -> int:
    """The rank's training RNG stream: one per (pipeline stage, data-parallel rank,
    context-parallel rank); tensor-parallel ranks share it. 0 in one process."""
    return (pp_rank * dp + dp_rank) * cp + cp_rank


def training_seed(seed: int, stream: int, step: int = 0) -> int:
    """A 63-bit seed from (seed, stream, step), well mixed (numpy's SeedSequence)."""
    words = np.random.SeedSequence([seed, stream, step]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def seed_training_rng(seed: int, stream: int, step: int = 0) -> None:
    """Seed torch (CPU and every CUDA device), numpy and Python from (seed, stream, step)."""
    s = training_seed(seed, stream, step)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def _host_state() -> torch.Tensor:
    """numpy's and Python's generator states as one int64 tensor of fixed length:
    numpy key (624), pos, has_gauss, cached gaussian (bits); Python key + pos (625),
    has gauss_next, gauss_next (bits)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    assert name == "MT19937"
    version, internal, gauss_next = random.getstate()
    assert version == 3 and len(internal) == _MT_WORDS + 1
    words = [*key.tolist(), pos, has_gauss, _bits(gauss), *internal,
             gauss_next is not None, _bits(gauss_next or 0.0)]
    return torch.tensor(words, dtype=torch.int64)


def _set_host_state(t: torch.Tensor) -> None:
    w = t.tolist()
    n = _MT_WORDS
    np.random.set_state(("MT19937", np.array(w[:n], dtype=np.uint32), w[n], w[n + 1],
                         _float(w[n + 2])))
    internal = tuple(w[n + 3:2 * n + 4])
    gauss_next = _float(w[2 * n + 5]) if w[2 * n + 4] else None
    random.setstate((3, internal, gauss_next))


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _cuda_device(device: torch.device | None) -> torch.device | None:
    """The CUDA device whose generator belongs to this rank: `device` when it is one, else the
    current device once CUDA is in use; None without CUDA."""
    if device is not None and device.type == "cuda":
        return device
    if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def rng_state(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This process's RNG state as tensors: torch CPU, numpy + Python ("host") and, on CUDA,
    the generator of this rank's `device` (the current device when None)."""
    state = {"torch": torch.get_rng_state(), "host": _host_state()}
    cuda = _cuda_device(device)
    if cuda is not None:
        state["cuda"] = torch.cuda.get_rng_state(cuda)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what `rng_state(device)` returned (the CUDA part only where there is one)."""
    torch.set_rng_state(state["torch"])
    _set_host_state(state["host"])
    cuda = _cuda_device(device)
    if "cuda" in state and cuda is not None:
        torch.cuda.set_rng_state(state["cuda"], cuda)


def rank_key(rank: int) -> str:
    return f"rank{rank}"


def layout_tensor(world: int, mesh_shape: tuple[int, ...], stream: int) -> torch.Tensor:
    """What must match for a saved state to be this rank's: world size, mesh shape, stream."""
    return torch.tensor([world, *mesh_shape, stream], dtype=torch.int64)


def saved_template(rank: int, layout: torch.Tensor, stored_keys: set[str],
                   device: torch.device | None = None,
                   prefix: str = "extra.rng") -> dict[str, dict[str, torch.Tensor]]:
    """The "rng" entry to load from a checkpoint whose DCP keys are `stored_keys`: this
    rank's saved state when it is there with a layout of the same length, else nothing."""
    mine = f"{prefix}.{rank_key(rank)}"
    if f"{mine}.torch" not in stored_keys or f"{mine}.host" not in stored_keys \
            or f"{mine}.layout" not in stored_keys:
        return {}
    entry = {**rng_state(device), "layout": layout.clone()}
    entry = {k: v for k, v in entry.items() if f"{mine}.{k}" in stored_keys}
    return {rank_key(rank): entry}


def restore(loaded: dict[str, Any], rank: int, layout: torch.Tensor, everyone_exact: bool,
            seed: int, stream: int, step: int, device: torch.device | None = None) -> None:
    """Put this rank's saved state back when every rank has its own (`everyone_exact`, agreed
    over the ranks by the caller); otherwise warn and reseed from (seed, stream, step)."""
    if everyone_exact:
        set_rng_state(loaded[rank_key(rank)], device)
        return
    log.warning("checkpoint at step %d holds no RNG state of this rank in this layout (world "
                "size %d, mesh %s): it was saved with another layout or before per-rank RNG "
                "states. Each rank's RNG is reseeded from (training.seed, its data-parallel "
                "stream, step): the run is reproducible but its dropout masks differ from the "
                "uninterrupted run's", step, int(layout[0]), tuple(layout[1:-1].tolist()))
    seed_training_rng(seed, stream, step)


def is_exact(loaded: dict[str, Any], rank: int, layout: torch.Tensor) -> bool:
    """Whether `loaded` (a `saved_template` filled by the load) holds this rank's state saved
    in the same layout."""
    entry = loaded.get(rank_key(rank))
    return entry is not None and "layout" in entry and torch.equal(entry["layout"], layout)
