"""The chunked linear + cross-entropy under tensor parallelism, vocabulary-parallel.

The head's weight is a DTensor sharded over the vocabulary (`Shard(0)` on the tensor-parallel
mesh, as `ColwiseParallel` leaves it). Each rank computes the logits of its vocabulary slice,
chunk by chunk, for every token of the micro-batch; the log-sum-exp and the target logit of each
chunk are combined over the ranks (`chunked_loss.VocabShard`), so every rank returns the same
loss and no rank ever holds more than (chunk x vocabulary / tp) logits.

Gradients: the head weight's is local to its slice; the hidden states' is the sum over ranks of
each rank's (softmax - onehot) @ W_local. The hidden states enter as a DTensor, gathered to
`Replicate` (an all-gather along the sequence under sequence parallelism, as the head's
`ColwiseParallel` does), and the local gradient is declared `Partial`: backward then
reduce-scatters it back to the sequence shards (sequence parallel) or all-reduces it
(replicated hidden states, sequence parallelism off).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from scaletrain.train.chunked_loss import DEFAULT_CHUNK, VocabShard, chunked_linear_cross_entropy


def vocab_slice(vocab: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of `rank`'s part of a `Shard(0)` over `ranks` (torch.chunk's split:
    ceil(vocab / ranks) rows each, the last ranks fewer or none)."""
    per = -(-vocab // ranks)
    first = min(rank * per, vocab)
    return first, min(per, vocab - first)


def vocab_parallel_linear_cross_entropy(h: torch.Tensor, weight: DTensor, targets: torch.Tensor,
                                        chunk: int = DEFAULT_CHUNK,
                                        softcap: float | None = None) -> torch.Tensor:
    """Sum of token cross-entropies of `softcap(h @ weight^T)` (fp32 scalar, equal on every
    rank of the weight's mesh).

    `weight` (vocab, dim): a DTensor `Shard(0)` over a 1-D mesh. `h` (batch, seq, dim): the
    final-norm hidden states, a DTensor over the same mesh (`Shard(1)` under sequence
    parallelism, or `Replicate`) or a plain tensor equal on every rank. `targets` (batch, seq):
    the whole sequence, equal on every rank, IGNORE_INDEX where a token does not count.
    """
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError("the vocabulary-parallel loss needs the head weight as Shard(0) over a "
                         f"1-D mesh; got {weight.placements} over {mesh}")
    first, rows = vocab_slice(weight.shape[0], mesh.size(), mesh.get_local_rank())
    w_local = weight.to_local()
    if w_local.shape[0] != rows:
        raise ValueError(f"head weight shard of {w_local.shape[0]} rows, expected {rows}")
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    h_full = h.redistribute(h.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    return chunked_linear_cross_entropy(h_full, w_local, targets, chunk, softcap,
                                        VocabShard(first, mesh.get_group()))
