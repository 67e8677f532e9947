"""One projection three ways: full fine-tuning, LoRA composed by autograd, LoRA fused.

    python bench/lora_layer.py                       # CPU, llama3.2-1b's MLP up-projection
    python bench/lora_layer.py --device cuda --tokens 16384

For each variant: forward + backward time (the best of `--reps` interleaved rounds, so the
variants share the machine's load), the bytes autograd keeps for backward (saved tensors,
parameters excluded, 16-bit weight copies included) and, on CUDA, the peak memory of one step.
`composed` is the LoRA layer with the fused path turned off (a subclassed base): the same
adapter, autograd composing base(x) + B(A(x)) as PEFT does.
Raw output goes to bench/results/lora_layer_<device>.txt (and .json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from scaletrain.finetune.lora import LoRALinear


class _Composed(nn.Linear):
    """Not exactly nn.Linear, so LoRALinear composes it with autograd."""


def _variants(d_in: int, d_out: int, rank: int, device: str) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    full = nn.Linear(d_in, d_out, bias=False, device=device)
    base = nn.Linear(d_in, d_out, bias=False, device=device)
    other = _Composed(d_in, d_out, bias=False, device=device)
    other.load_state_dict(base.state_dict())
    return {"full": full, "lora composed": LoRALinear(other, rank, 2.0 * rank),
            "lora fused": LoRALinear(base, rank, 2.0 * rank)}


def _saved_bytes(layer: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> int:
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(x.device.type, dtype=dtype):
        layer(x)
    return sum(seen.values())


def _step(layer: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> None:
    with torch.autocast(x.device.type, dtype=dtype):
        y = layer(x)
    y.backward(torch.ones_like(y))
    for p in layer.parameters():
        p.grad = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--d-in", type=int, default=2048)
    p.add_argument("--d-out", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dtype = torch.bfloat16
    layers = _variants(a.d_in, a.d_out, a.rank, a.device)
    x = torch.randn(a.tokens, a.d_in, device=a.device, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    best = {k: float("inf") for k in layers}
    peak = {}
    for name, layer in layers.items():  # warm-up, and the peak of one step
        _step(layer, x, dtype)
        if a.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            _step(layer, x, dtype)
            peak[name] = torch.cuda.max_memory_allocated() / 2**20
    for _ in range(a.reps):
        for name, layer in layers.items():
            sync()
            t0 = time.perf_counter()
            _step(layer, x, dtype)
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    rows = []
    for name, layer in layers.items():
        saved = _saved_bytes(layer, x, dtype) / 2**20
        rows.append({"variant": name, "ms": round(best[name] * 1e3, 2),
                     "tokens_per_s": round(a.tokens / best[name]), "saved_mib": round(saved, 2),
                     "peak_mib": round(peak[name], 1) if name in peak else None})
    head = (f"# {a.device}, bf16 autocast, fp32 weights, {a.tokens} tokens x {a.d_in} -> "
            f"{a.d_out}, LoRA r={a.rank}; best of {a.reps} interleaved rounds")
    lines = [head, "| variant | fwd+bwd ms | tokens/s | saved MiB | peak MiB |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['ms']} | {r['tokens_per_s']:,} | {r['saved_mib']} | "
              f"{r['peak_mib'] if r['peak_mib'] is not None else '-'} |" for r in rows]
    print("\n".join(lines))
    out = Path(a.out or f"bench/results/lora_layer_{a.device.split(':')[0]}.txt")
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
