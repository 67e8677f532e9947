"""JSON-lines task data -> datasets of (inputs dict, targets) the trainer's BatchStream serves.

SFT items: ({"tokens", "segment_ids"}, labels) rows of `seq_len` tokens.
Classification items: ({"tokens", "lengths"}, label index), tokens right-padded to `seq_len`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from scaletrain.finetune.base import BaseModel, FinetuneError
from scaletrain.finetune.sft import pack, to_example
from scaletrain.inference.chat import ChatFormatError, ChatFormatter

log = logging.getLogger(__name__)

Item = tuple[dict[str, torch.Tensor], torch.Tensor]


def read_jsonl(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(location "file:line", record) for every non-blank line; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise FinetuneError(f"finetune.data: {path} not found; give a JSON-lines file")
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise FinetuneError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise FinetuneError(f"{path}:{n}: each line must be a JSON object")
            out.append((f"{path}:{n}", record))
    if not out:
        raise FinetuneError(f"{path} holds no examples")
    return out


def split(records: list[Any], val_fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A seeded, held-out validation split (at least one record on each side)."""
    if len(records) < 2:
        raise FinetuneError("need at least 2 examples to hold some out for validation "
                            "(or give finetune.val_data)")
    order = np.random.default_rng([seed, 7]).permutation(len(records))
    n_val = min(max(1, round(len(records) * val_fraction)), len(records) - 1)
    val = [records[i] for i in sorted(order[:n_val])]
    train = [records[i] for i in sorted(order[n_val:])]
    return train, val


class RowDataset(Dataset[Item]):
    """Pre-built rows: item i = ({input name: tensor}, target tensor)."""

    def __init__(self, inputs: list[dict[str, torch.Tensor]], targets: list[torch.Tensor],
                 seq_len: int) -> None:
        self.inputs, self.targets, self.seq_len = inputs, targets, seq_len

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> Item:
        return self.inputs[i], self.targets[i]


class Epochs(Dataset[Item]):
    """`epochs` passes over `rows`, each pass in its own order seeded by (seed, pass): the
    global sample order of a fine-tuning run, which the loader's `BatchStream` reads front to
    back (and resumes by sample count). A global batch may span two passes."""

    def __init__(self, rows: RowDataset, seed: int, epochs: int) -> None:
        self.rows, self.seed, self.epochs, self.seq_len = rows, seed, epochs, rows.seq_len
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.rows) * self.epochs

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            self._orders[epoch] = rng.permutation(len(self.rows))
        return self._orders[epoch]

    def __getitem__(self, i: int) -> Item:
        epoch, j = divmod(i, len(self.rows))
        return self.rows[int(self._order(epoch)[j])]

    def __getitems__(self, indices: list[int]) -> Item:
        return default_collate([self[i] for i in indices])


def epochs_for(rows: RowDataset, n_samples: int) -> int:
    """Passes over `rows` that hold `n_samples` samples."""
    return max(1, -(-n_samples // max(len(rows), 1)))


# --- SFT ---------------------------------------------------------------------------------------
def sft_dataset(records: list[tuple[str, dict[str, Any]]], base: BaseModel, seq_len: int,
                packing: bool) -> RowDataset:
    try:
        formatter = ChatFormatter(base.tokenizer, base.eos_id, base.chat_template,
                                  base.special_tokens)
        examples = [to_example(*formatter.encode(rec, where), seq_len, where)
                    for where, rec in records]
    except ChatFormatError as e:
        raise FinetuneError(str(e)) from None
    rows = pack(examples, seq_len, base.pad_id, packing)
    n_tokens = sum(len(e.inputs) for e in examples)
    log.info("SFT: %d examples -> %d rows of %d tokens (%.0f%% filled, packing %s)",
             len(examples), len(rows), seq_len, 100 * n_tokens / (len(rows) * seq_len),
             "on" if packing else "off")
    return RowDataset([{"tokens": r["tokens"], "segment_ids": r["segment_ids"]} for r in rows],
                      [r["labels"] for r in rows], seq_len)


# --- classification ------------------------------------------------------------------------------
def _label_of(record: dict[str, Any], where: str) -> str:
    if "text" not in record or "label" not in record:
        raise FinetuneError(f"{where}: expected {{\"text\": ..., \"label\": ...}} "
                            f"(got keys {sorted(record)})")
    if not isinstance(record["text"], str):
        raise FinetuneError(f"{where}: 'text' must be a string")
    return str(record["label"])


def label_set(records: list[tuple[str, dict[str, Any]]],
              given: str | list[str] | None) -> list[str]:
    """The label names: as given (comma-separated), else the sorted labels of the data. Every
    label in the data must be in the set."""
    found = [_label_of(rec, where) for where, rec in records]
    if given is None:
        labels = sorted(set(found))
    else:
        labels = [x.strip() for x in given.split(",")] if isinstance(given, str) else list(given)
        labels = [x for x in labels if x]
    if len(labels) < 2:
        raise FinetuneError(f"classification needs at least 2 labels (got {labels})")
    known = set(labels)
    for (where, _), label in zip(records, found):
        if label not in known:
            raise FinetuneError(f"{where}: label '{label}' is not in the label set "
                                f"{labels}; add it to finetune.labels or fix the record")
    return labels


def encode_text(base: BaseModel, text: str, seq_len: int, where: str) -> list[int]:
    ids = base.tokenizer.encode(text).ids
    if not ids:
        raise FinetuneError(f"{where}: the text is empty")
    if len(ids) > seq_len:
        raise FinetuneError(f"{where}: the text has {len(ids)} tokens, more than "
                            f"data.seq_len={seq_len}; raise --data.seq_len (up to the model's "
                            "max_seq_len) or shorten the text")
    return ids


def pad_batch(ids: list[list[int]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    tokens = torch.full((len(ids), seq_len), pad_id, dtype=torch.long)
    for i, row in enumerate(ids):
        tokens[i, : len(row)] = torch.tensor(row)
    return {"tokens": tokens, "lengths": torch.tensor([len(r) for r in ids])}


def classification_dataset(records: list[tuple[str, dict[str, Any]]], base: BaseModel,
                           labels: list[str], seq_len: int) -> RowDataset:
    index = {name: i for i, name in enumerate(labels)}
    inputs, targets = [], []
    for where, rec in records:
        ids = encode_text(base, rec["text"], seq_len, where)
        batch = pad_batch([ids], seq_len, base.pad_id)
        inputs.append({"tokens": batch["tokens"][0], "lengths": batch["lengths"][0]})
        targets.append(torch.tensor(index[_label_of(rec, where)]))
    return RowDataset(inputs, targets, seq_len)


__all__ = ["read_jsonl", "split", "RowDataset", "sft_dataset", "label_set", "encode_text",
           "pad_batch", "classification_dataset"]
