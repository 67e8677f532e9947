"""The embedding groups of a tied head under pipeline parallelism: the first and last stage's
ranks of every pipeline (none where one rank holds both ends, as under ZBVZeroBubble), and the
pruned model of a last-stage rank that keeps the head tied to the embedding."""

from __future__ import annotations

import torch

from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import Transformer
from scaletrain.parallel.pp import embedding_group_ranks, prune_for_stages, tied_stage_ranks

ARGS = ModelArgs(dim=32, n_layers=4, n_heads=2, vocab_size=64, ffn_dim=64, tie_embeddings=True)


def test_groups_pair_the_ends_of_every_pipeline() -> None:
    mesh = torch.arange(8).reshape(2, 1, 2, 1, 2)  # (pp, dp_replicate, dp_shard, cp, tp)
    assert embedding_group_ranks(mesh, 0, 2, 1, "1F1B") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    mesh4 = torch.arange(8).reshape(4, 1, 2, 1, 1)
    assert embedding_group_ranks(mesh4, 0, 4, 1, "GPipe") == [[0, 6], [1, 7]]
    assert tied_stage_ranks(2, 2, "Interleaved1F1B") == (0, 1)
    assert tied_stage_ranks(2, 2, "ZBVZeroBubble") == (0, 0)
    assert embedding_group_ranks(mesh, 0, 2, 2, "ZBVZeroBubble") == []


def test_last_stage_keeps_the_head_tied_to_the_embedding_module() -> None:
    with torch.device("meta"):
        last, middle = Transformer(ARGS), Transformer(ARGS)
    prune_for_stages(last, 1, 2, 1, "1F1B")
    assert last.output.weight is last.tok_embeddings.weight
    assert [n for n, _ in last.named_parameters()][0] == "tok_embeddings.weight"
    prune_for_stages(middle, 1, 4, 1, "1F1B")  # a middle stage: neither end
    assert middle.tok_embeddings is None and middle.output is None
