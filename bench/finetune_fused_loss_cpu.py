"""Bytes a LoRA fine-tuning step keeps for backward with and without `training.fused_loss`,
measured (every tensor autograd saves, via `torch.autograd.graph.saved_tensors_hooks`:
`train/saved_bytes.py`) on a small Llama-shaped model with Llama 3's 128,256-token
vocabulary, next to what `plan --method lora [--fused-loss]` plans for the same shape
(activations and the transient logits/loss buffers, which saved-tensor hooks do not see).

    python bench/finetune_fused_loss_cpu.py [--seq-len 1024] [--mbs 1] [--chunk 512]
"""

from __future__ import annotations

import argparse
from typing import Any

from scaletrain.config import ActivationCheckpointConfig
from scaletrain.finetune.lora import TARGETS, LoRASettings
from scaletrain.finetune.methods import apply_method
from scaletrain.models.args import ModelArgs
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.finetune.plan import finetune_plan
from scaletrain.plan.layout import Layout
from scaletrain.train.saved_bytes import measure_saved_bytes

MIB = 2**20
ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128256, ffn_dim=768,
                 max_seq_len=4096)


def lora(model: Any) -> Any:
    apply_method(model, "lora", lora=LoRASettings(8, 16.0, 0.0, tuple(TARGETS)))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512)
    a = p.parse_args()
    print(f"LoRA r8 (all block linears), dim {ARGS.dim}, {ARGS.n_layers} blocks, vocabulary "
          f"{ARGS.vocab_size:,}; {a.mbs} x {a.seq_len} tokens, bf16 autocast over fp32 "
          f"parameters, fused-loss chunk {a.chunk} tokens (MiB)")
    print(f"{'loss':<8} {'saved (measured)':>17} {'activations (plan)':>19} "
          f"{'logits_loss (plan)':>19}")
    for fused in (False, True):
        measured = measure_saved_bytes(ARGS, a.mbs, a.seq_len, "bf16", "fp32",
                                       ActivationCheckpointConfig(), fused_loss=fused,
                                       loss_chunk=a.chunk, finetune=lora)
        lay = Layout(dims=ParallelDims(), mbs=a.mbs, seq_len=a.seq_len, precision="bf16",
                     param_dtype="fp32", kernels="cpu", fused_loss=fused, loss_chunk=a.chunk)
        mem = finetune_plan(estimate(ARGS, lay), "lora", rank=8).memory_bytes
        saved = measured.activations + measured.weight_copies
        planned = mem["activations"] + mem["cast_weights"]
        print(f"{'fused' if fused else 'logits':<8} {saved / MIB:>17.1f} {planned / MIB:>19.1f} "
              f"{mem['logits_loss'] / MIB:>19.1f}")


if __name__ == "__main__":
    main()
