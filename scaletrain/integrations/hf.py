"""`ScaletrainCallback` for the Hugging Face `Trainer`.

    from scaletrain.integrations.hf import ScaletrainCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[ScaletrainCallback(plan=True)])

Before the first step (`plan=True`) it prints the plan of the model from its config for the
run's batch (`per_device_train_batch_size`, `gradient_accumulation_steps`, the world size) and
precision (`bf16`/`fp16`). It profiles a window of optimizer steps (wait/warmup/active after
`start_step`), diagnoses it when the window closes and sends the verdict, the report and the
breakdown to the trackers of `args.report_to`: the run W&B's callback opened (`wandb.run`),
MLflow's active run, and TensorBoard event files in `$TENSORBOARD_LOGGING_DIR` or
`<output_dir>/runs/scaletrain` (beside the Trainer's own runs). The figures are also appended
to `state.log_history` (trainer_state.json).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("scaletrain.integrations.hf needs transformers: pip install "
                      "'scaletrain[hf]'") from e

from scaletrain.integrations.plan import precision_name
from scaletrain.integrations.window import Window
from scaletrain.train.trackers import MlflowTracker, TensorBoardTracker, Tracker, WandbTracker

log = logging.getLogger(__name__)


def _report_to(args: Any) -> list[str]:
    r = args.report_to
    if r is None or r == "none":
        return []
    return [r] if isinstance(r, str) else list(r)


def run_trackers(args: Any) -> list[Tracker]:
    """Trackers for the runs the Trainer's own reporting callbacks opened."""
    names, out = _report_to(args), []
    if "all" in names:
        names = ["tensorboard", "wandb", "mlflow"]
    if "wandb" in names:
        try:
            import wandb
        except ImportError:
            wandb = None
        if wandb is not None and wandb.run is not None:
            out.append(WandbTracker(wandb.run, own=False, step_key="train/global_step"))
    if "mlflow" in names:
        active = MlflowTracker.active()
        if active is not None:
            out.append(active)
    if "tensorboard" in names:
        logdir = os.environ.get("TENSORBOARD_LOGGING_DIR") or os.path.join(
            args.output_dir, "runs", "scaletrain")
        try:
            out.append(TensorBoardTracker.open(Path(logdir)))
        except Exception as e:  # tensorboard missing: the Trainer warned already
            log.warning("scaletrain: no TensorBoard writer: %s", e)
    return out


class ScaletrainCallback(TrainerCallback):
    """Plan before the first step, a profiled window of steps and its diagnosis (see the
    module's docstring; the options are `window.Window`'s)."""

    def __init__(self, output: str | Path | None = None, **options: Any) -> None:
        self.window = Window(output, **options)
        self.trackers: list[Tracker] = []

    @property
    def result(self) -> dict[str, Any] | None:
        """The diagnosis of the window (`scaletrain diagnose`'s report), once it closed."""
        return self.window.result

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        self.trackers = run_trackers(args) if state.is_world_process_zero else []
        if self.window.plan and state.is_world_process_zero:
            self.window.print_plan(
                getattr(model, "config", None), self.trackers, state.global_step,
                micro_batch=args.per_device_train_batch_size,
                grad_accum=args.gradient_accumulation_steps, world_size=args.world_size,
                precision=precision_name(args.bf16, args.fp16), device=args.device)
        self.window.begin(Path(args.output_dir))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.window.on_step():
            self._send(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.window.finish():
            self._send(state)
        for t in self.trackers:
            t.close()

    def _send(self, state: Any) -> None:
        values = self.window.send(self.trackers, state.global_step)
        state.log_history.append({**values, "profile/verdict": self.window.result["verdict"],
                                  "step": state.global_step})
