"""One checkpointer for everything with state: model, optimizer, LR schedule, data position,
RNG states and step, through torch.distributed.checkpoint (DCP; one process works too).

Layout: `<output>/checkpoints/step-0000100/` holds DCP shards plus `meta.json` (the native
format of `scaletrain.train.native_format`, so `generate` and `convert` read it). Each
checkpoint is written under a temporary name and renamed when complete; the last K are kept.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from scaletrain.models.args import ModelArgs
from scaletrain.train import native_format

log = logging.getLogger("scaletrain.train")

_STEP_DIR = re.compile(r"^step-(\d+)$")
ZERO1_FILE = "zero1_optimizer.pt"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not match the run."""


def _root_cause(e: BaseException) -> str:
    """One line naming what failed, without DCP's per-rank tracebacks."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return f"{type(e).__name__}: {e}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, folder: str | Path, keep_last: int, model_args: ModelArgs,
                 tokenizer_file: str | Path | None = None) -> None:
        self.folder = Path(folder)
        self.keep_last = keep_last
        self.model_args = model_args
        self.tokenizer_file = Path(tokenizer_file) if tokenizer_file else None

    # --- discovery -------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of complete checkpoints (those with meta.json), oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for d in self.folder.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and (d / "meta.json").is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step:07d}"

    # --- save / load -----------------------------------------------------------------------
    def _state(self, model: nn.Module, optimizer: Any, extra: dict[str, Any]) -> dict[str, Any]:
        if isinstance(optimizer, ZeroRedundancyOptimizer):  # saved apart, consolidated
            return {"model": get_model_state_dict(model), "extra": extra}
        if isinstance(optimizer, torch.optim.Optimizer):
            model_sd, optim_sd = get_state_dict(model, optimizer)
        else:  # MasterWeightOptimizer keeps its own name-keyed state
            model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
        return {"model": model_sd, "optimizer": optim_sd, "extra": extra}

    def save(self, step: int, model: nn.Module, optimizer: Any, extra: dict[str, Any]) -> Path:
        """Write checkpoint `step` (temp dir, then rename) and prune old ones."""
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        main = _is_main()  # with several processes rank 0 does the file work, all write shards
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state = self._state(model, optimizer, {**extra, "step": step})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, checkpoint_id=tmp)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)
            if main:
                torch.save(optimizer.state_dict(), tmp / ZERO1_FILE)
        if not main:
            _barrier()
            return final
        tokenizer_name = None
        if self.tokenizer_file and self.tokenizer_file.is_file():
            tokenizer_name = "tokenizer.json"
            shutil.copyfile(self.tokenizer_file, tmp / tokenizer_name)
        native_format.write_meta(tmp, step, self.model_args, tokenizer_name)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        self._prune()
        log.info("saved checkpoint %s", final)
        _barrier()
        return final

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def load(self, path: str | Path, model: nn.Module, optimizer: Any,
             extra: dict[str, Any]) -> dict[str, Any]:
        """Load a checkpoint into `model` and `optimizer` in place; return its `extra` dict.

        `extra` is a template with the same keys and kinds of values as the saved one.
        """
        path = Path(path)
        meta = native_format.read_meta(path)  # clear error when missing or garbled
        saved_args = ModelArgs.from_dict(meta["model_args"])
        if saved_args != self.model_args:
            raise CheckpointError(
                f"{path}: checkpoint was written for a different model ({saved_args}); "
                f"this run builds {self.model_args}"
            )
        if hasattr(optimizer, "init_state"):
            optimizer.init_state()
        state = self._state(model, optimizer, {**extra, "step": 0})
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(state, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            raise CheckpointError(
                f"{path}: cannot load checkpoint ({_root_cause(e)}); it may be damaged: "
                "delete it to resume from an earlier one"
            ) from None
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            self._set_zero1_state(path, model, optimizer, state)
        else:
            self._set_state(model, optimizer, state)
        log.info("resumed from %s (step %d)", path, state["extra"]["step"])
        return state["extra"]

    def _set_zero1_state(self, path: Path, model: nn.Module,
                         optimizer: ZeroRedundancyOptimizer, state: dict[str, Any]) -> None:
        """The model from DCP; the optimizer from this rank's own file of the partitioned state."""
        set_model_state_dict(model, state["model"])
        zero1 = path / ZERO1_FILE
        if zero1.is_file():  # each rank keeps its own partition of the full state
            optimizer.load_state_dict(torch.load(zero1, weights_only=False))
        else:
            log.warning("%s has no ZeRO-1 optimizer state: optimizer starts fresh", path)

    def _set_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        """Put loaded model and optimizer state (as `_state` lays it out) into place."""
        if isinstance(optimizer, torch.optim.Optimizer):
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
