"""QLoRA's NF4 base in a form data parallelism can shard: every tensor of the quantized layer
a frozen `uint8` parameter.

A bitsandbytes `Linear4bit` keeps its packed codes in a `Params4bit` and the block scales in a
`QuantState` object hung on that parameter: FSDP2 would shard the codes into a DTensor and lose
the scales, and nothing would shard the scales. `NF4Linear` holds the same quantization as plain
parameters:

- `weight`: the packed 4-bit codes (two per byte), 1-D;
- `absmax`: the 8-bit per-block scales (double quantization);
- `nested_absmax`, `offset`: the fp32 scales of the scales and their mean, stored as their bytes
  (`view(torch.uint8)`), so that no mixed-precision policy casts them.

FSDP2 shards each along dim 0 like any other parameter (it never casts integer parameters; a
unit of mixed dtypes is all-gathered as bytes) and all-gathers them unchanged before the block
runs; the layer then dequantizes exactly the matrix one process dequantizes (bitsandbytes'
`dequantize_4bit` on the same bytes). The quantization itself is done once, on the whole weight
(the nested scales' offset is a mean over the whole layer), before sharding. DDP broadcasts and
never reduces the parameters (they take no gradient). The two 4-bit code books (16 and 256
values) are buffers, the same on every rank.

On one process the layers are loaded in this form too (`qlora_load`, one layer at a time) and
then handed back as the bitsandbytes layers one QLoRA process has always trained
(`to_bitsandbytes`: the same tensors, no copy of the codes).
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.finetune.qlora import _bnb


class NF4Linear(nn.Module):
    """A frozen NF4 linear layer (from a bitsandbytes `Linear4bit` with double quantization)
    whose quantized state is made of shardable `uint8` parameters (module docstring)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        state = layer.weight.quant_state
        if state.state2 is None:
            raise ValueError("NF4Linear expects double quantization (compress_statistics)")
        self.in_features, self.out_features = int(layer.in_features), int(layer.out_features)
        self.compute_dtype = layer.compute_dtype
        self.shape, self.dtype = tuple(state.shape), state.dtype
        self.blocksize, self.quant_type = state.blocksize, state.quant_type
        self.nested_blocksize, self.nested_dtype = state.state2.blocksize, state.state2.dtype

        def frozen(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().reshape(-1).contiguous(), requires_grad=False)

        self.weight = frozen(layer.weight.data)
        self.absmax = frozen(state.absmax)
        self.nested_absmax = frozen(state.state2.absmax.float().view(torch.uint8))
        self.offset = frozen(state.offset.float().reshape(1).view(torch.uint8))
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone(),
                                                                 requires_grad=False)
        self.register_buffer("code", state.code.detach().clone(), persistent=False)
        self.register_buffer("nested_code", state.state2.code.detach().clone(),
                             persistent=False)

    def quant_state(self) -> object:
        """bitsandbytes' `QuantState` over the current (whole, all-gathered) parameters."""
        F = _bnb().functional
        nested = F.QuantState(absmax=self.nested_absmax.view(torch.float32),
                              code=self.nested_code, blocksize=self.nested_blocksize,
                              dtype=self.nested_dtype)
        return F.QuantState(absmax=self.absmax, shape=torch.Size(self.shape), code=self.code,
                            blocksize=self.blocksize, quant_type=self.quant_type,
                            dtype=self.dtype, offset=self.offset.view(torch.float32)[0],
                            state2=nested)

    def dense(self, weight: torch.Tensor) -> torch.Tensor:
        """The dense (out, in) matrix of the packed codes `weight` (this layer's `weight`,
        whole: inside the FSDP unit's forward or backward)."""
        F = _bnb().functional
        return F.dequantize_4bit(weight.view(-1, 1), self.quant_state())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype
        w = self.dense(self.weight).to(dt)
        out = nn.functional.linear(x.to(dt), w, None if self.bias is None else self.bias.to(dt))
        return out.to(x.dtype)


def shardable_nf4(model: nn.Module) -> int:
    """Replace every bitsandbytes 4-bit layer of `model` (also those inside LoRA layers) by an
    `NF4Linear` holding the same quantization; returns the count. A no-op without any."""
    from scaletrain.finetune.qlora import is_nf4

    count = 0
    for name, module in list(model.named_modules()):
        if not is_nf4(module):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, NF4Linear(module))
        count += 1
    return count


def to_bitsandbytes(layer: NF4Linear) -> nn.Module:
    """The bitsandbytes `Linear4bit` holding `layer`'s quantization (whole, materialized): what
    `qlora.to_nf4` makes from the dense weight, over the same packed codes (not copied)."""
    bnb = _bnb()
    q = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          compute_dtype=layer.compute_dtype, compress_statistics=True,
                          quant_type=layer.quant_type, device="meta")
    state = layer.quant_state()
    # the fp32 scales as tensors of their own, not views of this layer's byte parameters
    state.offset = state.offset.clone()
    state.state2.absmax = state.state2.absmax.clone()
    q.weight = bnb.nn.Params4bit(layer.weight.detach().view(-1, 1), requires_grad=False,
                                 quant_state=state, blocksize=layer.blocksize,
                                 compress_statistics=True, quant_type=layer.quant_type,
                                 bnb_quantized=True)
    if layer.bias is not None:
        q.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
    return q


def bitsandbytes_nf4(model: nn.Module) -> int:
    """Replace every `NF4Linear` of `model` (also those inside LoRA layers) by the bitsandbytes
    layer holding the same quantization (`to_bitsandbytes`); returns the count."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, NF4Linear):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, to_bitsandbytes(module))
            count += 1
    return count


__all__ = ["NF4Linear", "shardable_nf4", "to_bitsandbytes", "bitsandbytes_nf4"]
