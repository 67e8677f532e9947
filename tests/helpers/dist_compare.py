"""Relative errors of a parallel run against the one-process reference, shared by the parity
tests."""

from __future__ import annotations

from collections.abc import Iterable

import torch

# A gradient's scale floor: a key projection's bias has a zero gradient (softmax ignores a
# shift shared by all keys), so both runs hold only rounding noise (~1e-11) there.
GRAD_SCALE_FLOOR = 1e-4


def rel_max(got: list[float], ref: list[float]) -> float:
    """The largest relative difference of paired values."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))


def grad_error(ranks_grads: Iterable[dict[str, torch.Tensor]],
               ref: dict[str, torch.Tensor], name: str = "") -> float:
    """max |g - g_ref| / max |g_ref| over every tensor of every rank; every reference
    gradient must be held by some rank."""
    worst, seen = 0.0, set()
    for grads in ranks_grads:
        for key, g in grads.items():
            r = ref[key]
            scale = max(float(r.abs().max()), GRAD_SCALE_FLOOR)
            worst = max(worst, float((g - r).abs().max()) / scale)
            seen.add(key)
    assert seen == set(ref), f"{name}: gradients missing for {set(ref) - seen}"
    return worst
