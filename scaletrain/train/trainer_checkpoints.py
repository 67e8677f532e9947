"""The trainer's checkpoints: what one holds besides model and optimizer (LR schedule, data
position, each rank's RNG state, the loss scaler), which one a run continues from
(`checkpoint.resume`, its `run.json` checked first: `train/resume.py`), loading it (with `auto`,
the one before a damaged newest), saving, and the collective timeouts around a save.

`TrainerCheckpoints` is a part of `Trainer` (`train/trainer.py`), which builds what its methods
use: the config, the parallelism, the model, optimizer, schedule, data stream and checkpointer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from scaletrain.train import rng
from scaletrain.train.checkpoint import Checkpointer, CheckpointError, CheckpointMismatch

log = logging.getLogger(__name__)


class TrainerCheckpoints:
    """`Trainer`'s checkpoint and resume methods."""

    @property
    def rng_layout(self) -> torch.Tensor:
        """World size, mesh shape and this rank's RNG stream: a saved RNG state is restored
        only into the same (`train/rng.py`)."""
        return rng.layout_tensor(self.par.dims.world_size,
                                 tuple(self.par.dims.mesh_shape.values()), self.rng_stream)

    def _extra_state(self) -> dict[str, Any]:
        """Everything besides model and optimizer a checkpoint holds; this rank's RNG state
        under its own key (DCP keeps one copy of entries that share a key)."""
        extra: dict[str, Any] = {
            "lr_schedule": self.schedule.state_dict(),
            "data": self.train_stream.state_dict(),
            "rng": {rng.rank_key(self.par.rank): {**rng.rng_state(self.device),
                                                  "layout": self.rng_layout}},
        }
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        return extra

    def _find_resume(self) -> tuple[Path | None, dict[str, Any] | None]:
        """(checkpoint to continue from, the settings it was trained with) per
        `checkpoint.resume`; a setting that would silently change the run is refused here."""
        mode = self.cfg.checkpoint.resume
        folder = self.output / "checkpoints"
        self.resume_step = 0
        steps = Checkpointer.steps_in(folder)
        if mode is False:
            if steps and (self.cfg.checkpoint.save_final or self.cfg.checkpoint.interval
                          or self.cfg.checkpoint.interval_minutes):
                log.warning("checkpoint.resume is false: starting fresh although %s holds "
                            "checkpoints (later saves replace them)", folder)
            return None, None
        if not steps:
            if mode is True:
                raise CheckpointError(
                    f"checkpoint.resume is true but no complete checkpoint exists under {folder};"
                    " run without --checkpoint.resume true to start fresh")
            return None, None
        self.resume_step = steps[-1]
        path = folder / Checkpointer.dir_name(steps[-1])
        return path, self._checked_settings(path, steps[-1])

    def _checked_settings(self, path: Path, step: int) -> dict[str, Any] | None:
        """The `run.json` of checkpoint `path` (at `step`), checked against this run."""
        from scaletrain.train.resume import check_resume, read_run_settings

        settings = read_run_settings(path)
        if settings is None:
            log.warning("%s has no run.json (an older scaletrain): its schedule, batch and data "
                        "settings cannot be checked against this run's", path)
        else:
            check_resume(settings, self.cfg, self.global_batch, step, path)
        return settings

    def _resume(self) -> None:
        """Load `resume_from`; with `checkpoint.resume auto` a damaged newest checkpoint gives
        way to the one before it (each checked as the first was), a sound one of another model
        does not (`CheckpointMismatch`: reported once, for the newest)."""
        candidates = [s for s in reversed(self.checkpointer.steps()) if s <= self.resume_step]
        for i, step in enumerate(candidates):
            path = self.checkpointer.path(step)
            if i:
                self._checked_settings(path, step)
            try:
                self._load_checkpoint(path)
                return
            except CheckpointMismatch:
                raise  # another model: the older checkpoints are of the same run
            except CheckpointError as e:
                if self.cfg.checkpoint.resume != "auto" or i + 1 == len(candidates):
                    raise
                log.warning("%s; resuming from the checkpoint before it", e)

    def _load_checkpoint(self, path: Path) -> None:
        from scaletrain.checkpoint.safe_dcp import read_metadata

        template = self._extra_state()
        rank = self.par.rank
        try:  # a damaged checkpoint is reported by `load` below
            stored = set(read_metadata(path).state_dict_metadata)
        except CheckpointError:
            stored = set()
        template["rng"] = rng.saved_template(rank, self.rng_layout, stored, self.device)
        extra = self.checkpointer.load(path, self.model, self.optimizer, template)
        self.schedule.load_state_dict(extra["lr_schedule"])
        self.train_stream.load_state_dict(extra["data"])
        exact = all(self.par.gather_objects(rng.is_exact(extra["rng"], rank, self.rng_layout)))
        rng.restore(extra["rng"], rank, self.rng_layout, exact, self.cfg.training.seed,
                    self.rng_stream, int(extra["step"]), self.device)
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        self.step = int(extra["step"])

    def save_checkpoint(self) -> Path:
        from scaletrain.train.resume import run_settings

        consumed = self.train_stream.state_dict()["consumed_samples"]
        run = run_settings(self.cfg, self.global_batch, consumed)
        # Rank 0 renames and prunes while the others wait: the start-up timeout holds.
        self.collective_timeout(self.cfg.parallel.timeout_s)
        try:
            return self.checkpointer.save(self.step, self.model, self.optimizer,
                                          self._extra_state(), run)
        finally:
            if self.step > 0:
                self.collective_timeout(self.cfg.parallel.step_timeout_s)

    def collective_timeout(self, seconds: float) -> None:
        """Bound the run's collectives by `seconds` (not those of a background checkpoint
        write, which keep the start-up timeout)."""
        from scaletrain.parallel.mesh import set_collective_timeout

        group = self.checkpointer.async_group
        set_collective_timeout(seconds, skip=() if group is None else (group,))
