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
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

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
from scaletrain.checkpoint.safe_dcp import load_dcp, read_metadata
from scaletrain.models.args import ModelArgs
from scaletrain.train.optim_state import (
    positional_groups,
    positional_template,
    set_torch_state,
    torch_state,
)
from scaletrain.train.resume import write_run_settings
from scaletrain.train.zero1 import PartitionedOptimizer

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
# One process saves without a process group on purpose; DCP warns about it from its own
# background thread too, where a `catch_warnings` block of ours does not reach.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


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


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint of another run (another model): the checkpoints before it are of the
    same run, so `checkpoint.resume auto` does not fall back to them."""


class Checkpointer:
    def __init__(self, folder: str | Path, keep_last: int, model_args: ModelArgs,
                 tokenizer_file: str | Path | None = None, verify: bool | None = None,
                 async_save: bool = False) -> None:
        self.folder = Path(folder)
        self.verify = verification_enabled(verify)
        """Check the manifest's content hashes before loading (checkpoint.verify)."""
        self.keep_last = keep_last
        self.model_args = model_args
        self.tokenizer_file = Path(tokenizer_file) if tokenizer_file else None
        self.async_save = async_save
        self._pending: _BackgroundSave | None = None
        self._stager: Any = None
        self.async_group: Any = None
        if async_save and _distributed():  # the background write's own collectives
            self.async_group = dist.new_group(backend="gloo")

    def stager(self) -> Any:
        """One staging area in host memory, reused by every background save."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    # --- discovery -------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of complete checkpoints (those with meta.json), oldest first."""
        return self.steps_in(self.folder)

    @staticmethod
    def steps_in(folder: Path) -> list[int]:
        """Steps of the complete checkpoints in `folder`, oldest first."""
        if not folder.is_dir():
            return []
        found = []
        for d in folder.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and (d / "meta.json").is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def path(self, step: int) -> Path:
        return self.folder / self.dir_name(step)

    @staticmethod
    def dir_name(step: int) -> str:
        return f"step-{step:07d}"

    # --- save / load -----------------------------------------------------------------------
    def _state(self, model: nn.Module, optimizer: Any, extra: dict[str, Any],
               positional: bool = False) -> dict[str, Any]:
        """What DCP writes and reads: every optimizer entry and group setting keyed by
        parameter name (`train.optim_state`); `positional`: laid out as a checkpoint from before
        name-keyed group settings stores them, to load one."""
        if isinstance(optimizer, torch.optim.Optimizer):
            model_sd, optim_sd = torch_state(model, optimizer, positional)
        else:  # PartitionedOptimizer (owned entries only), MasterWeightOptimizer: name-keyed
            model_sd = (get_model_state_dict(model) if isinstance(optimizer, PartitionedOptimizer)
                        else model.state_dict())
            optim_sd = optimizer.state_dict()
            if positional:
                optim_sd = positional_template(optim_sd, optimizer.group_names())
        return {"model": model_sd, "optimizer": optim_sd, "extra": extra}

    def save(self, step: int, model: nn.Module, optimizer: Any, extra: dict[str, Any],
             run: dict[str, Any] | None = None) -> Path:
        """Write checkpoint `step` (temp dir, then rename) and prune old ones; `run`: the run's
        settings for `run.json` (`train.resume`).

        State with NaN/inf values is never written (`NonFiniteStateError`). The manifest of
        content hashes is written last; with several ranks each hashes a share of the files.
        With `async_save` this returns once the state is copied to host memory; the files are
        written in the background, and the checkpoint is complete (renamed from its temporary
        name) when `wait()` returns. A save first waits for the previous one.
        """
        self.wait()
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        main = _is_main()  # with several processes rank 0 does the file work, all write shards
        state = self._state(model, optimizer, {**extra, "step": step})
        _agree(lambda: self._refuse_nonfinite(state, optimizer, step))
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        if self.async_save:
            self._pending = _BackgroundSave(self, step, tmp, final, state, run)
            return final
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, checkpoint_id=tmp)
        if main:
            self._write_side_files(tmp, step, run)
        _barrier()
        rank, world = _world()
        entries: dict[str, Any] = {}
        for part in _gather(hash_files(tmp, checkpoint_files(tmp)[rank::world])):
            entries.update(part)
        if main:
            self._publish(tmp, final, entries)
        _barrier()
        return final

    def wait(self) -> Path | None:
        """Finish the background save in flight (every rank calls it at the same point);
        return its checkpoint (None when none was in flight). A failed write is a
        `CheckpointError`; the previous checkpoints stay as they were."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = pending.join()
        failed = [e for e in _gather(error) if e]
        if failed:
            raise CheckpointError(f"writing checkpoint {pending.final} failed: {failed[0]}")
        return pending.final

    def close(self) -> None:
        """Release the staging memory. On the way out of a run: a background save still in
        flight (only when the run failed, as a finished run `wait`s) is left to end with the
        process, without collectives that the failed peer would never join; its temporary
        directory is never taken for a checkpoint."""
        self._pending = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _write_side_files(self, tmp: Path, step: int, run: dict[str, Any] | None) -> None:
        """The tokenizer, meta.json and run.json (rank 0)."""
        tokenizer_name = None
        if self.tokenizer_file and self.tokenizer_file.is_file():
            tokenizer_name = "tokenizer.json"
            shutil.copyfile(self.tokenizer_file, tmp / tokenizer_name)
        native_format.write_meta(tmp, step, self.model_args, tokenizer_name)
        if run is not None:
            write_run_settings(tmp, run)

    def _publish(self, tmp: Path, final: Path, entries: dict[str, Any] | None) -> None:
        """Manifest last, then the rename that makes the checkpoint complete (rank 0)."""
        write_manifest(tmp, entries)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        self._prune()
        log.info("saved checkpoint %s", final)

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
                  "with --checkpoint.resume false")
        meta = native_format.read_meta(path)  # clear error when missing or garbled
        saved_args = ModelArgs.from_dict(meta["model_args"])
        if saved_args != self.model_args:  # before the hashes: a mismatch is not damage
            diff = ", ".join(
                f"{f.name} {getattr(saved_args, f.name)} (checkpoint) vs "
                f"{getattr(self.model_args, f.name)} (this run)"
                for f in dataclasses.fields(saved_args)
                if getattr(saved_args, f.name) != getattr(self.model_args, f.name))
            raise CheckpointMismatch(
                f"{path / native_format.META_NAME} describes a different model than this run "
                f"builds ({diff}): resume with the model settings it was saved with")
        if self.verify:
            rank, world = _world()
            _agree(lambda: verify_manifest(path, remedy, rank, world))
        if hasattr(optimizer, "init_state"):
            optimizer.init_state()
        positional = positional_groups(read_metadata(path).state_dict_metadata)
        state = self._state(model, optimizer, {**extra, "step": 0}, positional)
        load_dcp(state, path, no_dist=not _distributed(), remedy=remedy)
        _agree(lambda: native_format.check_finite(
            {k: v for k, v in state.items() if k != "extra"}, path,
            "weights and optimizer state"))
        self._set_state(model, optimizer, state, positional)
        log.info("resumed from %s (step %d)", path, state["extra"]["step"])
        return state["extra"]

    def _set_state(self, model: nn.Module, optimizer: Any, state: dict[str, Any],
                   positional: bool = False) -> None:
        """Put loaded model and optimizer state (as `_state` lays it out) into place."""
        if isinstance(optimizer, torch.optim.Optimizer):
            set_torch_state(model, optimizer, state, positional)
        elif isinstance(optimizer, PartitionedOptimizer):
            set_model_state_dict(model, state["model"])
            optimizer.load_state_dict(state["optimizer"])
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])


class _BackgroundSave:
    """One checkpoint written by `dcp.async_save`: the state is staged (copied to host memory)
    here, the files are written by DCP's thread; then rank 0 alone writes meta.json, run.json
    and the manifest (hashing every file) and renames the directory, in a thread of its own.
    A process killed meanwhile leaves only the temporary directory."""

    def __init__(self, owner: Checkpointer, step: int, tmp: Path, final: Path,
                 state: dict[str, Any], run: dict[str, Any] | None) -> None:
        self.owner, self.step, self.tmp, self.final, self.run = owner, step, tmp, final, run
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            response = dcp.async_save(state, checkpoint_id=tmp, async_stager=owner.stager(),
                                      process_group=owner.async_group,
                                      no_dist=not _distributed())
        self.future = getattr(response, "upload_completion", response)
        self.error: str | None = None
        self.thread = threading.Thread(target=self._finish, daemon=True,
                                       name=f"checkpoint-{step}")
        self.thread.start()

    def _finish(self) -> None:
        try:
            self.future.result()
            if _is_main():
                self.owner._write_side_files(self.tmp, self.step, self.run)
                self.owner._publish(self.tmp, self.final, None)
        except BaseException as e:  # reported by `join` on the training thread
            self.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]

    def join(self) -> str | None:
        self.thread.join()
        return self.error
