"""Measure what a forward pass keeps for backward, to check the activation estimate.

Counts each storage once (views share storage) among the tensors autograd still holds after the
forward and loss, leaves out parameters and the copies of parameters (autocast's casts, of
frozen weights too: those are weights, reported apart as `weight_copies`). Under tensor
parallelism (`tp_mesh`) it runs on every rank of the mesh and counts this rank's local tensors
(a DTensor is counted by its local shard).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


class _FrozenCasts(TorchDispatchMode):
    """Records the storages of dtype casts of parameters: autocast casts a frozen weight on
    every call (no grad_fn leads back to it), and a linear keeps that copy for its input's
    gradient; it is a weight copy, not an activation. The copies are held until the count
    ends, so that no activation reuses their addresses."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params: set[int] = params
        self.outputs: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) \
                and _local(args[0]).untyped_storage().data_ptr() in self.params:
            self.outputs[_local(out).untyped_storage().data_ptr()] = out
        return out


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
                        loss_chunk: int = 4096,
                        finetune: Callable[[nn.Module], nn.Module] | None = None) -> SavedBytes:
    """Run one forward + loss of a fresh model and count the bytes saved for backward
    (`fused_loss`: the trainer's chunked head + cross-entropy instead of logits + loss; one
    process only).

    `finetune` turns the fresh model into the one a fine-tuning method trains (freezing, LoRA,
    a classification head: `finetune.methods.apply_method` and `with_head`), before
    recomputation is applied; a `SequenceClassifier` it returns is run on rows of full length
    against one label per row.

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
    top: nn.Module = model if finetune is None else finetune(model)
    if ac is not None:
        apply_ac(model, ac)
    params = {_local(p).untyped_storage().data_ptr() for p in top.parameters()}
    packed: list[tuple[weakref.ref, int, int, bool]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if key in params:
            return t
        weight = _from_parameter(t) or key in casts.outputs
        packed.append((weakref.ref(t), key, storage.nbytes(), weight))
        return t

    casts = _FrozenCasts(params)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (mbs, seq_len + 1), generator=gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), casts:
        with autocast:
            if top is not model:  # a classifier: the label logits at each row's last token
                labels = torch.randint(0, top.num_labels, (mbs,), generator=gen)
                loss = cross_entropy_sum(top(tokens[:, :-1], torch.full((mbs,), seq_len)),
                                         labels)
            elif fused_loss:
                h = model(tokens[:, :-1], hidden=True)
                loss = chunked_linear_cross_entropy(h, model.output.weight, tokens[:, 1:],
                                                    loss_chunk, args.final_softcap)
            else:
                logits = model(tokens[:, :-1])
        if not fused_loss and top is model:
            loss = cross_entropy_sum(logits, tokens[:, 1:])
    # What autograd still holds: a region that needs no gradient (a frozen block under
    # recomputation) packs tensors and drops them, and their addresses are reused.
    kept = {(key, weight): nbytes for ref, key, nbytes, weight in packed if ref() is not None}
    del loss
    return SavedBytes(activations=sum(n for (_, w), n in kept.items() if not w),
                      weight_copies=sum(n for (_, w), n in kept.items() if w))


def per_layer_saved_bytes(args: ModelArgs, mbs: int, seq_len: int, dtype: str = "fp32",
                          param_dtype: str = "fp32", tp_mesh: DeviceMesh | None = None,
                          sequence_parallel: bool = False, regather: bool = True) -> int:
    """Activation bytes one block keeps (on this rank): a 2-block model less a 1-block model."""
    kw = {"tp_mesh": tp_mesh, "sequence_parallel": sequence_parallel, "regather": regather}
    one = measure_saved_bytes(args.replace(n_layers=1), mbs, seq_len, dtype, param_dtype, **kw)
    two = measure_saved_bytes(args.replace(n_layers=2), mbs, seq_len, dtype, param_dtype, **kw)
    return two.activations - one.activations
