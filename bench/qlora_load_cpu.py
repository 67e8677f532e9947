"""QLoRA's base loaded layer by layer on CPU (`finetune.qlora_load`): load time and peak host
RSS per rank on one process and for 2 and 4 ranks (gloo) under FSDP2, against the whole-base
load QLoRA did before (the fp32 base read on each process, then quantized).

    python bench/qlora_load_cpu.py --base /tmp/llama-05b --make --ranks 1 2 4 \
        --out bench/results/qlora_load_cpu.json

`--make` first writes a random Llama base with transformers (`bench/finetune_load_cpu.py`'s
`make_base`; by default ~0.5B parameters: dim 1536, 16 layers, MLP 4096, vocabulary 32000,
stored bf16 in shards of `--shard-size`). One rank (`one`) is the trainer's path without
torchrun: the model built on the meta device with empty NF4 layers, filled layer by layer
(`materialize_qlora`), the layers made bitsandbytes `Linear4bit`, then the LoRA adapters (r=8,
every projection). Several ranks (`fsdp`): each rank builds the model on the meta device with
empty NF4 layers and LoRA adapters, shards it with FSDP2 and fills it. Peak RSS is the rise of
`VmHWM` over the process's RSS just before loading (bitsandbytes imported and one layer
quantized first), so imports and the process group are not counted. `--whole` adds the
previous path on one process (whole fp32 base, then quantized) as the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HALF_B = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
              num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
              max_position_embeddings=2048, tie_word_embeddings=False)


def warm_up() -> None:
    """Import bitsandbytes and quantize one block, so that its libraries are not counted."""
    from scaletrain.finetune.qlora_load import _reference

    _reference(torch.float32)


def build_meta(directory: Path, whole: bool = False, load: bool = False) -> tuple[Any, Any]:
    """(model with LoRA adapters over NF4 layers, base) as the trainer builds them: on the meta
    device with empty NF4 layers (`load`: filled layer by layer before the adapters are made,
    as bitsandbytes layers: one process), or (`whole`) from the whole fp32 base quantized after
    it."""
    from scaletrain.finetune.lora import LoRASettings
    from scaletrain.finetune.methods import apply_method
    from scaletrain.finetune.qlora_load import materialize_qlora
    from scaletrain.models.hf import hf_model_args, load_hf_checkpoint
    from scaletrain.models.transformer import Transformer

    args = hf_model_args(directory)
    base = argparse.Namespace(directory=directory, args=args, report=None)
    if whole:
        model = load_hf_checkpoint(directory, dtype=torch.float32)[0]
    else:
        with torch.device("meta"):
            model = Transformer(args)

    def fill(meta: Any) -> None:
        base.report = materialize_qlora(meta, meta, base, torch.device("cpu"),
                                        bitsandbytes=True)

    apply_method(model, "qlora", lora=LoRASettings(), quant_dtype=torch.float32, seed=0,
                 load_quantized=fill if load else None)
    return model, base


def load_on_rank(directory: Path, mode: str = "fsdp") -> tuple[Any, dict[str, Any]]:
    """This rank's QLoRA load of HF base `directory`: `fsdp` (sharded over every rank of the
    process group, filled layer by layer), `ddp` (whole NF4 layers, filled layer by layer),
    `one` (one process, no process group: filled layer by layer as bitsandbytes layers) or
    `whole` (one process: the fp32 base read, then quantized: the path before)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.finetune.qlora_load import materialize_qlora
    from scaletrain.finetune.qlora_shard import shardable_nf4
    from scaletrain.host import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from scaletrain.parallel.fsdp import apply_fsdp

    warm_up()
    reset_peak_rss()
    before = current_rss_bytes()
    start = time.perf_counter()
    model, base = build_meta(directory, whole=mode == "whole", load=mode == "one")
    nbytes = None
    if mode == "whole":
        shardable_nf4(model)
    elif mode == "one":
        nbytes = base.report.bytes_read
    else:
        if mode == "fsdp":
            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
            apply_fsdp(model, mesh, reshard_after_forward=True)
        nbytes = materialize_qlora(model, model, base, torch.device("cpu")).bytes_read
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local")
                else p.numel() * p.element_size() for p in model.parameters())
    return model, {"rank": dist.get_rank() if dist.is_initialized() else 0, "mode": mode,
                   "world": dist.get_world_size() if dist.is_initialized() else 1,
                   "seconds": seconds, "bytes_read": nbytes, "local_param_bytes": local,
                   "rss_before": before, "peak_rise": peak - before}


def plan_peak(directory: Path, world: int, stored_bytes: int) -> int:
    """What `scaletrain plan --method qlora --dp WORLD --zero 3` (one process: no --dp) states
    for this base's load."""
    from scaletrain.models.hf import hf_model_args
    from scaletrain.plan.finetune.host import host_load_bytes

    return int(host_load_bytes(hf_model_args(directory), "qlora", world, stored_bytes)["peak"])


def _rank_main(rank: int, world: int, port: int, directory: str, mode: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if mode in ("one", "whole"):  # one process, no process group
        _, result = load_on_rank(Path(directory), mode)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        return
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _, result = load_on_rank(Path(directory), mode)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(directory: Path, world: int, mode: str) -> list[dict[str, Any]]:
    from bench._spawn import spawn_json

    return spawn_json(_rank_main, world, str(directory), mode)


def main(argv: list[str] | None = None) -> int:
    from bench.finetune_load_cpu import add_base_arguments, base_sizes, make_base

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(p, shard_size="300MB")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--whole", action="store_true",
                   help="also the previous path (whole fp32 base, then quantized) on 1 rank")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.make and not (a.base / "config.json").is_file():
        t = time.perf_counter()
        make_base(a.base, HALF_B, a.shard_size, getattr(torch, a.store_dtype))
        print(f"wrote {a.base} in {time.perf_counter() - t:.1f} s")
    fp32 = base_sizes(a.base, torch.float32)
    stored = base_sizes(a.base, getattr(torch, a.store_dtype))
    print(f"base {a.base}: {fp32['params']:,} parameters, {fp32['base_bytes'] / 2**20:,.0f} MiB "
          f"in fp32, {stored['base_bytes'] / 2**20:,.0f} MiB stored ({a.store_dtype}), largest "
          f"tensor {fp32['largest_tensor_bytes'] / 2**20:,.0f} MiB in fp32")
    size = torch.tensor([], dtype=getattr(torch, a.store_dtype)).element_size()
    rows = []
    print(f"{'ranks':>5} {'path':>6} {'load s (max)':>12} {'peak RSS rise MiB (max)':>24} "
          f"{'plan MiB':>9} {'kept MiB/rank':>14}")
    runs = [(1, "whole")] if a.whole else []
    runs += [(w, "one" if w == 1 else "fsdp") for w in a.ranks]
    for world, mode in runs:
        results = run(a.base, world, mode)
        planned = plan_peak(a.base, world, size) if mode != "whole" else None
        row = {"ranks": world, "path": mode, "per_rank": results,
               "load_seconds_max": max(r["seconds"] for r in results),
               "peak_rss_rise_max": max(r["peak_rise"] for r in results),
               "plan_host_peak": planned}
        rows.append(row)
        print(f"{world:>5} {mode:>6} {row['load_seconds_max']:>12.2f} "
              f"{row['peak_rss_rise_max'] / 2**20:>24.0f} "
              f"{planned / 2**20 if planned else float('nan'):>9.0f} "
              f"{max(r['local_param_bytes'] for r in results) / 2**20:>14.0f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"base": str(a.base), "store_dtype": a.store_dtype,
                                     "fp32": fp32, "stored": stored,
                                     "cpu_threads_per_rank": 1, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
