"""Resuming consistently: the settings a checkpoint was trained with (`run.json`, written beside
`meta.json` in every checkpoint) are checked against this run's before anything heavy is built.

A resume may change how the work is laid out (ranks, micro-batch, parallelism) but not, without
being told, what is computed: the data order (data settings, seed, sequence length), the global
batch (`checkpoint.allow_batch_change`: continue from the samples consumed), the learning rate
schedule (`checkpoint.allow_schedule_change`: any step the two schedules share) or the update
(`checkpoint.allow_update_change`: optimizer, clipping, precision). A mismatch is one line
naming the setting, both values and the override.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from scaletrain.config import Config, ConfigError
from scaletrain.train.lr_schedule import lr_at

RUN_NAME = "run.json"
FORMAT = "scaletrain-run"

# Data settings that do not change which samples come in which order.
_LOADER_ONLY = {"cache_dir", "num_workers", "prefetch_factor", "pin_memory",
                "persistent_workers"}
_FINETUNE_DATA = ("data", "val_data", "task", "packing")


_ANEW = "another --output, or --checkpoint.resume false to replace these checkpoints"


class ResumeMismatch(ConfigError):
    """This run's settings would silently change the resumed run (exit 2, one line)."""


def _data_settings(cfg: Config) -> dict[str, Any]:
    """The settings that decide which samples come in which order (JSON-ready)."""
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in _LOADER_ONLY}
    data.update({f"finetune.{k}": getattr(cfg.finetune, k) for k in _FINETUNE_DATA})
    return json.loads(json.dumps(data))


UPDATE_SETTINGS = ("optimizer.name", "optimizer.weight_decay", "optimizer.beta1",
                   "optimizer.beta2", "optimizer.eps", "training.max_grad_norm",
                   "precision.dtype", "precision.param_dtype", "precision.fp8")
"""Settings that change what an optimizer step computes (besides the learning rate, which the
schedule check covers); layout settings (ranks, micro-batch, parallelism, offload, the optimizer
implementation) are not among them."""


def _update_settings(cfg: Config) -> dict[str, Any]:
    out = {}
    for name in UPDATE_SETTINGS:
        section, field = name.split(".")
        out[name] = getattr(getattr(cfg, section), field)
    return json.loads(json.dumps(out))


def run_settings(cfg: Config, global_batch: int, consumed_samples: int) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (JSON-ready)."""
    return {"format": FORMAT, "version": 2, "consumed_samples": int(consumed_samples),
            "global_batch_size": int(global_batch), "seed": cfg.training.seed,
            "training_steps": cfg.training.steps, "lr": cfg.optimizer.lr,
            "lr_schedule": dataclasses.asdict(cfg.lr_schedule), "data": _data_settings(cfg),
            "update": _update_settings(cfg)}


def write_run_settings(directory: Path, settings: dict[str, Any]) -> None:
    (directory / RUN_NAME).write_text(json.dumps(settings, indent=1) + "\n")


def read_run_settings(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's `run.json` (None for checkpoints written before it existed)."""
    path = checkpoint / RUN_NAME
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        ok = isinstance(saved, dict) and saved.get("format") == FORMAT
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise ConfigError(f"{path} is damaged: restore the checkpoint from a good copy or delete "
                          "it to resume from the one before")
    return saved


def check_resume(saved: dict[str, Any], cfg: Config, global_batch: int, step: int,
                 checkpoint: Path) -> None:
    """Raise `ResumeMismatch` when resuming `checkpoint` (at `step`) with `cfg` would change
    the data order, the global batch or the learning rate of a remaining step unasked."""
    where = f"{checkpoint.name} was trained with"
    now = _data_settings(cfg)
    for key, value in saved["data"].items():
        if key in now and now[key] != value:
            name = key if key.startswith("finetune.") else f"data.{key}"
            raise ResumeMismatch(
                f"{where} {name} {_show(value)}, this run sets {_show(now[key])}: the "
                f"data order would change; resume with --{name} {_show(value)}, or start anew "
                f"({_ANEW})")
    if saved["seed"] != cfg.training.seed:
        raise ResumeMismatch(
            f"{where} training.seed {saved['seed']}, this run sets {cfg.training.seed}: the "
            f"data order would change; resume with --training.seed {saved['seed']}, or start "
            f"anew ({_ANEW})")
    if saved["global_batch_size"] != global_batch and not cfg.checkpoint.allow_batch_change:
        raise ResumeMismatch(
            f"{where} a global batch of {saved['global_batch_size']} samples, this run uses "
            f"{global_batch}: resume with the same training.global_batch_size, or pass "
            "--checkpoint.allow_batch_change true to continue from the "
            f"{saved['consumed_samples']:,} samples consumed with the new batch")
    if not cfg.checkpoint.allow_schedule_change:
        _check_schedule(saved, cfg, step, where)
    if not cfg.checkpoint.allow_update_change:
        _check_update(saved.get("update"), cfg, where)


def _check_update(saved: dict[str, Any] | None, cfg: Config, where: str) -> None:
    """Refuse a change of a setting that changes the optimizer step (`UPDATE_SETTINGS`);
    checkpoints written before run.json recorded them (version 1) are not checked."""
    if saved is None:
        return
    now = _update_settings(cfg)
    changed = [k for k in UPDATE_SETTINGS if k in saved and saved[k] != now[k]]
    if changed:
        shown = ", ".join(f"{k} {_show(saved[k])} (this run: {_show(now[k])})" for k in changed)
        first = changed[0]
        raise ResumeMismatch(
            f"{where} {shown}: the update of every remaining step would change; resume with "
            f"--{first} {_show(saved[first])}, or pass --checkpoint.allow_update_change true "
            "to continue with the new settings")


SCHEDULE_STEPS_CHECKED = 200_000
"""Schedules longer than this are compared at that many evenly spaced steps (and at the
resumed step), not at every step."""


def _check_schedule(saved: dict[str, Any], cfg: Config, step: int, where: str) -> None:
    """Refuse a schedule whose learning rate differs from the checkpoint's at any step the two
    share: a remaining step would get another rate, or the steps already trained would not be
    the start of the new schedule (extending a finished or decaying schedule: the resumed run
    would follow neither). Extending a constant schedule changes nothing and passes."""
    known = {f.name for f in dataclasses.fields(cfg.lr_schedule)}
    old_cfg = dataclasses.replace(cfg.lr_schedule, **{k: v for k, v in saved["lr_schedule"].items()
                                                      if k in known})
    old_total, new_total = saved["training_steps"], cfg.training.steps
    shared = min(old_total, new_total)
    stride = max(1, shared // SCHEDULE_STEPS_CHECKED)
    checked = sorted({*range(0, shared, stride), *([step] if step < shared else []),
                      *([shared - 1] if shared else [])})
    for s in checked:
        old = lr_at(old_cfg, saved["lr"], old_total, s)
        new = lr_at(cfg.lr_schedule, cfg.optimizer.lr, new_total, s)
        if not math.isclose(old, new, rel_tol=1e-9, abs_tol=0.0):
            changed = _schedule_diff(saved, cfg)
            verb = "would be" if s >= step else "would have been (it is trained)"
            raise ResumeMismatch(
                f"{where} {changed}: the learning rate of step {s + 1} {verb} {new:.3g} "
                f"instead of {old:.3g}; resume with the checkpoint's settings, or pass "
                "--checkpoint.allow_schedule_change true to use the new schedule")


def _schedule_diff(saved: dict[str, Any], cfg: Config) -> str:
    parts = []
    if saved["training_steps"] != cfg.training.steps:
        parts.append(f"training.steps {saved['training_steps']} (this run: {cfg.training.steps})")
    if saved["lr"] != cfg.optimizer.lr:
        parts.append(f"optimizer.lr {saved['lr']} (this run: {cfg.optimizer.lr})")
    now = dataclasses.asdict(cfg.lr_schedule)
    parts += [f"lr_schedule.{k} {_show(v)} (this run: {_show(now[k])})"
              for k, v in saved["lr_schedule"].items() if k in now and now[k] != v]
    return ", ".join(parts) or "another learning-rate schedule"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
