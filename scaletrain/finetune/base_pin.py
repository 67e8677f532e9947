"""Pin a fine-tune to the exact base checkpoint it was trained on.

`finetune.json` records `base_checkpoint` (the checkpoint directory the weights came from, not
the run directory, which may later gain newer checkpoints) and `base_fingerprint` (its manifest
hash; for a Hugging Face base a hash over its files). Applying an adapter to a base whose
fingerprint differs is refused unless `--allow-base-mismatch` (or
`finetune.allow_base_mismatch`) says otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.integrity import checkpoint_fingerprint
from scaletrain.finetune.base import FinetuneError

log = logging.getLogger(__name__)

ALLOW_ENV = "SCALETRAIN_ALLOW_BASE_MISMATCH"
_allow: contextvars.ContextVar[bool | None] = contextvars.ContextVar("allow_base_mismatch",
                                                                     default=None)
ADAPTER_METHODS = ("lora", "qlora")


@contextlib.contextmanager
def base_mismatch_allowed(enabled: bool | None) -> Iterator[None]:
    """Within the block, adapters load onto a changed base with a warning instead of an error."""
    token = _allow.set(enabled)
    try:
        yield
    finally:
        _allow.reset(token)


def base_record(directory: str | Path) -> dict[str, str]:
    """The `finetune.json` fields that pin the base checkpoint `directory`."""
    directory = Path(directory).resolve()
    return {"base_checkpoint": str(directory),
            "base_fingerprint": checkpoint_fingerprint(directory)}


def base_path(meta: dict[str, Any]) -> str:
    """What to load as the base: the exact checkpoint when recorded, else (older runs) `base`."""
    return meta.get("base_checkpoint") or meta["base"]


def check_base(meta: dict[str, Any], directory: str | Path, where: str | Path,
               allow: bool | None = None) -> None:
    """Refuse to put this fine-tune's trained weights on base `directory` when it is not the
    checkpoint they were trained on. `where`: the finetune.json named in the message."""
    if meta.get("method") not in ADAPTER_METHODS:
        return  # full/freeze runs load all their weights from their own checkpoint
    want = meta.get("base_fingerprint")
    if want is None:
        log.warning("%s records no base fingerprint (older scaletrain): cannot check that the "
                    "base is the one the adapter was trained on", where)
        return
    got = checkpoint_fingerprint(directory)
    if got == want:
        return
    if allow is None:
        allow = _allow.get()
    if allow is None:  # worker threads and processes of a verb see the environment
        allow = os.environ.get(ALLOW_ENV, "") == "1"
    msg = (f"{where}: the adapter was trained on base {meta.get('base_checkpoint')} ({want}) but "
           f"the base at {Path(directory).resolve()} is {got}: its weights differ")
    if allow:
        log.warning("%s; applying the adapter anyway (--allow-base-mismatch)", msg)
        return
    raise FinetuneError(f"{msg}, so the adapter would change a different model. Restore that "
                        "base checkpoint, or pass --allow-base-mismatch (finetune: "
                        "--finetune.allow_base_mismatch true) to apply it anyway")


__all__ = ["base_record", "base_path", "check_base", "base_mismatch_allowed"]
