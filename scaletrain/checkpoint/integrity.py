"""Checkpoint integrity: a manifest of content hashes written at save and checked at load, and
the finite-value check of loaded or about-to-be-saved state.

`manifest.json` (written last, inside the checkpoint directory) =
  {"format": "scaletrain-manifest", "version": 1, "hash": "xxh3_128",
   "files": {"<relative path>": {"bytes": N, "xxh3_128": "<hex>"}, ...}}
It covers every other file of the checkpoint. Hashes detect damage (bit flips, truncation,
partial copies); they do not authenticate a checkpoint: whoever can change the files can
change the manifest too. Safety against hostile files comes from `safe_dcp` (nothing loaded
from a checkpoint can execute code).

Verification is on by default; `checkpoint.verify false` (train, finetune), `--no-verify`
(the other verbs) or `SCALETRAIN_VERIFY_CHECKPOINTS=0` turns it off, e.g. for huge
checkpoints on trusted storage.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT = "scaletrain-manifest"
VERSION = 1
HASH = "xxh3_128"
_CHUNK = 8 << 20
VERIFY_ENV = "SCALETRAIN_VERIFY_CHECKPOINTS"
_verify: contextvars.ContextVar[bool | None] = contextvars.ContextVar("verify", default=None)


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint that is missing, damaged, unsafe or does not match the run; the message
    names the file and what to do. (A ValueError too, so every verb reports it as bad input.)"""


class NonFiniteStateError(CheckpointError):
    """The state about to be saved holds NaN or infinite values: no checkpoint is written."""


# --- the setting -----------------------------------------------------------------------------
def verification_enabled(explicit: bool | None = None) -> bool:
    """Whether checkpoint loads check hashes: off when any setting says off (`explicit`, the
    innermost `verification(False)` block, or SCALETRAIN_VERIFY_CHECKPOINTS=0), else on."""
    if explicit is False or _verify.get() is False:
        return False
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def verification(enabled: bool | None) -> Iterator[None]:
    """Within the block, `enabled=False` turns hash verification off (True/None: no change)."""
    token = _verify.set(enabled)
    try:
        yield
    finally:
        _verify.reset(token)


# --- hashing ---------------------------------------------------------------------------------
def file_hash(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    """Relative paths of the files a manifest covers (all but the manifest), sorted."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST_NAME)


def hash_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (directory / n).stat().st_size, HASH: file_hash(directory / n)}
            for n in names}


def write_manifest(directory: str | os.PathLike,
                   entries: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write `manifest.json` for every file of `directory` (`entries`: hashes already taken,
    e.g. by several ranks; otherwise computed here). Call it after the last file is written."""
    directory = Path(directory)
    if entries is None:
        entries = hash_files(directory, checkpoint_files(directory))
    manifest = {"format": FORMAT, "version": VERSION, "hash": HASH,
                "files": dict(sorted(entries.items()))}
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def manifest_hash(directory: str | os.PathLike) -> str | None:
    """`xxh3_128:<hex>` of the checkpoint's manifest.json (one hash that pins every file)."""
    path = Path(directory) / MANIFEST_NAME
    return f"{HASH}:{file_hash(path)}" if path.is_file() else None


def checkpoint_fingerprint(directory: str | os.PathLike) -> str:
    """A content hash that identifies a checkpoint: its manifest hash (native), or for a
    directory without manifest (Hugging Face) a hash over the hashes of its files."""
    directory = Path(directory)
    found = manifest_hash(directory)
    if found is not None:
        return found
    h = xxhash.xxh3_128()
    for name in checkpoint_files(directory):
        if name.endswith((".json", ".safetensors", ".jinja", ".model", ".txt")):
            h.update(f"{name}\0{file_hash(directory / name)}\0".encode())
    return f"{HASH}-files:{h.hexdigest()}"


def _read_manifest(path: Path, remedy: str) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: the checkpoint cannot be verified (it was copied incompletely or "
            "written by an older scaletrain); if you trust its files, load it with verification "
            "off (--no-verify, or --checkpoint.verify false for train/finetune)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        ok = (manifest.get("format") == FORMAT and manifest.get("hash") == HASH
              and isinstance(files, dict)
              and all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                      and isinstance(v.get(HASH), str) for v in files.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is damaged (not a {FORMAT} v{VERSION} file with {HASH} "
                              f"hashes): {remedy}")
    return files


def verify_files(directory: Path, names: list[str], expected: dict[str, dict[str, Any]],
                 remedy: str) -> None:
    """Check `names` against their manifest entries; the first mismatch raises."""
    for name in names:
        want = expected[name]
        path = directory / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise CheckpointError(f"{directory / MANIFEST_NAME} lists a path outside the "
                                  f"checkpoint ({name}): {remedy}")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in {MANIFEST_NAME}): the checkpoint "
                                  f"is incomplete; {remedy}")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes but {MANIFEST_NAME} records "
                                  f"{want['bytes']} (truncated or damaged file): {remedy}")
        if file_hash(path) != want[HASH]:
            raise CheckpointError(f"{path} does not match its {HASH} hash in {MANIFEST_NAME} "
                                  f"(the file is damaged or was changed after saving): {remedy}")


def verify_manifest(directory: str | os.PathLike, remedy: str, rank: int = 0,
                    world: int = 1) -> None:
    """Raise `CheckpointError` unless every file in the manifest is present and intact.

    With several ranks each checks every `world`-th file (rank `rank`); the caller combines
    the outcomes. Files the manifest does not list are ignored (loaders read only listed ones:
    `.metadata` and `meta.json` are listed, and they name everything else that is read).
    """
    directory = Path(directory)
    expected = _read_manifest(directory / MANIFEST_NAME, remedy)
    for needed in (".metadata", "meta.json"):
        if needed not in expected and (directory / needed).exists():
            raise CheckpointError(f"{directory / MANIFEST_NAME} does not list {needed}: the "
                                  f"manifest does not belong to this checkpoint; {remedy}")
    names = sorted(expected)[rank::world]
    verify_files(directory, names, expected, remedy)


# --- finite values ---------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: this rank's shard
    return to_local() if callable(to_local) else t


def _float_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        t = _local(tree)
        if (t.is_floating_point() or t.is_complex()) and t.device.type != "meta" and t.numel():
            yield prefix, t.detach()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _float_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _float_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def nonfinite_entries(tree: Any, prefix: str = "") -> list[tuple[str, int, int]]:
    """(name, non-finite count, size) of every floating tensor in a nested state dict that
    holds NaN or infinite values (for DTensors: in this rank's shard). One fused pass and one
    host sync per device: a tensor's largest magnitude is finite exactly when all its values
    are (NaN propagates, and it cannot overflow as a sum can); only tensors that fail it are
    counted element by element."""
    named = list(_float_tensors(tree, prefix))
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    counts = [0] * len(named)
    for idx in by_device.values():
        peaks = torch._foreach_norm([named[i][1] for i in idx], float("inf"))
        finite = torch.isfinite(torch.stack(peaks)).tolist()
        for i, ok in zip(idx, finite):
            if not ok:
                counts[i] = int((~torch.isfinite(named[i][1])).sum())
    return [(name, c, t.numel()) for (name, t), c in zip(named, counts) if c]


def describe_nonfinite(found: list[tuple[str, int, int]]) -> str:
    shown = ", ".join(f"{name} ({bad} of {n})" for name, bad, n in found[:3])
    more = f" and {len(found) - 3} more tensors" if len(found) > 3 else ""
    return f"NaN/inf values in {shown}{more}"


__all__ = ["MANIFEST_NAME", "CheckpointError", "NonFiniteStateError", "verification",
           "verification_enabled", "write_manifest", "verify_manifest", "manifest_hash",
           "checkpoint_fingerprint", "hash_files", "checkpoint_files", "nonfinite_entries",
           "describe_nonfinite", "file_hash"]
