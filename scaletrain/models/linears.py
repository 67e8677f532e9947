"""The linear projections of one decoder block, by short name -> module path in the block.

One table for what LoRA can target (`finetune.lora`) and what the fine-tuning plan counts
(`plan.finetune.estimate`), so the two cannot drift apart.
"""

from __future__ import annotations

BLOCK_LINEARS: dict[str, str] = {
    "q": "attention.wq",
    "k": "attention.wk",
    "v": "attention.wv",
    "o": "attention.wo",
    "gate": "feed_forward.w1",
    "down": "feed_forward.w2",
    "up": "feed_forward.w3",
}

__all__ = ["BLOCK_LINEARS"]
