"""The training step and evaluation paths: no host synchronization outside log steps, a
non-finite step acted on at the next log step, validation independent of the micro-batch split."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from scaletrain.train.trainer import Trainer, TrainingDiverged
from tests.helpers.trainer import tiny_config

QUIET = ("--checkpoint.save_final", "false", "--training.sample_tokens", "0")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


class SyncCounter:
    """Counts host reads of tensor values (`.item()`, `.tolist()`, `bool()`, `float()`,
    `int()`) and `torch.cuda.synchronize`, with the trainer's step at each call; reads during
    data loading (host tensors from the loader) are not counted."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.calls, self.loading = trainer, [], False
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> SyncCounter:
        for name in self.METHODS:
            self.saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(self.saved[name], name))
        self.saved["sync"] = torch.cuda.synchronize
        torch.cuda.synchronize = self._wrap(torch.cuda.synchronize, "synchronize")
        load = self.trainer.next_batches

        def loading() -> Any:
            self.loading = True
            try:
                return load()
            finally:
                self.loading = False

        self.trainer.next_batches = loading  # type: ignore[method-assign]
        return self

    def _wrap(self, fn: Any, name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.loading:
                self.calls.append((self.trainer.step, name))
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *_: Any) -> None:
        for name in self.METHODS:
            setattr(torch.Tensor, name, self.saved[name])
        torch.cuda.synchronize = self.saved["sync"]


def test_no_host_sync_outside_log_steps(tmp_path: Path, cache: Path) -> None:
    # Defaults users run: clipping at 1.0, accumulation, fused AdamW; log every 4th step.
    t = Trainer(tiny_config(tmp_path / "r", cache, *QUIET, "--training.steps", "8",
                            "--training.grad_accum_steps", "2", "--metrics.log_interval", "4"))
    with SyncCounter(t) as counter:
        result = t.train()
    # A call made while step k runs sees trainer.step == k - 1; a log step's read sees k.
    steps = {step for step, _ in counter.calls}
    assert steps and steps <= {1, 4, 8}, counter.calls  # the first step is logged alone
    # ... and the metrics still hold every step's own loss and norm.
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 9))
    assert [m["loss"] for m in lines] == result.losses
    assert len({m["grad_norm"] for m in lines}) == 8


def test_nonfinite_step_is_reported_at_the_next_log_step(tmp_path: Path, cache: Path) -> None:
    def nan_on_second_step(trainer: Trainer) -> None:
        plain = trainer.loss_fn

        def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = plain(logits, y)
            return loss * float("nan") if trainer.step == 1 else loss
        trainer.loss_fn = loss_fn

    argv = (*QUIET, "--training.steps", "4", "--metrics.log_interval", "3")
    stop = Trainer(tiny_config(tmp_path / "s", cache, *argv))
    nan_on_second_step(stop)
    with pytest.raises(TrainingDiverged, match="at step 2"):
        stop.train()
    assert stop.step == 3  # raised at the log step after the bad one, not later
    skip = Trainer(tiny_config(tmp_path / "k", cache, *argv, "--training.on_nan", "skip"))
    ref = Trainer(tiny_config(tmp_path / "ref", cache, *argv))
    nan_on_second_step(skip)
    got = skip.train()
    assert math.isnan(got.losses[1]) and all(math.isfinite(x) for x in got.losses[2:])
    # The skipped step left the weights alone: step 3 sees the weights after step 1.
    ref.train_step(ref.next_batches())
    ref.next_batches()  # the batches of the skipped step
    ref.schedule.step()
    assert ref.train_step(ref.next_batches())[0] == pytest.approx(got.losses[2], rel=1e-6)


def test_validation_does_not_depend_on_the_micro_batch_split(tmp_path: Path,
                                                             cache: Path) -> None:
    values = []
    for mbs, ga in ((8, 1), (2, 4), (3, 1)):
        t = Trainer(tiny_config(tmp_path / f"v{mbs}", cache, "--training.micro_batch_size",
                                str(mbs), "--training.grad_accum_steps", str(ga)))
        values.append(t.evaluate())
    assert values[1] == pytest.approx(values[0], rel=1e-6)
    assert values[2] == pytest.approx(values[0], rel=1e-6)


def test_nonfinite_validation_loss_follows_on_nan(tmp_path: Path, cache: Path) -> None:
    for on_nan in ("stop", "skip"):
        t = Trainer(tiny_config(tmp_path / on_nan, cache, "--training.on_nan", on_nan))
        with torch.no_grad():
            t.model.norm.weight.fill_(float("nan"))
        if on_nan == "stop":
            with pytest.raises(TrainingDiverged, match="validation loss is nan"):
                t.evaluate()
        else:
            assert math.isnan(t.evaluate())
