"""The one inference layer: the loader (`loader`: any model directory -> model, tokenizer, chat
template, generation settings), the decoders (`generation`, `batch_decode`, `slot_decode` for
continuous batching, over `sampling`), the in-process generator with its stop handling
(`generators`) and the chat format (`chat`). `generate`, `serve`, `eval`, `predict` and
`data synth` sit on it; fine-tuned outputs are read through the interface
`scaletrain.finetune` registers (`finetuned`).

The loader's names are importable from here (lazily, so that `import scaletrain.inference.chat`
does not load torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_LOADER_NAMES = ("find_checkpoint", "hf_eos_id", "load_for_inference", "load_model",
                 "tokenizer_eos_id", "LoadedModel")


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        return getattr(importlib.import_module("scaletrain.inference.loader"), name)
    raise AttributeError(f"module 'scaletrain.inference' has no attribute {name!r}")


__all__ = list(_LOADER_NAMES)
