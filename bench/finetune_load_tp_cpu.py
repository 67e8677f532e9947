"""Loading a Hugging Face base under tensor parallelism on CPU: sharded (each rank reads only
its TP shard of each tensor, `finetune.base_sharded`) against the whole read it replaces (each
rank loads the whole base, then `apply_tp` splits it). Load time, bytes read from the files and
peak host RSS per rank, 2 gloo ranks (TP 2), one thread each.

    python bench/finetune_load_tp_cpu.py --base /tmp/llama-0.5b --make \
        --out bench/results/finetune_load_tp_cpu.json

`--make` first writes a random Llama base (about 0.5B parameters, untied, vocabulary 32000,
stored in bf16) with transformers. Each mode runs in its own 2 spawned ranks. Peak RSS is the
rise of `VmHWM` over the RSS just before loading (the count restarted there), so imports and
the process group are not counted; the whole read's bytes are those of every stored tensor.
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
MODES = ("whole", "sharded")


def load_tp(directory: Path, mode: str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """This rank's TP load of HF base `directory` in `mode`; what it cost."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.finetune.base_sharded import materialize
    from scaletrain.host import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from scaletrain.models.hf import hf_model_args, load_hf_checkpoint
    from scaletrain.models.transformer import Transformer
    from scaletrain.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    reset_peak_rss()
    before = current_rss_bytes() or 0
    start = time.perf_counter()
    if mode == "whole":  # the path TP fine-tuning took before: the whole base, then split
        model, args = load_hf_checkpoint(directory, dtype=dtype)
        apply_tp(model, mesh, sequence_parallel=True, loss_parallel=True)
        nbytes = -1  # every stored tensor, read whole: counted below, outside the timing
    else:
        args = hf_model_args(directory)
        with torch.device("meta"):
            model = Transformer(args).to(dtype)
        apply_tp(model, mesh, sequence_parallel=True, loss_parallel=True)
        base = argparse.Namespace(directory=directory, args=args)
        nbytes = materialize(model, model, base, torch.device("cpu")).bytes_read  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    nbytes = stored_bytes(directory) if nbytes < 0 else nbytes
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    return {"rank": dist.get_rank(), "mode": mode, "seconds": seconds, "bytes_read": nbytes,
            "local_param_bytes": local, "rss_before": before, "peak_rise": peak - before}


def stored_bytes(directory: Path) -> int:
    """Bytes of every tensor stored in HF checkpoint `directory` (its safetensors headers)."""
    from safetensors import safe_open

    from scaletrain.models.hf_files import weight_files

    width = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
    total = 0
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                s = f.get_slice(name)
                total += int(torch.Size(s.get_shape()).numel()) * width[s.get_dtype()]
    return total


def _rank_main(rank: int, world: int, port: int, directory: str, mode: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = load_tp(Path(directory), mode)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(directory: Path, mode: str, world: int = 2) -> list[dict[str, Any]]:
    from bench._spawn import spawn_json

    return spawn_json(_rank_main, world, str(directory), mode)


def main(argv: list[str] | None = None) -> int:
    from bench.finetune_load_cpu import add_base_arguments, base_sizes, make_base

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(p, shard_size="500MB")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.make and not (a.base / "config.json").is_file():
        t = time.perf_counter()
        make_base(a.base, HALF_B, a.shard_size, getattr(torch, a.store_dtype))
        print(f"wrote {a.base} in {time.perf_counter() - t:.1f} s")
    sizes = base_sizes(a.base, torch.float32)
    print(f"base {a.base}: {sizes['params']:,} parameters, {sizes['base_bytes'] / 2**20:,.0f} "
          f"MiB in float32, largest tensor {sizes['largest_tensor_bytes'] / 2**20:,.0f} MiB; "
          "TP 2 (2 gloo ranks, 1 thread each)")
    print(f"{'mode':>8} {'rank':>4} {'load s':>7} {'read MiB':>9} {'held MiB':>9} "
          f"{'peak RSS rise MiB':>18}")
    rows = []
    for mode in a.modes:
        results = run(a.base, mode)
        rows.append({"mode": mode, "per_rank": results})
        for r in results:
            print(f"{mode:>8} {r['rank']:>4} {r['seconds']:>7.2f} "
                  f"{r['bytes_read'] / 2**20:>9.0f} {r['local_param_bytes'] / 2**20:>9.0f} "
                  f"{r['peak_rise'] / 2**20:>18.0f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"base": str(a.base), "tp": 2, "load_dtype": "float32",
                                     **sizes, "cpu_threads_per_rank": 1, "rows": rows},
                                    indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
