"""ZeRO-1's partitioned optimizer (`train/zero1.py`) in one process: ownership, the update
equal to the plain optimizer's, and a name-keyed state that round-trips. The multi-rank runs
(ZeRO-1 alone, with TP, with PP) are in tests/parallel/distributed/test_parity.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from scaletrain.config import OptimizerConfig
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model
from scaletrain.train.optim import make_optimizer, param_groups
from scaletrain.train.zero1 import PartitionedOptimizer, assign_owners


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_owners_balance_the_elements() -> None:
    sizes = [100, 7, 50, 50, 3, 90, 10]
    owner = assign_owners(sizes, 3)
    load = [sum(s for s, o in zip(sizes, owner, strict=True) if o == r) for r in range(3)]
    assert sorted(load) == [100, 103, 107]
    assert assign_owners(sizes, 3) == owner  # the same on every rank
    assert assign_owners(sizes, 1) == [0] * len(sizes)


def _model() -> torch.nn.Module:
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64)
    return build_model(args, torch.device("cpu"), seed=0)


def _grads(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_update_and_state_equal_the_plain_optimizer(group: dist.ProcessGroup) -> None:
    cfg = OptimizerConfig(weight_decay=0.1)
    plain_model, zero_model = _model(), _model()
    plain = make_optimizer(param_groups(plain_model, cfg.weight_decay), cfg, torch.device("cpu"))
    zero = PartitionedOptimizer(zero_model, cfg, torch.device("cpu"), group)
    for step in range(3):
        for m in (plain_model, zero_model):
            _grads(m, step)
        zero.param_groups[0]["lr"] = plain.param_groups[0]["lr"] = 1e-3 * (step + 1)
        plain.step()
        zero.step()
        zero.zero_grad()
    for a, b in zip(plain_model.parameters(), zero_model.parameters(), strict=True):
        assert torch.equal(a, b)
    sd = copy.deepcopy(zero.state_dict())  # state_dict() holds the live tensors
    names = {n for n, _ in zero_model.named_parameters()}
    assert set(sd["state"]) == names
    assert set(sd["param_groups"]) == names  # every parameter's group settings, by name
    decayed = zero.group_names()[0][0]
    assert sd["param_groups"][decayed]["lr"] == 3e-3
    assert sd["param_groups"][decayed]["weight_decay"] == 0.1

    # Into a fresh optimizer: the next update is the same.
    again = PartitionedOptimizer(zero_model, cfg, torch.device("cpu"), group)
    again.init_state()
    again.load_state_dict(sd)
    before = [p.detach().clone() for p in zero_model.parameters()]
    for opt in (zero, again):
        with torch.no_grad():
            for p, b in zip(zero_model.parameters(), before, strict=True):
                p.copy_(b)
        _grads(zero_model, 9)
        opt.step()
        if opt is zero:
            expected = [p.detach().clone() for p in zero_model.parameters()]
    for p, e in zip(zero_model.parameters(), expected, strict=True):
        assert torch.equal(p, e)


def test_missing_state_is_an_error(group: dist.ProcessGroup) -> None:
    zero = PartitionedOptimizer(_model(), OptimizerConfig(), torch.device("cpu"), group)
    zero.init_state()
    sd = zero.state_dict()
    sd["state"].pop(next(iter(sd["state"])))
    with pytest.raises(KeyError, match="no entry"):
        zero.load_state_dict(sd)
