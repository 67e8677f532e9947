"""The one evaluation path: the mean token loss over a fixed number of validation sequences.

The first `n_sequences` sequences of the validation set are dealt round-robin to the
data-parallel ranks (sequence i to rank i mod dp) and evaluated in batches of the micro-batch
size; token-loss sums and valid-token counts are summed over all ranks. The value is then the
same for every layout and every micro-batch size. Ranks with one sequence fewer evaluate a
padding row whose targets are all ignored, so every rank runs the same number of forward passes
(FSDP and pipeline stages communicate in each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from scaletrain.parallel.parallelize import Parallelism
from scaletrain.train import precision
from scaletrain.train.loss import IGNORE_INDEX, count_valid
from scaletrain.train.step import full_value

Batch = tuple[Any, torch.Tensor]
# on_batch(logits, targets, real): per-batch hook (classification metrics); `real` marks the rows
# that are validation sequences, not padding.
BatchHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def rank_indices(n_items: int, n_sequences: int, dp_rank: int, dp_size: int
                 ) -> list[int | None]:
    """This rank's share of the first `n_sequences` items (None: a padding row)."""
    n = min(n_sequences, n_items) if n_sequences > 0 else n_items
    if n == 0:
        raise ValueError("the validation data holds no full sequence; raise data.val_fraction "
                         "or lower data.seq_len")
    mine: list[int | None] = list(range(dp_rank, n, dp_size))
    per_rank = -(-n // dp_size)
    return mine + [None] * (per_rank - len(mine))


def _stack(items: Sequence[Any]) -> Any:
    first = items[0]
    if isinstance(first, dict):
        return {k: torch.stack([it[k] for it in items]) for k in first}
    return torch.stack(list(items))


def fetch(dataset: Any, indices: list[int | None]) -> Batch:
    """The rows `indices` of `dataset` as one batch; padding rows repeat row 0, all ignored."""
    real = [i if i is not None else 0 for i in indices]
    if hasattr(dataset, "__getitems__"):
        x, y, *_ = dataset.__getitems__(real)
    else:
        rows = [dataset[i] for i in real]
        x, y = _stack([r[0] for r in rows]), _stack([r[1] for r in rows])
    pad = torch.tensor([i is None for i in indices])
    if pad.any():
        y = y.clone()
        y[pad] = IGNORE_INDEX
    return x, y


def eval_batches(dataset: Any, n_sequences: int, batch_size: int, dp_rank: int,
                 dp_size: int) -> Iterator[tuple[Batch, torch.Tensor]]:
    """(batch, real-row mask) for this rank, in order; the same every call."""
    mine = rank_indices(len(dataset), n_sequences, dp_rank, dp_size)
    for start in range(0, len(mine), batch_size):
        idx = mine[start:start + batch_size]
        yield fetch(dataset, idx), torch.tensor([i is not None for i in idx])


@torch.no_grad()
def evaluate(model: nn.Module, par: Parallelism, dataset: Any, n_sequences: int,
             batch_size: int, device: torch.device, dtype: str,
             loss_fn: Callable[..., torch.Tensor],
             prepare: Callable[[Any, torch.Tensor], Batch] | None = None,
             forward: Callable[[Any], torch.Tensor] | None = None,
             on_batch: BatchHook | None = None, hidden: bool = False) -> torch.Tensor:
    """Mean validation loss over `n_sequences` sequences (0: the whole set), a device tensor
    equal on every rank. `prepare(x, y)` moves a batch to the device (default: `.to`).
    `hidden`: `forward` (and a pipeline's last stage) gives the final-norm hidden states and
    `loss_fn` applies the head itself (`training.fused_loss`)."""
    prepare = prepare or (lambda x, y: (x.to(device), y.to(device)))
    forward = forward or model
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        with par.loss_context(), precision.autocast(device, dtype):
            for (x, y), real in eval_batches(dataset, n_sequences, batch_size, par.dp_rank,
                                             par.dp_size):
                x, y = prepare(x, y)
                if par.schedule is not None:
                    loss, valid = par.pipeline_eval_batch(x, y, loss_fn, hidden=hidden)
                else:
                    xs, ys, positions = par.shard_batch(x, y)
                    logits = (forward(xs, positions=positions) if positions is not None
                              else forward(xs))
                    loss, valid = loss_fn(logits, ys), count_valid(ys)
                    if on_batch is not None:
                        on_batch(logits, ys, real)
                total += full_value(loss).double()
                count += valid
    finally:
        model.train(was_training)
        # A forward with no backward leaves a pipeline stage's FSDP root gathered: put it at
        # rest, or a state dict taken next reads storage FSDP frees at its next reshard.
        par.reshard_stages()
    par.reduce_loss(total)
    par.reduce_loss(count)
    return total / count.clamp(min=1)


__all__ = ["evaluate", "eval_batches", "rank_indices", "fetch"]
