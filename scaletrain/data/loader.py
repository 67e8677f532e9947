"""Batches for the trainer: a data-parallel, resumable stream over a global sample order.

The sample source (a `GPTDataset` or a `BlendedDataset`) is already shuffled: its order is the
global sample order, a function of the data and the seed only. Global batch b is samples
[b*G, (b+1)*G) with G = batch_size x dp_size; data-parallel rank r takes rows
[r*batch_size, (r+1)*batch_size) of it. The stream's state is the number of samples the whole
job has consumed, so a resumed run continues at the exact next sample whatever its number of
workers or of data-parallel ranks. Index lists are made in the main process (workers only
fetch), which keeps the order exact with any `num_workers`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


class SampleSource(Protocol):
    seq_len: int

    def __len__(self) -> int: ...
    def window(self, i: int) -> np.ndarray: ...
    def positions(self, i: int) -> np.ndarray: ...


class DataExhausted(RuntimeError):
    """More batches were asked for than the sample order holds."""


class Windows(Dataset[Batch]):
    """Map-style view of a sample source: item i = (inputs, targets) int64 tensors; with
    `with_positions`, also each input token's position in its document (0 = a document start).
    `__getitems__` fetches a whole batch at once (what the DataLoader calls)."""

    def __init__(self, source: SampleSource, with_positions: bool = False) -> None:
        self.source = source
        self.seq_len = source.seq_len
        self.with_positions = with_positions

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, *rest = self.__getitems__([i])
        return tuple(t[0] for t in (x, *rest))

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        n = len(self.source)
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"sample {i} out of range for {n} samples")
        w = torch.from_numpy(np.stack([self.source.window(i) for i in indices]).astype(np.int64))
        out = (w[:, :-1].contiguous(), w[:, 1:].contiguous())
        if self.with_positions:
            pos = np.stack([self.source.positions(i) for i in indices])
            out = (*out, torch.from_numpy(pos))
        return out


def _as_batch(batch: Any) -> Any:
    return batch  # Windows.__getitems__ already returns the stacked batch


class _RankBatches(Sampler[list[int]]):
    """This rank's index lists of the global batches from sample `start` on."""

    def __init__(self, n: int, batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.n, self.batch_size, self.dp_rank, self.dp_size = n, batch_size, dp_rank, dp_size
        self.start = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_size

    def __iter__(self) -> Iterator[list[int]]:
        gb, bs = self.global_batch, self.batch_size
        first = self.start + self.dp_rank * bs
        for b in range(len(self)):
            lo = first + b * gb
            yield list(range(lo, lo + bs))

    def __len__(self) -> int:
        return max((self.n - self.start) // self.global_batch, 0)


class BatchStream:
    """An iterator of (inputs, targets) batches of shape (batch_size, seq_len) for one
    data-parallel rank. `state_dict()` / `load_state_dict()` save and restore the position."""

    def __init__(
        self,
        dataset: Windows,
        batch_size: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
        fingerprint: str = "",
    ) -> None:
        n = len(dataset)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive (got {batch_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}) (got {dp_rank})")
        if n < batch_size * dp_size:
            raise ValueError(
                f"the training data has {n} sequences of {dataset.seq_len} tokens, fewer than "
                f"one batch of {batch_size} x {dp_size} data-parallel ranks: use more data "
                "(data.max_bytes), a smaller data.seq_len or a smaller training.micro_batch_size"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.fingerprint = fingerprint
        self.consumed_samples = 0
        self._sampler = _RankBatches(n, batch_size, dp_rank, dp_size)
        extra: dict[str, Any] = {}
        if num_workers > 0:
            extra = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
        # Its own generator: starting an iterator draws a seed for the workers, which from the
        # global RNG would shift every later random draw (dropout) of a resumed run against
        # the uninterrupted one (a resumed run starts an iterator where the other did not).
        self._loader = DataLoader(dataset, batch_sampler=self._sampler, num_workers=num_workers,
                                  pin_memory=pin_memory, collate_fn=_as_batch,
                                  generator=torch.Generator().manual_seed(0), **extra)
        self._it: Iterator[Any] | None = None

    @property
    def global_batch(self) -> int:
        return self._sampler.global_batch

    @property
    def batches_left(self) -> int:
        return (len(self.dataset) - self.consumed_samples) // self.global_batch

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        if self.batches_left <= 0:
            raise DataExhausted(
                f"the sample order holds {len(self.dataset)} samples and {self.consumed_samples} "
                f"were consumed: no full global batch of {self.global_batch} is left"
            )
        if self._it is None:
            self._sampler.start = self.consumed_samples
            self._it = iter(self._loader)
        batch = next(self._it)
        self.consumed_samples += self.global_batch
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (prefetched batches do not count)."""
        return {"consumed_samples": self.consumed_samples, "fingerprint": self.fingerprint}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from a saved position; batches already prefetched are discarded."""
        saved = sd.get("fingerprint", "")
        if isinstance(saved, bytes):
            saved = saved.decode()
        if saved and self.fingerprint and saved != self.fingerprint:
            raise ValueError(
                "data loader state was saved for other data (sources, weights, split, seq_len "
                "or seed differ); resume with the same data settings"
            )
        self.consumed_samples = int(sd["consumed_samples"])
        self._it = None


def iter_eval_batches(dataset: Dataset[Any], batch_size: int,
                      max_batches: int | None = None) -> Iterator[Batch]:
    """The first `max_batches` batches in order (not shuffled); the same every call.

    A dataset smaller than one batch gives one smaller batch.
    """
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("the validation data holds no full sequence; raise data.val_fraction "
                         "or lower data.seq_len")
    n_batches = max(n // batch_size, 1)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        idx = list(range(b * batch_size, min((b + 1) * batch_size, n)))
        if hasattr(dataset, "__getitems__"):
            x, y, *_ = dataset.__getitems__(idx)
        else:
            items = [dataset[i] for i in idx]
            x, y = torch.stack([t[0] for t in items]), torch.stack([t[1] for t in items])
        yield x, y


def build_train_val(
    cfg: Any, batch_size: int, seed: int, pin_memory: bool, dp_rank: int = 0, dp_size: int = 1,
    num_samples: int | None = None, grad_accum: int = 1,
) -> tuple[BatchStream, Windows, Any]:
    """The trainer's one call: (training stream, validation samples, `DataInfo`).

    `cfg` is the `data` config section. With data parallelism each rank's stream yields its own
    `batch_size` rows of every global batch of `batch_size x dp_size` samples, so the global
    order does not depend on dp_size. `num_samples` (the samples the run will consume) sets how
    many epochs the index holds; the order of the first samples never depends on it.
    `grad_accum` (micro-batches per optimizer step) only sizes what the log line reports: a
    global batch of `batch_size x grad_accum x dp_size` rows per optimizer step.
    """
    from scaletrain.data.sources import build_sources

    train, val, info = build_sources(cfg, seed, num_samples)
    stream = BatchStream(
        Windows(train), batch_size, num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor, pin_memory=pin_memory,
        persistent_workers=cfg.persistent_workers, dp_rank=dp_rank, dp_size=dp_size,
        fingerprint=info.fingerprint,
    )
    step_rows = stream.global_batch * grad_accum  # micro-batch x grad_accum x dp
    log.info("data: %d training samples of %d tokens (%d optimizer steps of a global batch of "
             "%d = %d micro-batch x %d accumulation x %d data-parallel; %d micro-batches per "
             "rank), %d validation samples", len(train), cfg.seq_len,
             stream.batches_left // grad_accum, step_rows, batch_size, grad_accum, dp_size,
             stream.batches_left, len(val))
    return stream, Windows(val), info
