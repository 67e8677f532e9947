"""Token losses summed (not averaged), so accumulation and data parallelism normalize once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32; targets equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_valid(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE_INDEX).sum()
