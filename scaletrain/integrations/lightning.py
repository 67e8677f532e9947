"""`ScaletrainCallback` for Lightning (`lightning.pytorch`, else `pytorch_lightning`).

    from scaletrain.integrations.lightning import ScaletrainCallback
    trainer = L.Trainer(max_steps=100, callbacks=[ScaletrainCallback(plan=True)])

Before the first step (`plan=True`) it prints the plan of the module's model, found as
`pl_module.config` or `pl_module.model.config` (a Hugging Face config), for the run's batch
(the first batch's size and sequence length, or `seq_len=`), gradient accumulation, world size
and precision. It profiles a window of optimizer steps, diagnoses it when the window closes and
sends the breakdown to every logger of the trainer (`logger.log_metrics`) and the verdict and
the report as text: TensorBoard `add_text`, the W&B run's summary, an MLflow tag and artifact,
other loggers as a hyperparameter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise ImportError("scaletrain.integrations.lightning needs Lightning: pip install "
                          "'scaletrain[integrations]'") from e

from scaletrain.integrations.window import Window
from scaletrain.train.trackers import MlflowTracker, TensorBoardTracker, Tracker, WandbTracker

log = logging.getLogger(__name__)


class LoggerTracker:
    """A Lightning logger as a Tracker: figures through `log_metrics`, text through the
    logger's own run object where it has one."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.name = type(logger).__name__
        self.text_to: Tracker | None = _text_tracker(logger)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.logger.log_metrics(values, step=step)

    def text(self, key: str, text: str, step: int) -> None:
        if self.text_to is not None:
            self.text_to.text(key, text, step)
        else:
            self.logger.log_hyperparams({key: text.splitlines()[0] if text else ""})

    def params(self, values: dict[str, Any]) -> None:
        self.logger.log_hyperparams(values)

    def close(self) -> None:
        self.logger.save()


def _text_tracker(logger: Any) -> Tracker | None:
    kind = type(logger).__name__
    if kind == "TensorBoardLogger":
        return TensorBoardTracker(logger.experiment, own=False)
    if kind == "WandbLogger":
        return WandbTracker(logger.experiment, own=False)
    if kind == "MLFlowLogger":
        return MlflowTracker(logger.experiment, logger.run_id, own=False)
    return None


def _model_config(pl_module: Any) -> Any:
    for owner in (pl_module, getattr(pl_module, "model", None)):
        config = getattr(owner, "config", None)
        if config is not None and (isinstance(config, dict) or hasattr(config, "to_dict")):
            return config
    return None


def _precision(trainer: Any) -> str:
    p = str(trainer.precision)
    return "bf16" if p.startswith("bf16") else "fp16" if p.startswith("16") else "fp32"


def _batch_shape(batch: Any) -> tuple[int, int | None]:
    """(batch size, sequence length) of a batch: a tensor, a tuple/list or a dict of them."""
    first = batch
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)):
        first = batch[0] if batch else None
    shape = tuple(getattr(first, "shape", ()))
    return (int(shape[0]) if shape else 1), (int(shape[1]) if len(shape) > 1 else None)


class ScaletrainCallback(pl.Callback):
    """Plan before the first step, a profiled window of steps and its diagnosis (see the
    module's docstring; the options are `window.Window`'s)."""

    def __init__(self, output: str | Path | None = None, **options: Any) -> None:
        self.window = Window(output, **options)
        self.trackers: list[Tracker] = []
        self._planned = False
        self._last_step = 0

    @property
    def result(self) -> dict[str, Any] | None:
        """The diagnosis of the window (`scaletrain diagnose`'s report), once it closed."""
        return self.window.result

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        main = trainer.is_global_zero
        self.trackers = [LoggerTracker(lg) for lg in trainer.loggers] if main else []
        self._planned = not (self.window.plan and main)
        self._last_step = trainer.global_step
        root = Path(trainer.log_dir or trainer.default_root_dir)
        self.window.begin(root)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self._planned:
            return
        self._planned = True  # the plan needs the batch shape: printed before the first step
        mbs, seq = _batch_shape(batch)
        self.window.print_plan(
            _model_config(pl_module), self.trackers, trainer.global_step, micro_batch=mbs,
            seq_len=self.window.seq_len or seq, grad_accum=trainer.accumulate_grad_batches,
            world_size=trainer.world_size, precision=_precision(trainer),
            device=pl_module.device)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # an accumulation micro-batch: the step is not over
        self._last_step = trainer.global_step
        if self.window.on_step():
            self.window.send(self.trackers, trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.window.finish():
            self.window.send(self.trackers, trainer.global_step)
        for t in self.trackers:
            t.close()
