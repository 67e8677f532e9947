"""The layout of a `scaletrain finetune` output directory: the names the fine-tuning trainer
writes and its readers (`finetune.loading`, `finetune.export`) open. The file that marks such
a directory, `finetune.json`, is named by the loader's interface
(`inference.finetuned.FINETUNE_META`): the loader looks for it before any fine-tuned format is
loaded."""

from __future__ import annotations

ADAPTER_DIR = "adapter"
"""The LoRA/QLoRA adapter of the run, in PEFT's on-disk format (`finetune.peft_io`)."""
