"""Batches for the trainer: packed fixed-length windows and a resumable, shuffled stream.

`PackedSequences` cuts a token stream into non-overlapping windows of seq_len + 1 tokens
(windows run across document boundaries; the EOS token marks them). `BatchStream` yields
shuffled batches forever, epoch after epoch; its order depends only on (seed, epoch) and its
`state_dict()` counts the batches handed to the caller, so a stream restored from a checkpoint
yields exactly the batches the original would have yielded next, whatever `num_workers` is.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from scaletrain.config import DataConfig
from scaletrain.data.corpus import TokenizedCorpus, prepare_corpus

log = logging.getLogger("scaletrain.data")

Batch = tuple[torch.Tensor, torch.Tensor]


class PackedSequences(Dataset[Batch]):
    """Item i = (tokens[i*(L+1) : i*(L+1)+L], the same shifted by one) as int64 tensors."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D token stream (got shape {tokens.shape})")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive (got {seq_len})")
        self.tokens = tokens
        self.seq_len = seq_len
        self._n = len(tokens) // (seq_len + 1)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Batch:
        if not -self._n <= i < self._n:
            raise IndexError(f"sample {i} out of range for {self._n} samples")
        w = self.seq_len + 1
        start = (i % self._n) * w
        window = torch.from_numpy(np.asarray(self.tokens[start : start + w], dtype=np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        # A whole-file memory map travels to spawned workers as its file name, not its bytes.
        state = dict(self.__dict__)
        t = self.tokens
        if isinstance(t, np.memmap) and isinstance(t.base, mmap.mmap) and t.filename:
            state["tokens"] = ("memmap", t.filename, t.dtype.str, t.offset, t.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = state["tokens"]
        if isinstance(t, tuple) and t[0] == "memmap":
            _, filename, dtype, offset, shape = t
            state["tokens"] = np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
        self.__dict__.update(state)


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch: a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n)


class _EpochBatches(Sampler[list[int]]):
    """Index batches of one epoch from `start` on; the stream sets epoch/start before iterating.

    It lives in the main process (workers only receive index lists), so changing its fields
    between iterations also works with persistent workers.
    """

    def __init__(self, n: int, batch_size: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.start = 0, 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.global_batch  # drop_last

    def __iter__(self) -> Iterator[list[int]]:
        perm = epoch_permutation(self.n, self.seed, self.epoch)
        gb, bs = self.global_batch, self.batch_size
        first = self.dp_rank * bs  # this rank's rows of each global batch
        return iter(
            [
                perm[b * gb + first : b * gb + first + bs].tolist()
                for b in range(self.start, self.batches_per_epoch)
            ]
        )

    def __len__(self) -> int:
        return max(self.batches_per_epoch - self.start, 0)


class BatchStream:
    """An infinite iterator of shuffled (inputs, targets) batches of shape (batch, seq_len).

    Incomplete last batches are dropped; each epoch is a new permutation from (seed, epoch).
    `state_dict()` / `load_state_dict()` save and restore the position for exact resumption.
    """

    def __init__(
        self,
        dataset: Dataset[Batch],
        batch_size: int,
        seed: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive (got {batch_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}) (got {dp_rank})")
        if n < batch_size * dp_size:
            seq = getattr(dataset, "seq_len", "?")
            raise ValueError(
                f"the training data has {n} sequences of {seq} tokens, fewer than one batch "
                f"of {batch_size} x {dp_size} data-parallel ranks: use more data "
                "(data.max_bytes), a smaller data.seq_len or a smaller training.micro_batch_size"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.epoch = 0
        self.batch_in_epoch = 0
        self._sampler = _EpochBatches(n, batch_size, seed, dp_rank, dp_size)
        extra: dict[str, Any] = {}
        if num_workers > 0:
            extra = dict(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
        self._loader = DataLoader(
            dataset,
            batch_sampler=self._sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            **extra,
        )
        self._it: Iterator[Any] | None = None

    @property
    def seed(self) -> int:
        return self._sampler.seed

    @property
    def batches_per_epoch(self) -> int:
        return self._sampler.batches_per_epoch

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        while True:
            if self._it is None:
                self._sampler.epoch, self._sampler.start = self.epoch, self.batch_in_epoch
                self._it = iter(self._loader)
            try:
                inputs, targets = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                self.batch_in_epoch = 0
                continue
            self.batch_in_epoch += 1
            return inputs, targets

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch handed out (prefetched batches do not count)."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dp_size": self._sampler.dp_size,
            "num_samples": self._sampler.n,
        }

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Continue from a saved position; batches already prefetched are discarded."""
        for key in ("batch_size", "dp_size", "num_samples"):
            mine = self.state_dict()[key]
            if key in sd and sd[key] != mine:
                raise ValueError(
                    f"data loader state was saved with {key}={sd[key]} but this run has "
                    f"{mine}; resume with the same data and batch settings"
                )
        self._sampler.seed = int(sd["seed"])
        self.epoch = int(sd["epoch"])
        self.batch_in_epoch = int(sd["batch_in_epoch"])
        self._it = None


def iter_eval_batches(
    dataset: Dataset[Batch], batch_size: int, max_batches: int | None = None
) -> Iterator[Batch]:
    """The first `max_batches` batches in order (not shuffled); the same every call.

    A dataset smaller than one batch gives one smaller batch.
    """
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError(
            "the validation data holds no full sequence; raise data.val_fraction "
            "or lower data.seq_len"
        )
    n_batches = max(n // batch_size, 1)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        items = [dataset[i] for i in range(b * batch_size, min((b + 1) * batch_size, n))]
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def build_train_val(
    cfg: DataConfig, batch_size: int, seed: int, pin_memory: bool, dp_rank: int = 0,
    dp_size: int = 1,
) -> tuple[BatchStream, PackedSequences, TokenizedCorpus]:
    """The trainer's one call: (training stream, validation sequences, the corpus).

    With data parallelism each rank's stream yields its own `batch_size` rows of every global
    batch of `batch_size x dp_size` samples, so the global order does not depend on dp_size.
    """
    corpus = prepare_corpus(cfg)
    train = PackedSequences(corpus.train, cfg.seq_len)
    val = PackedSequences(corpus.val, cfg.seq_len)
    if len(val) == 0:
        raise ValueError(
            f"the validation split has {len(corpus.val)} tokens, less than one sequence of "
            f"{cfg.seq_len + 1}: raise data.val_fraction or data.max_bytes, or lower data.seq_len"
        )
    stream = BatchStream(
        train,
        batch_size,
        seed,
        num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor,
        pin_memory=pin_memory,
        persistent_workers=cfg.persistent_workers,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    log.info(
        "data: %d training sequences of %d tokens (%d batches of %d per epoch), "
        "%d validation sequences",
        len(train),
        cfg.seq_len,
        stream.batches_per_epoch,
        batch_size,
        len(val),
    )
    return stream, val, corpus
