"""LoRA layers under tensor parallelism: the block plan of `parallel/tp.py` with each adapted
projection split into its base and its two adapter matrices.

For `y = W x + s B (A x)`:

- **column-parallel** projections (q, k, v, gate, up: `W` sharded by output rows): `B` is
  sharded by output rows like `W` (each rank computes its slice of the update), `A` is
  replicated. The gradient of `A x` sums the contributions of every rank's `B` slice: it is
  all-reduced in backward (DTensor's column-parallel input), so `A`'s gradient is the whole
  one on every rank.
- **row-parallel** projections (o, down: `W` sharded by input columns, the input sharded
  likewise): `A` is sharded by input columns like `W`, and its r-wide output `A x` (a partial
  sum per rank) is all-reduced, tokens x r values, before the replicated `B`; the update
  then takes the base output's layout (whole, or sharded over the sequence under sequence
  parallelism).

Every parameter stays a DTensor, so clipping, the optimizer, FSDP over the TP shards and the
checkpoints treat adapters as the training path treats any parameter; the arithmetic is the
single-process arithmetic up to the order of the sums. The layers run composed (`base(x) +
lora_B(lora_A(x) * s)`), not fused: DTensor shards each matmul.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from scaletrain.finetune.lora import LoRALinear


class ReplicatedLinear(ParallelStyle):
    """A linear layer whose weight is replicated over the TP ranks: the input (a plain tensor
    holding the whole value, or a DTensor) is taken as replicated; the output is laid out as
    `output_layout` and handed on as a plain tensor."""

    def __init__(self, output_layout: object | None = None) -> None:
        super().__init__()
        self.output_layout = output_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(t.redistribute(mesh, [Replicate()]) if isinstance(t, DTensor)
                         else DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                         for t in inputs)

        def to_local(_: nn.Module, out: DTensor, mesh: DeviceMesh) -> object:
            return out.redistribute(mesh, [self.output_layout]).to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def adapter_plan(block: nn.Module, plan: dict[str, object]) -> dict[str, object]:
    """`plan` (a block's TP plan) with every entry for a LoRA layer replaced by the plans of
    its base and adapter matrices (module docstring); other entries unchanged."""
    out: dict[str, object] = {}
    for name, style in plan.items():
        try:
            module = block.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, LoRALinear):
            out[name] = style
            continue
        module.fused = None  # DTensor shards the composed matmuls
        if isinstance(style, ColwiseParallel):
            out.update({f"{name}.base": style, f"{name}.lora_A": ReplicatedLinear(),
                        f"{name}.lora_B": ColwiseParallel()})
        elif isinstance(style, RowwiseParallel):
            out.update({f"{name}.base": style,
                        f"{name}.lora_A": RowwiseParallel(output_layouts=Replicate()),
                        f"{name}.lora_B": ReplicatedLinear(style.output_layouts[0])})
        else:
            raise ValueError(f"{name}: no tensor-parallel plan for a LoRA layer under "
                             f"{type(style).__name__}")
    return out


__all__ = ["ReplicatedLinear", "adapter_plan"]
