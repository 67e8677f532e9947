"""apply_compile: torch.compile each transformer block in place (names stay unchanged)."""

from __future__ import annotations

import logging

from torch import nn

from scaletrain.config import CompileConfig

log = logging.getLogger("scaletrain.parallel")


def apply_compile(model: nn.Module, cfg: CompileConfig) -> None:
    """Compile block by block: repeated blocks share one compiled graph, and a graph break in
    one block cannot spill into the whole model. `nn.Module.compile` keeps state-dict keys."""
    if not cfg.enabled:
        return
    for block in model.layers.values():
        block.compile(mode=cfg.mode, fullgraph=False)
    log.info("torch.compile: %d blocks, mode %s", len(model.layers), cfg.mode)
