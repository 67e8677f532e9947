"""apply_ac: activation checkpointing of transformer blocks (full, every n-th, attention only)."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from scaletrain.config import ActivationCheckpointConfig

log = logging.getLogger(__name__)


def _wrap(module: nn.Module) -> nn.Module:
    """A module that draws random numbers in forward (LoRA's dropout) has its RNG state
    stashed and restored around the recomputation, so backward replays forward's masks; the
    others skip that cost (the pre-trained decoder has no dropout)."""
    random = any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())
    return checkpoint_wrapper(module, preserve_rng_state=random)


def apply_ac(model: nn.Module, cfg: ActivationCheckpointConfig) -> int:
    """Wrap blocks of `model.layers` so their activations are recomputed in backward.

    `full`: every block; `partial` with scope `block`: every `cfg.every`-th block; scope
    `attention`: only the attention sub-module of those blocks. The wrapper keeps parameter
    names unchanged, so checkpoints and state dicts do not depend on this setting.
    Returns the number of modules wrapped.
    """
    if cfg.mode == "none":
        return 0
    wrapped = 0
    for index, (name, block) in enumerate(list(model.layers.items())):
        if cfg.mode == "partial" and index % cfg.every != cfg.every - 1:
            continue
        if cfg.mode == "partial" and cfg.scope == "attention":
            block.attention = _wrap(block.attention)
        else:
            model.layers[name] = _wrap(block)
        wrapped += 1
    log.info("activation checkpointing: %s, %d of %d blocks", cfg.mode, wrapped, len(model.layers))
    return wrapped
