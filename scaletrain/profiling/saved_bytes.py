"""Measure what a forward pass keeps for backward, to check the activation estimate.

Counts each storage once (views share storage), leaves out parameters and the autocast copies
of parameters (those are weights, reported apart as `weight_copies`). Under tensor parallelism
(`tp_mesh`) it runs on every rank of the mesh and counts this rank's local tensors (a DTensor
is counted by its local shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from scaletrain.config import ActivationCheckpointConfig
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.train.chunked_loss import chunked_linear_cross_entropy
from scaletrain.train.loss import cross_entropy_sum

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_PASS_THROUGH = ("TBackward0", "ToCopyBackward0", "ViewBackward0", "TransposeBackward0",
                 "ExpandBackward0", "_ToTorchTensorBackward")


@dataclass(frozen=True)
class SavedBytes:
    activations: int
    weight_copies: int


def _from_parameter(t: torch.Tensor) -> bool:
    """True when `t` is a parameter seen through casts, transposes and views only."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        if fn.name() == "torch::autograd::AccumulateGrad":
            return True
        if fn.name() not in _PASS_THROUGH:
            return False
        fn = next((f for f, _ in fn.next_functions if f is not None), None)
    return False


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding `t`'s bytes on this rank: a DTensor's local shard, an asynchronous
    collective's result."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return getattr(t, "elem", t)  # AsyncCollectiveTensor


def measure_saved_bytes(args: ModelArgs, mbs: int, seq_len: int, dtype: str = "fp32",
                        param_dtype: str = "fp32",
                        ac: ActivationCheckpointConfig | None = None,
                        tp_mesh: DeviceMesh | None = None, sequence_parallel: bool = False,
                        regather: bool = True, fused_loss: bool = False,
                        loss_chunk: int = 4096) -> SavedBytes:
    """Run one forward + loss of a fresh model and count the bytes saved for backward
    (`fused_loss`: the trainer's chunked head + cross-entropy instead of logits + loss; one
    process only).

    With `tp_mesh` (call it on every rank of the mesh) the model is tensor parallel
    (`apply_tp`, sequence parallel as asked, the head's logits gathered) and this rank's bytes
    are counted."""
    model = build_model(args, seed=0)
    if param_dtype == "bf16":
        model = model.to(torch.bfloat16)
    if tp_mesh is not None:
        from scaletrain.parallel.tp import apply_tp

        apply_tp(model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=False,
                 regather=regather)
    if ac is not None:
        apply_ac(model, ac)
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    copies: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if key in params:
            return t
        (copies if _from_parameter(t) else seen)[key] = storage.nbytes()
        return t

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (mbs, seq_len + 1), generator=gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast:
            if fused_loss:
                h = model(tokens[:, :-1], hidden=True)
                loss = chunked_linear_cross_entropy(h, model.output.weight, tokens[:, 1:],
                                                    loss_chunk, args.final_softcap)
            else:
                logits = model(tokens[:, :-1])
        if not fused_loss:
            loss = cross_entropy_sum(logits, tokens[:, 1:])
    del loss
    return SavedBytes(activations=sum(seen.values()), weight_copies=sum(copies.values()))


def per_layer_saved_bytes(args: ModelArgs, mbs: int, seq_len: int, dtype: str = "fp32",
                          param_dtype: str = "fp32", tp_mesh: DeviceMesh | None = None,
                          sequence_parallel: bool = False, regather: bool = True) -> int:
    """Activation bytes one block keeps (on this rank): a 2-block model less a 1-block model."""
    kw = {"tp_mesh": tp_mesh, "sequence_parallel": sequence_parallel, "regather": regather}
    one = measure_saved_bytes(args.replace(n_layers=1), mbs, seq_len, dtype, param_dtype, **kw)
    two = measure_saved_bytes(args.replace(n_layers=2), mbs, seq_len, dtype, param_dtype, **kw)
    return two.activations - one.activations
