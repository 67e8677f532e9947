"""One checkpointer for everything with state: model, optimizer, LR schedule, data position,
RNG states and step, through torch.distributed.checkpoint (DCP; one process works too).

Layout: `<output>/checkpoints/step-0000100/` holds DCP shards plus `meta.json` (the native
format of `scaletrain.checkpoint.native_format`, so `generate` and `convert` read it) and
`manifest.json` (content hashes of every file, `scaletrain.checkpoint.integrity`). Each
checkpoint is written under a temporary name and renamed when complete; the last K are kept.
Loading verifies the hashes, reads DCP metadata through a restricted unpickler
(`scaletrain.checkpoint.safe_dcp`) and refuses non-finite state; non-finite state is never
saved.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from scaletrain.checkpoint import native_format
from scaletrain.checkpoint.integrity import (
    CheckpointError,
    NonFiniteStateError,
    checkpoint_files,
    describe_nonfinite,
    hash_files,
    nonfinite_entries,
    verification_enabled,
    verify_manifest,
    write_manifest,
)
from scaletrain.checkpoint.safe_dcp import load_dcp
from scaletrain.models.args import ModelArgs
from scaletrain.train.zero1 import PartitionedOptimizer

log = logging.getLogger("scaletrain.train")

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _gather(local: Any) -> list[Any]:
    """Every rank's `local` value, on every rank (just [local] in one process)."""
    if not _distributed():
        return [local]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def _agree(check: Callable[[], None]) -> None:
    """Run `check` on every rank; if it fails on any, raise the first failure on all of them
    (so no rank is left waiting in a collective)."""
    try:
        check()
        local = None
    except CheckpointError as e:
        local = (type(e).__name__, str(e))
    failed = [f for f in _gather(local) if f is not None]
    if failed:
        kind, msg = failed[0]
        raise (NonFiniteStateError if kind == NonFiniteStateError.__name__ else CheckpointError)(
            msg)


class Checkpointer:
    def __init__(self, folder: str | Path, keep_last: int, model_args: ModelArgs,
                 tokenizer_file: str | Path | None = None, verify: bool | None = None) -> None:
        self.folder = Path(folder)
        self.verify = verification_enabled(verify)
        """Check the manifest's content hashes before loading (checkpoint.verify)."""
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
        if isinstance(optimizer, torch.optim.Optimizer):
            model_sd, optim_sd = get_state_dict(model, optimizer)
        elif isinstance(optimizer, PartitionedOptimizer):  # name-keyed, owned entries only
            model_sd, optim_sd = get_model_state_dict(model), optimizer.state_dict()
        else:  # MasterWeightOptimizer keeps its own name-keyed state
            model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
        return {"model": model_sd, "optimizer": optim_sd, "extra": extra}

    def save(self, step: int, model: nn.Module, optimizer: Any, extra: dict[str, Any]) -> Path:
        """Write checkpoint `step` (temp dir, then rename) and prune old ones.

        State with NaN/inf values is never written (`NonFiniteStateError`). The manifest of
        content hashes is written last; with several ranks each hashes a share of the files.
        """
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        main = _is_main()  # with several processes rank 0 does the file work, all write shards
        state = self._state(model, optimizer, {**extra, "step": step})
        _agree(lambda: self._refuse_nonfinite(state, optimizer, step))
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, checkpoint_id=tmp)
        if main:
            tokenizer_name = None
            if self.tokenizer_file and self.tokenizer_file.is_file():
                tokenizer_name = "tokenizer.json"
                shutil.copyfile(self.tokenizer_file, tmp / tokenizer_name)
            native_format.write_meta(tmp, step, self.model_args, tokenizer_name)
        _barrier()
        rank, world = _world()
        entries: dict[str, Any] = {}
        for part in _gather(hash_files(tmp, checkpoint_files(tmp)[rank::world])):
            entries.update(part)
        if main:
            write_manifest(tmp, entries)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()
            log.info("saved checkpoint %s", final)
        _barrier()
        return final

    def _refuse_nonfinite(self, state: dict[str, Any], optimizer: Any, step: int) -> None:
        found = nonfinite_entries({k: v for k, v in state.items() if k != "extra"})
        if found:
            last = self.steps()
            kept = f"the last good checkpoint is {self.path(last[-1])}" if last else \
                "no earlier checkpoint exists"
            raise NonFiniteStateError(
                f"step {step}: the model/optimizer state holds {describe_nonfinite(found)}; no "
                f"checkpoint was written ({kept}). The run diverged: lower optimizer.lr or keep "
                "training.max_grad_norm on, then resume from that checkpoint")

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def load(self, path: str | Path, model: nn.Module, optimizer: Any,
             extra: dict[str, Any]) -> dict[str, Any]:
        """Load a checkpoint into `model` and `optimizer` in place; return its `extra` dict.

        `extra` is a template with the same keys and kinds of values as the saved one. The
        files are checked against the manifest (unless `verify` is off), `.metadata` is read
        through the restricted unpickler and the loaded state must be finite; any failure is
        one `CheckpointError` on every rank.
        """
        path = Path(path)
        remedy = (f"delete {path} to resume from the previous checkpoint, or start fresh "
                  "without --checkpoint.resume")
        if self.verify:
            rank, world = _world()
            _agree(lambda: verify_manifest(path, remedy, rank, world))
        meta = native_format.read_meta(path)  # clear error when missing or garbled
        saved_args = ModelArgs.from_dict(meta["model_args"])
        if saved_args != self.model_args:
            diff = ", ".join(
                f"{f.name} {getattr(saved_args, f.name)} (checkpoint) vs "
                f"{getattr(self.model_args, f.name)} (this run)"
                for f in dataclasses.fields(saved_args)
                if getattr(saved_args, f.name) != getattr(self.model_args, f.name))
            raise CheckpointError(
                f"{path / native_format.META_NAME} describes a different model than this run "
                f"builds ({diff}): resume with the model settings it was saved with")
        if hasattr(optimizer, "init_state"):
            optimizer.init_state()
        state = self._state(model, optimizer, {**extra, "step": 0})
        load_dcp(state, path, no_dist=not _distributed(), remedy=remedy)
        _agree(lambda: native_format.check_finite(
            {k: v for k, v in state.items() if k != "extra"}, path,
            "weights and optimizer state"))
        self._set_state(model, optimizer, state)
        log.info("resumed from %s (step %d)", path, state["extra"]["step"])
        return state["extra"]

    def _set_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        """Put loaded model and optimizer state (as `_state` lays it out) into place."""
        if isinstance(optimizer, torch.optim.Optimizer):
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        elif isinstance(optimizer, PartitionedOptimizer):
            set_model_state_dict(model, state["model"])
            optimizer.load_state_dict(state["optimizer"])
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
