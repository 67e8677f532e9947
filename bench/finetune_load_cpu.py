"""Sharded loading of a Hugging Face base on CPU: load time and peak host RSS per rank for
1, 2 and 4 ranks (gloo), each rank building the model on the meta device, sharding it with
FSDP2 and reading only its shards from the safetensors files (`finetune.base_sharded`).

    python bench/finetune_load_cpu.py --base /tmp/llama-1b --make --ranks 1 2 4 \
        --out bench/results/finetune_load_cpu.json

`--make` first writes a random Llama base with transformers from a config (TinyLlama-1.1B's
dimensions by default: 1.1B parameters, untied, vocabulary 32000), saved with safetensors in
shards of `--shard-size`. Peak RSS is the rise of `VmHWM` over the process's RSS just before
loading (the count restarted there), so imports and the process group are not counted.
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

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                 max_position_embeddings=2048, tie_word_embeddings=False)


def make_base(directory: Path, dims: dict[str, Any], shard_size: str,
              dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A random Llama base written by transformers (`save_pretrained`, safetensors shards)."""
    import transformers

    cfg = transformers.LlamaConfig(**dims, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # random values, drawn in place (no second copy)
            p.normal_(0.0, 0.02, generator=g)
    model.to(dtype)
    model.save_pretrained(directory, max_shard_size=shard_size, safe_serialization=True)
    return directory


def load_on_rank(directory: Path, dtype: torch.dtype = torch.float32,
                 mesh_shape: tuple[int, ...] | None = None) -> tuple[Any, dict[str, Any]]:
    """This rank's sharded load of HF base `directory` under FSDP2 (every rank of the process
    group one shard): (model, {seconds, bytes_read, rss_before, peak_rise, ...})."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.finetune.base_sharded import materialize
    from scaletrain.host import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from scaletrain.models.hf import hf_model_args
    from scaletrain.models.transformer import Transformer
    from scaletrain.parallel.fsdp import apply_fsdp

    world = dist.get_world_size()
    args = hf_model_args(directory)
    reset_peak_rss()
    before = current_rss_bytes()
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    mesh = init_device_mesh("cpu", mesh_shape or (world,), mesh_dim_names=("dp_shard",))
    apply_fsdp(model, mesh, reshard_after_forward=True)
    base = argparse.Namespace(directory=directory, args=args)
    report = materialize(model, model, base, torch.device("cpu"))  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    return model, {"rank": dist.get_rank(), "world": world, "seconds": seconds,
                   "bytes_read": report.bytes_read, "local_param_bytes": local,
                   "rss_before": before, "peak_rise": peak - before}


def base_sizes(directory: Path, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of the whole base and of its largest tensor, in `dtype`."""
    from scaletrain.models.hf import hf_model_args
    from scaletrain.models.hf_files import header_shapes, weight_files

    shapes = header_shapes(weight_files(directory))
    size = torch.tensor([], dtype=dtype).element_size()
    numels = [int(torch.Size(s).numel()) for s in shapes.values()]
    hf_model_args(directory)
    return {"params": sum(numels), "base_bytes": sum(numels) * size,
            "largest_tensor_bytes": max(numels) * size}


def plan_peak(directory: Path, world: int) -> int:
    """What `scaletrain plan --method lora --dp WORLD --zero 3` states for this base's load
    (`plan.finetune.host`; fp32 shards + the largest tensor read in bf16 and cast)."""
    from scaletrain.models.hf import hf_model_args
    from scaletrain.plan.finetune.host import host_load_bytes

    return int(host_load_bytes(hf_model_args(directory), "lora", world)["peak"])


def _rank_main(rank: int, world: int, port: int, directory: str, dtype: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _, result = load_on_rank(Path(directory), getattr(torch, dtype))
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(directory: Path, world: int, dtype: str) -> list[dict[str, Any]]:
    from bench._spawn import spawn_json

    return spawn_json(_rank_main, world, str(directory), dtype)


def add_base_arguments(p: argparse.ArgumentParser, shard_size: str) -> None:
    """The base options the load benches share: the folder, and how `--make` writes it."""
    p.add_argument("--base", type=Path, required=True, help="HF base directory")
    p.add_argument("--make", action="store_true", help="write a random base there first")
    p.add_argument("--shard-size", default=shard_size, help="--make: safetensors shard size")
    p.add_argument("--store-dtype", default="bfloat16", help="--make: stored dtype")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(p, shard_size="500MB")
    p.add_argument("--dtype", default="float32", help="dtype the model is loaded in")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.make and not (a.base / "config.json").is_file():
        t = time.perf_counter()
        make_base(a.base, TINYLLAMA, a.shard_size, getattr(torch, a.store_dtype))
        print(f"wrote {a.base} in {time.perf_counter() - t:.1f} s")
    sizes = base_sizes(a.base, getattr(torch, a.dtype))
    print(f"base {a.base}: {sizes['params']:,} parameters, {sizes['base_bytes'] / 2**20:,.0f} "
          f"MiB in {a.dtype}, largest tensor {sizes['largest_tensor_bytes'] / 2**20:,.0f} MiB")
    rows = []
    print(f"{'ranks':>5} {'load s (max)':>12} {'peak RSS rise MiB (max)':>24} "
          f"{'base/N + largest MiB':>21} {'plan MiB':>9} {'read MiB/rank':>14}")
    for world in a.ranks:
        results = run(a.base, world, a.dtype)
        bound = sizes["base_bytes"] / world + sizes["largest_tensor_bytes"]
        planned = plan_peak(a.base, world)
        row = {"ranks": world, "per_rank": results,
               "load_seconds_max": max(r["seconds"] for r in results),
               "peak_rss_rise_max": max(r["peak_rise"] for r in results),
               "base_over_n_plus_largest": bound, "plan_host_peak": planned}
        rows.append(row)
        print(f"{world:>5} {row['load_seconds_max']:>12.2f} "
              f"{row['peak_rss_rise_max'] / 2**20:>24.0f} {bound / 2**20:>21.0f} "
              f"{planned / 2**20:>9.0f} {max(r['bytes_read'] for r in results) / 2**20:>14.0f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"base": str(a.base), "dtype": a.dtype, **sizes,
                                     "cpu_threads_per_rank": 1, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
