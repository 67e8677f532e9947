"""How the one loader reads a `scaletrain finetune` output without importing fine-tuning code.

Such a directory holds `finetune.json` (its base model, method and task) next to an adapter, a
head or trained weights. The loader reads the base model itself; what the run added is applied
by the *fine-tuned format* that `scaletrain.finetune` provides and registers: through the
`scaletrain.finetuned_format` entry point of the installed package (found the first time a
fine-tuned output is loaded), or by `register_finetuned_format` (tests, other packages).
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

from torch import nn

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "scaletrain.finetuned_format"
FINETUNE_META = "finetune.json"
"""The file that marks a fine-tuned output (its base model, method and task). The loader looks
for it before any fine-tuned format is loaded, so it is this interface's, not the format's."""


class FinetunedFormat(Protocol):
    """What a fine-tuning package tells the loader about its outputs."""

    def base_of(self, meta: dict[str, Any]) -> str:
        """The model directory to load as the base of a run with `finetune.json` `meta`."""
        ...

    def check_base(self, meta: dict[str, Any], directory: Path, where: Path) -> None:
        """Raise ValueError when `directory` is not the base the run was trained on; `where`
        is the `finetune.json` to name in the message."""
        ...

    def apply(self, output: Path, meta: dict[str, Any], backbone: nn.Module,
              merge: bool) -> nn.Module:
        """The fine-tuned model: `output`'s adapter (merged into `backbone` when `merge`),
        head or trained weights put on the freshly loaded base `backbone`."""
        ...


_registered: FinetunedFormat | None = None


def register_finetuned_format(fmt: FinetunedFormat) -> None:
    """Make `fmt` the reader of fine-tuned outputs (replaces the one registered before)."""
    global _registered
    _registered = fmt


def finetuned_format() -> FinetunedFormat:
    """The registered reader, else the one the installed packages declare as entry point."""
    if _registered is None:
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            logger.debug("fine-tuned format from entry point %s", entry.value)
            register_finetuned_format(entry.load())
            break
    if _registered is None:
        raise ValueError(
            "this is a `scaletrain finetune` output, but no reader of fine-tuned outputs is "
            f"registered (entry point group {ENTRY_POINT_GROUP!r}): install scaletrain "
            "(pip install -e .) or import scaletrain.finetune.loading first")
    return _registered


__all__ = ["ENTRY_POINT_GROUP", "FINETUNE_META", "FinetunedFormat", "finetuned_format",
           "register_finetuned_format"]
