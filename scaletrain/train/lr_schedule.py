"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay."""

from __future__ import annotations

import math
from typing import Any

from scaletrain.config import LRScheduleConfig


def lr_at(cfg: LRScheduleConfig, peak: float, total_steps: int, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based) of a `total_steps` run peaking at
    `peak`."""
    floor = peak * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    if cfg.decay == "constant":
        return peak
    decay_start = warmup
    if cfg.decay == "wsd":
        decay_start = max(warmup, total_steps - int(cfg.decay_fraction * total_steps))
        if step < decay_start:
            return peak
    span = max(1, total_steps - decay_start)
    progress = min(1.0, (step - decay_start + 1) / span)
    if cfg.decay == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return peak - (peak - floor) * progress  # linear, and the decay phase of wsd


class LRSchedule:
    """Sets the learning rate of an optimizer's param groups for each step.

    Stateless apart from the step counter, so resuming needs only `state_dict()["step"]`.
    """

    def __init__(self, optimizer: Any, cfg: LRScheduleConfig, peak_lr: float,
                 total_steps: int) -> None:
        self.optimizer, self.cfg = optimizer, cfg
        self.peak_lr, self.total_steps = peak_lr, total_steps
        self.step_count = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        return lr_at(self.cfg, self.peak_lr, self.total_steps, step)

    @property
    def lr(self) -> float:
        return self.lr_at(self.step_count)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_count = int(state["step"])
        self._apply()
