"""The scaletrain "native" checkpoint: a directory of torch.distributed.checkpoint (DCP) files
plus `meta.json`.

Contract shared with the trainer's checkpointer:

- `meta.json` = {"format": "scaletrain-native", "version": 1, "step": int,
  "model_args": ModelArgs.to_dict(), "tokenizer": file name relative to the directory or null}
- DCP files where the model's state dict sits under the top-level key "model"
  (`dcp.save({"model": model.state_dict(), ...}, checkpoint_id=dir)`); other top-level keys
  (optimizer, scheduler, data loader, RNG) may be present and are ignored here.

The helpers in this module run in one process (conversion, inference); the trainer saves
distributed checkpoints itself under the same contract.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.integrity import (
    CheckpointError,
    NonFiniteStateError,
    describe_nonfinite,
    nonfinite_entries,
    verification_enabled,
    verify_manifest,
    write_manifest,
)
from scaletrain.checkpoint.safe_dcp import DAMAGED, load_dcp, read_metadata
from scaletrain.models.args import ModelArgs
from scaletrain.models.files import honour_umask, make_output_dir
from scaletrain.models.stored_shapes import Manifest, ManifestMismatch, check_stored_shapes
from scaletrain.models.transformer import Transformer, empty_model

logger = logging.getLogger(__name__)

META_NAME = "meta.json"
FORMAT = "scaletrain-native"
VERSION = 1


def write_meta(
    directory: str | os.PathLike, step: int, args: ModelArgs, tokenizer: str | None
) -> Path:
    """Write `meta.json` into `directory` (which must exist); `tokenizer` is a relative name."""
    path = Path(directory) / META_NAME
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "model_args": args.to_dict(),
        "tokenizer": tokenizer,
    }
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """The validated `meta.json` of a native checkpoint, with errors that name the file."""
    path = Path(directory) / META_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} not found: not a scaletrain native checkpoint (give the "
                              "checkpoint directory, a run directory or a Hugging Face folder)")
    fix = f"restore {path} from a good copy of the checkpoint"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON (damaged checkpoint?): {e}; {fix}"
                              ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: 'format' must be {FORMAT!r}; {fix}")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: version {meta.get('version')!r} is not supported (this scaletrain reads "
            f"version {VERSION})"
        )
    for key, kind in (("step", int), ("model_args", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{path}: '{key}' must be a {kind.__name__}; {fix}")
    tok = meta.get("tokenizer")
    if tok is not None and (not isinstance(tok, str) or len(Path(tok).parts) != 1
                            or tok in ("..", ".")):
        raise CheckpointError(f"{path}: 'tokenizer' must be a file name in the checkpoint or "
                              f"null; {fix}")
    try:
        ModelArgs.from_dict(meta["model_args"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model_args: {e}; {fix}") from None
    return meta


def open_checkpoint(directory: str | os.PathLike, verify: bool | None = None,
                    remedy: str = DAMAGED) -> dict[str, Any]:
    """Every check before tensors are read: the manifest's hashes (unless verification is off),
    `meta.json`, and `.metadata` through the restricted unpickler. Returns the meta."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint directory")
    if verification_enabled(verify):
        verify_manifest(directory, remedy)
    meta = read_meta(directory)
    read_metadata(directory)
    return meta


_CHECKED_FIELDS = ("n_layers", "vocab_size", "dim", "max_seq_len", "n_experts", "ffn_dim",
                   "moe_ffn_dim")


def checked_model_args(directory: str | os.PathLike, meta: dict[str, Any]) -> ModelArgs:
    """`meta`'s model_args (`read_meta`), checked against the tensor shapes `.metadata` stores
    before anything is built (`models.stored_shapes`): a manifest whose sizes the weights do not
    have is refused in milliseconds, one CheckpointError line."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(directory)
    args = ModelArgs.from_dict(meta["model_args"])
    stored = {key.removeprefix("model."): tuple(value.size)
              for key, value in read_metadata(directory).state_dict_metadata.items()
              if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}
    manifest = Manifest(directory / META_NAME, ".metadata",
                        {name: f"model_args.{name}" for name in _CHECKED_FIELDS})
    try:
        check_stored_shapes(stored, args, manifest)
    except ManifestMismatch as e:
        raise CheckpointError(str(e)) from None
    return args


def check_finite(state: Any, directory: str | os.PathLike, what: str = "weights") -> None:
    """Refuse loaded state with NaN/inf values (a damaged or diverged checkpoint)."""
    found = nonfinite_entries(state)
    if found:
        raise CheckpointError(
            f"{directory}: the loaded {what} hold {describe_nonfinite(found)}; the checkpoint is "
            "damaged or was saved by a diverged run: use an earlier checkpoint")


def load_state(state: dict[str, Any], directory: str | os.PathLike, verify: bool | None = None
               ) -> dict[str, Any]:
    """Load `state` (e.g. {"model": model.state_dict()}) from a native checkpoint in one
    process, in place, verified and safely; returns the checkpoint's meta."""
    meta = open_checkpoint(directory, verify)
    load_dcp(state, directory, no_dist=True)
    check_finite(state, directory)
    return meta


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; here we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process")
        yield


def save_model_checkpoint(
    model: Transformer,
    args: ModelArgs,
    directory: str | os.PathLike,
    tokenizer_file: str | os.PathLike | None = None,
    step: int = 0,
) -> Path:
    """Save `model` as a native checkpoint in `directory` (which must not exist yet).

    Written to a temporary sibling directory and renamed, so an interrupted save leaves nothing
    that looks complete. The tokenizer file, when given, is copied in.
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} already exists; choose a new output directory")
    found = nonfinite_entries(model.state_dict())
    if found:
        raise NonFiniteStateError(f"the model holds {describe_nonfinite(found)}: refusing to "
                                  f"write {directory}")
    tmp = make_output_dir(directory)
    try:
        with _single_process_dcp():
            dcp.save({"model": model.state_dict()}, checkpoint_id=tmp, no_dist=True)
        tok_name = None
        if tokenizer_file is not None:
            tok_name = Path(tokenizer_file).name
            if tok_name == META_NAME or tok_name.endswith(".distcp"):
                tok_name = "tokenizer.json"
            shutil.copyfile(tokenizer_file, tmp / tok_name)
        write_meta(tmp, step, args, tok_name)
        write_manifest(tmp)
        honour_umask(tmp)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved native checkpoint %s (step %d)", directory, step)
    return directory


def load_model_checkpoint(
    directory: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, ModelArgs, Path | None]:
    """Load the model from a native checkpoint: (model, args, tokenizer path or None).

    Only the "model" entry is read, so checkpoints that also hold optimizer state load too.
    """
    directory = Path(directory)
    meta = open_checkpoint(directory)
    args = checked_model_args(directory, meta)
    model = empty_model(args, device=device, dtype=dtype)
    state = {"model": model.state_dict()}
    load_dcp(state, directory, no_dist=True)
    check_finite(state, directory)
    tokenizer = None
    if meta.get("tokenizer"):
        tokenizer = directory / meta["tokenizer"]
        if not tokenizer.is_file():
            logger.warning("%s names tokenizer %s, which is missing", META_NAME, tokenizer)
            tokenizer = None
    logger.info("loaded native checkpoint %s (step %d)", directory, meta["step"])
    return model, args, tokenizer


__all__ = ["META_NAME", "write_meta", "read_meta", "open_checkpoint", "checked_model_args",
           "load_state", "check_finite", "save_model_checkpoint", "load_model_checkpoint",
           "CheckpointError"]
