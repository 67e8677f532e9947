"""apply_compile: torch.compile each transformer block in place (names stay unchanged)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist
from torch import nn

from scaletrain.config import CompileConfig

log = logging.getLogger(__name__)

_CACHE_BASE: str | None = None  # TORCHINDUCTOR_CACHE_DIR as this process first found it


def apply_compile(model: nn.Module, cfg: CompileConfig,
                  groups: Iterable[dist.ProcessGroup] = ()) -> None:
    """Compile block by block: repeated blocks share one compiled graph, and a graph break in
    one block cannot spill into the whole model. `nn.Module.compile` keeps state-dict keys.
    `groups`: the process groups the compiled blocks may run collectives on (see
    `isolate_compile_cache`)."""
    if not cfg.enabled:
        return
    groups = list(groups)
    if groups:
        isolate_compile_cache(groups)
    for block in model.layers.values():
        block.compile(mode=cfg.mode, fullgraph=False)
    log.info("torch.compile: %d blocks, mode %s", len(model.layers), cfg.mode)


def isolate_compile_cache(groups: Iterable[dist.ProcessGroup]) -> Path:
    """Point inductor's on-disk caches at a directory of this rank and these process groups'
    names, under the usual cache directory.

    Inductor's FX-graph and AOTAutograd caches key a graph without the names of the process
    groups its collectives use, while the code they store names them (`all_gather(..., '20')`).
    Another rank, whose tensor-parallel group has another name, or a later run that numbers
    its groups differently, then loads code naming a group it does not have ("Could not
    resolve the process group registered under the name 20"; pytorch/pytorch#176532), or one
    it has with other members. Seen here with EP x TP on 4 ranks, and reported for FSDP x TP
    (torchtitan, TP 2 on 4 GPUs). Keyed by the names, every cached entry is read only where
    those names mean the same groups; a rerun of the same layout still finds its compiled
    code."""
    global _CACHE_BASE
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if _CACHE_BASE is None:
        _CACHE_BASE = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    names = sorted({g.group_name for g in groups})
    key = hashlib.sha256(",".join(names).encode()).hexdigest()[:12]
    path = Path(_CACHE_BASE) / "scaletrain" / f"rank{dist.get_rank()}-groups-{key}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path
