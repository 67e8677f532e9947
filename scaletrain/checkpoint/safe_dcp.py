"""Reading torch.distributed.checkpoint (DCP) files without executing anything they contain.

DCP's `.metadata` file is a pickle, and DCP's default planner unpickles non-tensor entries
with `torch.load(weights_only=False)`: a hostile checkpoint could run code on load. Here:

- `SafeFileSystemReader` reads `.metadata` through `MetadataUnpickler`, which admits only the
  DCP metadata classes and the few torch/pathlib objects they reference; anything else is
  refused before it is built. The metadata is then checked (types, file names inside the
  checkpoint directory).
- `SafeLoadPlanner` unpickles non-tensor entries with `torch.load(weights_only=True)` and
  checks, before any tensor is read, that the checkpoint holds every entry the caller asked for
  with the same shape (a clear error instead of DCP's size assertion).
- `load_dcp` runs `dcp.load` with both and turns every failure into one `CheckpointError`
  line naming the file and what to do.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from scaletrain.checkpoint.integrity import CheckpointError

log = logging.getLogger(__name__)

METADATA_NAME = ".metadata"
DAMAGED = "restore the checkpoint from a good copy, or delete it"
_UNSAFE = ("loading it could run code; do not load checkpoints from sources you do not trust, "
           "and obtain this one again from its original source")

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # maps a layout name to a torch.layout
    "pathlib": {"PosixPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class UnsafePickle(pickle.UnpicklingError):
    """A pickle that references something the DCP metadata never holds."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: every global outside the allow-list is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickle(f"{module}.{name}")


def _check_metadata(md: Any) -> str | None:
    """What is wrong with unpickled metadata, or None."""
    if not isinstance(md, dcp_metadata.Metadata):
        return f"it holds a {type(md).__name__}, not DCP Metadata"
    if not isinstance(md.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    for key, value in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(
                value, (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata)):
            return f"entry {key!r} is not DCP storage metadata"
    if not isinstance(md.storage_data, dict):
        return "storage_data is not a dict"
    for info in md.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            return "storage_data holds something other than file locations"
        rel = Path(info.relative_path)
        if rel.is_absolute() or len(rel.parts) != 1 or rel.name in ("..", "."):
            return f"it points outside the checkpoint directory ({info.relative_path!r})"
        if not (isinstance(info.offset, int) and isinstance(info.length, int)
                and info.offset >= 0 and info.length >= 0):
            return f"a bad byte range in {info.relative_path}"
    return None


def read_metadata(directory: str | Path) -> dcp_metadata.Metadata:
    """The DCP metadata of `directory`, unpickled safely and checked."""
    path = Path(directory) / METADATA_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the DCP files of this checkpoint are missing; "
                              f"{DAMAGED}")
    try:
        with path.open("rb") as f:
            md = MetadataUnpickler(f).load()
    except UnsafePickle as e:
        raise CheckpointError(f"{path} refers to {e}, which DCP metadata never holds: refused "
                              f"to load it ({_UNSAFE})") from None
    except Exception as e:  # truncated or garbled: EOFError, UnpicklingError, ValueError, ...
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e}); "
                              f"{DAMAGED}") from None
    problem = _check_metadata(md)
    if problem:
        raise CheckpointError(f"{path} is not valid DCP metadata ({problem}); {DAMAGED}")
    return md


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata goes through `read_metadata` (restricted unpickler)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files are not ours
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not supported")
        md = read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _numpy_globals() -> list[Any]:
    """What `np.random.get_state()` (saved in the trainer's RNG state) pickles to."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with weights-only unpickling and shape checks up front."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def set_up_planner(self, state_dict: Any, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        stored = self.metadata.state_dict_metadata
        missing = sorted(k for k in self.state_dict if k not in stored)
        if missing:
            shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise CheckpointError(
                f"{self.directory} lacks {len(missing)} entr{'y' if len(missing) == 1 else 'ies'}"
                f" that this model needs ({shown}): meta.json does not describe these weights, "
                "or the checkpoint is of another model")
        for key, value in self.state_dict.items():
            meta = stored[key]
            if isinstance(value, torch.Tensor):
                if not isinstance(meta, dcp_metadata.TensorStorageMetadata):
                    raise CheckpointError(f"{self.directory}: {key} is stored as bytes, not a "
                                          "tensor; the checkpoint is of another kind")
                if tuple(meta.size) != tuple(value.size()):
                    raise CheckpointError(
                        f"{self.directory}: {key} is stored with shape {list(meta.size)} but the "
                        f"model needs {list(value.size())}: meta.json's model_args do not match "
                        "the weights (wrong model shape)")

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(_numpy_globals()):
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"{self.directory}: entry {read_item.dest_index.fqn} holds objects other than "
                    f"plain data: refused to load it ({_UNSAFE}) [{str(e).splitlines()[0]}]"
                ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def root_cause(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's `CheckpointException` (or `e` itself)."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


@contextlib.contextmanager
def _quiet_dcp_logger() -> Iterator[None]:
    """DCP logs every failed load with its traceback; the failure is reported once, by us."""
    try:
        from torch.distributed.checkpoint.logger import _dcp_logger as dcp_log
    except ImportError:  # another torch version: nothing to silence
        yield
        return
    before = dcp_log.disabled
    dcp_log.disabled = True
    try:
        yield
    finally:
        dcp_log.disabled = before


def load_dcp(state: dict[str, Any], directory: str | Path, no_dist: bool = False,
             remedy: str = DAMAGED) -> None:
    """`dcp.load(state)` from `directory` in place, safely; failures -> one CheckpointError."""
    directory = Path(directory)
    read_metadata(directory)  # refuse bad metadata before DCP logs its fallbacks
    try:
        with warnings.catch_warnings(), _quiet_dcp_logger():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
            dcp.load(state, checkpoint_id=directory, no_dist=no_dist,
                     storage_reader=SafeFileSystemReader(directory),
                     planner=SafeLoadPlanner(directory))
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        cause = root_cause(e)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from None
        text = str(cause).strip().splitlines()
        raise CheckpointError(
            f"{directory}: cannot read the checkpoint ({type(cause).__name__}: "
            f"{text[-1] if text else ''}); it may be damaged: {remedy}") from None


__all__ = ["MetadataUnpickler", "SafeFileSystemReader", "SafeLoadPlanner", "read_metadata",
           "load_dcp", "root_cause", "METADATA_NAME"]
