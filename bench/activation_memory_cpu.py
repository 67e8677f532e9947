"""Activation bytes one Llama block keeps for backward: measured, planned, and Megatron-LM's
formula for the same dimensions.

Measured: what autograd saves (`train/saved_bytes.py`, storages counted once, weights and
their autocast copies left out) for a model of 2 blocks minus a model of 1 block, one forward
on CPU. Planned: `plan/memory/activations.py` for one block. Megatron: Korthikanti et al. 2022's
accounting adapted to the Llama block (`plan/memory/korthikanti.py: llama_layer_bytes`).

    python bench/activation_memory_cpu.py --model llama3.2-1b --seq 2048 --dtype bf16

Run it on two source trees (PYTHONPATH) to compare layer implementations; raw JSON goes to
bench/results/activation_memory_cpu.json (appended, one object per run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import scaletrain
from scaletrain.models.args import ModelArgs, get_preset
from scaletrain.plan.memory.activations import ActivationSpec, plain_layer
from scaletrain.plan.memory.korthikanti import llama_layer_bytes
from scaletrain.train.saved_bytes import per_layer_saved_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "activation_memory_cpu.json"


def per_layer(args: ModelArgs, mbs: int, seq: int, dtype: str) -> dict[str, float]:
    spec = ActivationSpec(mbs=mbs, seq_len=seq, compute_dtype=dtype, residual_dtype=dtype,
                          kernels="cpu")
    return {"measured": per_layer_saved_bytes(args, mbs, seq, dtype, dtype),
            "planned": sum(plain_layer(args, spec).values()),
            "megatron": llama_layer_bytes(args, mbs * seq)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--label", default=None, help="name of this source tree in the results")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    args = get_preset(a.model)
    row = per_layer(args, a.mbs, a.seq, a.dtype)
    tree = Path(scaletrain.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    result = {"label": a.label or commit, "tree": str(tree), "commit": commit,
              "model": a.model, "seq": a.seq, "mbs": a.mbs, "dtype": a.dtype,
              **{k: int(v) for k, v in row.items()}}
    mib = 2**20
    print(f"{result['label']}: {a.model} one block, seq {a.seq} x mbs {a.mbs}, {a.dtype}: "
          f"measured {row['measured'] / mib:.1f} MiB, planned {row['planned'] / mib:.1f} MiB, "
          f"Megatron formula {row['megatron'] / mib:.1f} MiB "
          f"(measured / Megatron = {row['measured'] / row['megatron']:.2f})")
    with open(a.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
