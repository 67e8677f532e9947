"""apply_tp: tensor parallelism (Megatron-style) with optional sequence parallelism, on DTensor.

Per block: Q/K/V and gate/up projections column-wise (each rank owns a slice of the heads or
of the hidden units), output and down projections row-wise (partial sums reduced). With
sequence parallelism the norms and the residual stream between blocks are sharded along the
sequence: the all-reduce after a row-wise layer becomes a reduce-scatter and the input of the
next column-wise layer an all-gather (together the same bytes as the all-reduce). The norms and
the residual stream then take 1/tp of their memory, and the column-wise q/k/v and w1/w3
projections keep only the sequence shard of their input for backward, which all-gathers it
again (`sp_regather.py`, as Megatron-LM does; DTensor's `ColwiseParallel` would keep the
gathered input, t times the bytes): every activation of the block is divided by tp, at the
cost of one more all-gather per attention and MLP in backward. The arithmetic is DTensor's
(bitwise equal); `regather=False` keeps DTensor's path. The head still keeps its gathered input
(once per model). `plan/memory/activations.py` counts what is saved; `plan/timing/comm.py` the
collectives.
The embedding is vocabulary-parallel (row-wise over vocabulary rows); the head is column-wise
over the vocabulary and, with `loss_parallel`, its logits stay sharded: the cross-entropy is
computed on the shards and the full logits are never gathered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from scaletrain.models.moe import MoE
from scaletrain.parallel.ep_tp import apply_moe_ep_tp
from scaletrain.parallel.moe_tp import apply_moe_tp
from scaletrain.parallel.sp_regather import ColwiseFromShard, GatherSequence

log = logging.getLogger(__name__)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
             loss_parallel: bool, regather: bool = True,
             ep_tp_mesh: DeviceMesh | None = None,
             block_plan: Callable[[nn.Module, dict[str, object]], dict[str, object]]
             | None = None) -> None:
    """Shard `model` (a Transformer or a pipeline stage of one) over `tp_mesh` in place.

    `ep_tp_mesh`: the 2-D `(ep, tp)` mesh when expert parallelism is composed with TP: the
    routed experts are split over both (`parallel/ep_tp.py`) instead of over `tp` only.

    `regather` (sequence parallelism only): the column-wise projections save the sequence
    shard of their input and all-gather it again in backward (`sp_regather.py`); False keeps
    DTensor's `PrepareModuleInput` + `ColwiseParallel`, which save the gathered input (the
    same numbers, t times the bytes; kept to measure the difference).

    `block_plan(block, plan)`: rewrites each block's plan before it is applied (fine-tuning
    splits the plan of a LoRA layer into its base's and its adapter's: `finetune/lora_tp.py`)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        if sequence_parallel:
            top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if getattr(model, "pos_embeddings", None) is not None:
        if sequence_parallel:
            _positions_of_the_shard(model.pos_embeddings, tp_mesh)
        else:
            _replicate(model.pos_embeddings, tp_mesh)
    if model.args.arch != "llama" and not sequence_parallel and model.output is not None:
        _replicate(model.norm, tp_mesh)
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Both are sharded over the vocabulary (Shard(0) of a (vocab, dim) weight), so the head
        # can share the embedding's DTensor again (parallelize_module distributed each apart).
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan: dict[str, object] = {
            **_colwise_plan("attention", ("wq", "wk", "wv"), seq,
                            sequence_parallel and regather
                            and _plain_linears(block.attention, ("wq", "wk", "wv")),
                            n_inputs=3),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if isinstance(block.feed_forward, MoE):
            plan.update(_moe_plan(block.feed_forward, tp_mesh, seq, sequence_parallel,
                                  ep_tp_mesh))
        else:
            # GPT-2's GELU MLP has no gate (w3)
            names = ("w1", "w3") if block.feed_forward.w3 is not None else ("w1",)
            plan.update(_colwise_plan("feed_forward", names, seq,
                                      sequence_parallel and regather
                                      and _plain_linears(block.feed_forward, names), n_inputs=1))
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        plan.update(_family_plan(block, sequence_parallel))
        if block_plan is not None:
            plan = block_plan(block, plan)
        parallelize_module(block, tp_mesh, plan)
        if model.args.arch != "llama" and not sequence_parallel:
            # LayerNorm biases would otherwise share the optimizer's no-decay group, as plain
            # tensors, with the DTensor biases of the projections.
            _replicate(block.attention_norm, tp_mesh)
            _replicate(block.ffn_norm, tp_mesh)
    log.info("tensor parallel over %d ranks (sequence parallel %s, loss parallel %s)",
             tp_mesh.size(), sequence_parallel, loss_parallel)


def _plain_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    """The projections are plain `nn.Linear`s, which the re-gather path computes itself; other
    linears (torchao's float8 ones) keep their own forward on DTensor's path."""
    return all(type(getattr(module, n)) is nn.Linear for n in names)


def _colwise_plan(module: str, projections: tuple[str, ...], seq: object, regather: bool,
                  n_inputs: int) -> dict[str, object]:
    """The input of `module` (sharded over the sequence under sequence parallelism) made whole
    for its column-wise `projections`: by DTensor (which saves the gathered input in each
    projection) or, with `regather`, by `GatherSequence` + `ColwiseFromShard` (which save the
    shard and gather it again in backward)."""
    if regather:
        gather = GatherSequence()
        return {module: gather, **{f"{module}.{p}": ColwiseFromShard(gather)
                                   for p in projections}}
    rest = (None,) * (n_inputs - 1)
    return {module: PrepareModuleInput(input_layouts=(seq, *rest),
                                       desired_input_layouts=(Replicate(), *rest)),
            **{f"{module}.{p}": ColwiseParallel() for p in projections}}


def _moe_plan(moe: MoE, tp_mesh: DeviceMesh, seq: object, sequence_parallel: bool,
              ep_tp_mesh: DeviceMesh | None = None) -> dict[str, object]:
    """A Mixture-of-Experts MLP: the whole sequence in (as a plain tensor), experts split
    over the TP ranks (`parallel/moe_tp.py`), shared experts column/row parallel."""
    if ep_tp_mesh is None:
        apply_moe_tp(moe, tp_mesh, sequence_parallel)
    else:  # expert parallelism composed with TP: experts over (ep, tp)
        apply_moe_ep_tp(moe, tp_mesh, ep_tp_mesh, sequence_parallel)
    plan: dict[str, object] = {
        "feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                           desired_input_layouts=(Replicate(),),
                                           use_local_output=True)}
    if moe.shared is not None:
        plan.update({"feed_forward.shared.w1": ColwiseParallel(),
                     "feed_forward.shared.w3": ColwiseParallel(),
                     "feed_forward.shared.w2": RowwiseParallel(output_layouts=seq)})
    return plan


def _family_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    """Plans for the parameters some families add to the block (q/k/v biases are sharded with
    their ColwiseParallel weights).

    Qwen3's per-head q/k norms see (batch, seq, local heads, head_dim): their weights are
    replicated DTensors and the input is declared sharded over heads (dim 2), so each weight's
    gradient is summed over the heads of every rank. Gemma 2's post-norms act on the output of
    a row-wise layer: sharded over the sequence under sequence parallelism, whole otherwise.
    """
    plan: dict[str, object] = {}
    if getattr(block.attention, "q_norm", None) is not None:
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel and getattr(block, "post_attention_norm", None) is not None:
        plan["post_attention_norm"] = SequenceParallel(use_local_output=True)
        plan["post_ffn_norm"] = SequenceParallel(use_local_output=True)
    return plan


def _positions_of_the_shard(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """GPT-2's learned position table under sequence parallelism: a replicated DTensor that
    looks up every position and hands back this rank's sequence shard of the result (a local
    slice, the sequence shard the embedding's output holds). Its backward all-gathers the
    shards' gradients, so the table's gradient is the whole sequence's on every rank."""

    def to_dtensor(_: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     for t in inputs)

    def to_shard(_: nn.Module, out: DTensor, __: DeviceMesh) -> object:
        # (seq, dim) for 1-D positions, (batch, seq, dim) for per-row ones
        return out.redistribute(placements=[Shard(out.ndim - 2)]).to_local()

    distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_shard)


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """`module`'s parameters as replicated DTensors, taking and returning plain tensors (so the
    optimizer and clipping see one kind of parameter). Used for GPT-2's learned position table
    without sequence parallelism, where it is added to the whole (replicated) embedding output,
    and its LayerNorms."""

    def to_dtensor(_: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     for t in inputs)

    def to_local(_: nn.Module, out: DTensor, __: DeviceMesh) -> object:
        return out.to_local()

    distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)
