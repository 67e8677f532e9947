"""Instruction tuning data: the token ids and loss mask of a record (`inference.chat`'s
`ChatFormatter`, the one chat format of every verb) -> examples -> rows of `seq_len` tokens
(several short examples packed into one row when asked).

Only response tokens are scored: prompt tokens get the label IGNORE_INDEX.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scaletrain.finetune.base import FinetuneError
from scaletrain.train.loss import IGNORE_INDEX


@dataclass
class Example:
    """One training example: inputs[i] predicts labels[i] (IGNORE_INDEX = not scored)."""

    inputs: list[int]
    labels: list[int]


def to_example(ids: list[int], mask: list[bool], seq_len: int, where: str) -> Example:
    """Shift by one (token i predicts token i+1) and check the length."""
    if len(ids) - 1 > seq_len:
        raise FinetuneError(
            f"{where}: the example has {len(ids) - 1} tokens (after the shift), more than "
            f"data.seq_len={seq_len}; raise --data.seq_len (up to the model's max_seq_len) or "
            "shorten or drop the example"
        )
    if not any(mask[1:]):
        raise FinetuneError(f"{where}: the response is empty, so nothing would be trained on")
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
    return Example(ids[:-1], labels)


def pack(examples: list[Example], seq_len: int, pad_id: int,
         packing: bool = True) -> list[dict[str, torch.Tensor]]:
    """Rows of `seq_len` tokens: {"tokens", "labels", "segment_ids"} int64 tensors.

    With `packing`, examples fill rows first-fit in order; each example has its own segment id,
    and the padding at the end of a row gets one more. Without packing, one example per row.
    """
    bins: list[list[Example]] = []
    room: list[int] = []
    for ex in examples:
        n = len(ex.inputs)
        slot = next((i for i, r in enumerate(room) if r >= n), None) if packing else None
        if slot is None:
            bins.append([])
            room.append(seq_len)
            slot = len(bins) - 1
        bins[slot].append(ex)
        room[slot] -= n
    rows = []
    for group in bins:
        tokens = torch.full((seq_len,), pad_id, dtype=torch.long)
        labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
        segments = torch.full((seq_len,), len(group), dtype=torch.long)
        pos = 0
        for seg, ex in enumerate(group):
            n = len(ex.inputs)
            tokens[pos : pos + n] = torch.tensor(ex.inputs)
            labels[pos : pos + n] = torch.tensor(ex.labels)
            segments[pos : pos + n] = seg
            pos += n
        rows.append({"tokens": tokens, "labels": labels, "segment_ids": segments})
    return rows


__all__ = ["Example", "to_example", "pack"]
