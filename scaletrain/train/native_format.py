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
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from scaletrain.models.args import ModelArgs
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
        raise FileNotFoundError(f"{path} not found: not a scaletrain native checkpoint")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (damaged checkpoint?): {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: 'format' must be {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{path}: version {meta.get('version')!r} is not supported (this scaletrain reads "
            f"version {VERSION})"
        )
    for key, kind in (("step", int), ("model_args", dict)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{path}: '{key}' must be a {kind.__name__}")
    tok = meta.get("tokenizer")
    if tok is not None and not isinstance(tok, str):
        raise ValueError(f"{path}: 'tokenizer' must be a file name or null")
    try:
        ModelArgs.from_dict(meta["model_args"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: invalid model_args: {e}") from None
    return meta


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; here we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process")
        yield


def _stored_keys(directory: Path) -> set[str]:
    """Fully qualified names ("model.layers.0...") of the entries a DCP checkpoint holds."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    except Exception as e:  # a truncated or foreign .metadata file
        raise ValueError(f"{directory / '.metadata'} is damaged: {e}") from None


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
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
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
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    meta = read_meta(directory)
    args = ModelArgs.from_dict(meta["model_args"])
    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(
            f"{directory / '.metadata'} not found: the DCP files of this checkpoint are missing"
        )
    model = empty_model(args, device=device, dtype=dtype)
    state = {"model": model.state_dict()}
    stored = _stored_keys(directory)
    missing = sorted(k for k in (f"model.{name}" for name in state["model"]) if k not in stored)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"{directory}: the checkpoint lacks {len(missing)} model tensor(s) that "
            f"{META_NAME}'s model_args need: {shown}"
        )
    with _single_process_dcp():
        try:
            dcp.load(state, checkpoint_id=directory, no_dist=True)
        except Exception as e:  # DCP wraps reader errors with every rank's traceback
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"{directory}: cannot read the model weights: {last}") from None
    tokenizer = None
    if meta.get("tokenizer"):
        tokenizer = directory / meta["tokenizer"]
        if not tokenizer.is_file():
            logger.warning("%s names tokenizer %s, which is missing", META_NAME, tokenizer)
            tokenizer = None
    logger.info("loaded native checkpoint %s (step %d)", directory, meta["step"])
    return model, args, tokenizer


__all__ = ["META_NAME", "write_meta", "read_meta", "save_model_checkpoint",
           "load_model_checkpoint"]
