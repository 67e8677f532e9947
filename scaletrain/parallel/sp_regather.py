"""Sequence parallelism that keeps the sequence shard, not the gathered sequence, for backward.

Under sequence parallelism the input of the attention and of the MLP arrives sharded over the
sequence and is all-gathered before the column-wise projections (q/k/v, w1/w3). With DTensor's
`PrepareModuleInput` + `ColwiseParallel` each projection then saves the gathered (full-sequence)
input for its weight gradient: t times the bytes of the shard. Megatron-LM saves the shard and
all-gathers it again in backward; so does this module:

- `GatherSequence` (on the attention or MLP module) all-gathers the module's input once per
  forward (`_GatherSeq`: all-gather in forward, reduce-scatter of the summed gradient in
  backward, as DTensor does).
- `ColwiseFromShard` (on each column-wise projection of that module) computes from the gathered
  input but saves only the shard (`_ColwiseFromShard`); in backward the first projection that
  needs the full input all-gathers it again and the others of the same module call reuse that
  gather, so a module call costs one all-gather in forward and one more in backward.

The arithmetic is the same as DTensor's (the same local matmuls in the same order, casts under
autocast where autocast would cast), so results are bitwise equal to the DTensor path. Under
autocast one copy of the shard in the compute dtype is saved for all projections (DTensor's
path saves one full cast per projection), and the backward all-gather moves that copy.
Under activation checkpointing the recomputed forward gathers again, as Megatron-LM's does.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from scaletrain.runtime import matmul_dtype

SEQ_DIM = 1


def _wait(x: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(x) if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s/t, ...) on each rank -> (b, s, ...), the ranks' shards in rank order."""
    t, b = group.size(), x.shape[0]
    out = _wait(funcol.all_gather_single(x.contiguous(), 0, group))  # (t b, s/t, ...)
    out = out.view(t, b, *x.shape[1:]).transpose(0, 1)
    return out.reshape(b, t * x.shape[1], *x.shape[2:])


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s, ...) partial sums on each rank -> this rank's (b, s/t, ...) of their sum."""
    t, b, s = group.size(), x.shape[0], x.shape[1]
    chunks = x.reshape(b, t, s // t, *x.shape[2:]).transpose(0, 1).contiguous()
    out = _wait(funcol.reduce_scatter_single(chunks.view(t * b, s // t, *x.shape[2:]), "sum", 0,
                                             group))
    return out.view(b, s // t, *x.shape[2:])


class _GatherSeq(torch.autograd.Function):
    """The sequence shard -> the whole sequence; backward reduce-scatters the gradient (each
    rank's gradient of the whole sequence is a partial sum over its heads or hidden units)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(shard, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.group), None


class _Call:
    """One forward call of a module under `GatherSequence`: its gathered input and the shard it
    came from (dropped when the call returns), and in backward the re-gathered input shared by
    the module's projections until the last of them has used it."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> None:
        self.full: torch.Tensor | None = full
        self.shard: torch.Tensor | None = shard
        self.group = group
        self.casts: dict[torch.dtype, torch.Tensor] = {}
        self.users = 0
        self.regathered: torch.Tensor | None = None

    def shard_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The shard in `dtype`, one copy per dtype however many projections save it."""
        assert self.shard is not None
        if dtype == self.shard.dtype:
            return self.shard
        if dtype not in self.casts:
            self.casts[dtype] = self.shard.detach().to(dtype)
        return self.casts[dtype]

    def release(self) -> None:
        self.full = self.shard = None
        self.casts.clear()

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """In backward: the whole input again (all-gathered by the first projection to ask)."""
        full = self.regathered
        if full is None or full.dtype != shard.dtype:
            full = _all_gather(shard, self.group)
        self.users -= 1
        self.regathered = full if self.users > 0 else None
        return full


class _ColwiseFromShard(torch.autograd.Function):
    """y = full @ w.T + b with `full` the gathered input; saves the shard (in the compute dtype)
    and the weight, and all-gathers the shard again in backward. Matmuls and casts are those
    autograd runs for `F.linear` (under autocast: inputs cast to the autocast dtype)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, shard: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, call: _Call) -> torch.Tensor:
        dt = shard.dtype
        with torch.autocast(full.device.type, enabled=False):
            out = F.linear(full.to(dt), weight.to(dt), None if bias is None else bias.to(dt))
        ctx.save_for_backward(shard, weight)
        ctx.call, ctx.in_dtype = call, full.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        call.users += 1
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shard, weight = ctx.saved_tensors
        full = ctx.call.gathered(shard)
        w = weight.to(shard.dtype)
        x2d, g2d = full.reshape(-1, full.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_full = g2d.mm(w).view(full.shape).to(ctx.in_dtype)
        grad_w = g2d.t().mm(x2d).to(weight.dtype)
        grad_b = None if ctx.bias_dtype is None else g2d.sum(0).to(ctx.bias_dtype)
        return grad_full, None, grad_w, grad_b, None


class GatherSequence(ParallelStyle):
    """On the attention or MLP module under sequence parallelism: all-gathers its first input
    (a sequence shard, plain or a Shard(1) DTensor) into a plain whole-sequence tensor, which
    the module's `ColwiseFromShard` projections recognise. One instance per module."""

    def __init__(self) -> None:
        super().__init__()
        self.current: _Call | None = None
        self.group: ProcessGroup | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.group = device_mesh.get_group()
        module.register_forward_pre_hook(self._gather, with_kwargs=True)
        module.register_forward_hook(self._release, always_call=True)
        return module

    def _gather(self, _: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x, *rest = args
        shard = x.to_local() if isinstance(x, DTensor) else x
        assert self.group is not None
        full = _GatherSeq.apply(shard, self.group)
        self.current = _Call(full, shard, self.group)
        return (full, *rest), kwargs

    def _release(self, *_: Any) -> None:
        if self.current is not None:
            self.current.release()
        self.current = None


class ColwiseFromShard(ParallelStyle):
    """Column-wise `nn.Linear` (weight and bias Shard(0), local output sharded over the last
    dim) whose input is the gathered tensor of `gather`'s module call: saves the shard for
    backward, not the gathered input. Any other input (the projection called on its own) takes
    the plain DTensor path, as `ColwiseParallel` with a replicated input."""

    def __init__(self, gather: GatherSequence) -> None:
        super().__init__()
        self.gather = gather

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Linear:  # its forward is replaced: a subclass's would be lost
            raise TypeError(f"ColwiseFromShard needs a plain nn.Linear, got "
                            f"{type(module).__name__}")
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p, device_mesh, [Shard(0)]), requires_grad=p.requires_grad))
        gather = self.gather

        def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            weight, bias = self.weight, self.bias
            call = gather.current
            if call is None or x is not call.full:  # not the module's gathered input
                full = x.redistribute(weight.device_mesh, [Replicate()]) \
                    if isinstance(x, DTensor) else \
                    DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
                return F.linear(full, weight, bias).to_local()
            shard = call.shard_in(matmul_dtype(x))
            return _ColwiseFromShard.apply(x, shard, weight.to_local(),
                                           None if bias is None else bias.to_local(), call)

        module.forward = MethodType(forward, module)
        return module
