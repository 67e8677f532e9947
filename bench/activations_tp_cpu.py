"""Activation bytes one Llama block keeps per rank under tensor parallelism (2 gloo processes
on CPU), with and without sequence parallelism: measured, planned, and Megatron-LM's formula.

Measured: what autograd saves on rank 0 (storages counted once, a DTensor by its local shard,
parameters left out) for a model of 2 blocks minus a model of 1 block, one forward, 16-bit
parameters (Megatron's setting). The measurement is in this file so that it runs on any
source tree: point PYTHONPATH at another checkout to measure its layers ("before").
Planned: that tree's `plan/memory/activations.py` for one block. Megatron: Korthikanti et al. 2022
(arXiv:2205.05198, table 2) adapted to the Llama block as `plan/memory/korthikanti.py` does,
in bytes per token: tensor parallel 8 h + (4 h + 4 g d + 6 f) / t, with sequence
parallelism (12 h + 4 g d + 6 f) / t. The vocabulary is cut to `--vocab` (it does not enter a
block's count; the embedding and loss cancel in the difference).

    python bench/activations_tp_cpu.py --label after
    PYTHONPATH=/path/to/old/tree python bench/activations_tp_cpu.py --label before

Raw JSON: bench/results/activations_tp_cpu.json (appended, one object per mode and run).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "activations_tp_cpu.json"
# (sequence parallel, re-gather): the "dtensor" row exists only on trees with the switch
MODES = {"tp": (False, True), "tp-sp": (True, True), "tp-sp-dtensor": (True, False)}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return getattr(t, "elem", t)  # an asynchronous collective's result


def _measure(args: Any, mbs: int, seq: int, mesh: Any, sp: bool, regather: bool) -> int:
    from scaletrain.models.transformer import build_model
    from scaletrain.parallel.tp import apply_tp

    model = build_model(args, seed=0).to(torch.bfloat16)
    extra = {"regather": regather} if "regather" in inspect.signature(apply_tp).parameters \
        else {}
    apply_tp(model, mesh, sequence_parallel=sp, loss_parallel=False, **extra)
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = _local(t).untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    tokens = torch.randint(0, args.vocab_size, (mbs, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
    del loss, logits
    return sum(seen.values())


def _planned(args: Any, mbs: int, seq: int, t: int, sp: bool, regather: bool) -> int:
    from scaletrain.plan.memory.activations import ActivationSpec, plain_layer

    kw = {"sp_regather": regather} if "sp_regather" in {
        f.name for f in dataclasses.fields(ActivationSpec)} else {}
    spec = ActivationSpec(mbs=mbs, seq_len=seq, compute_dtype="bf16", residual_dtype="bf16",
                          tp=t, sequence_parallel=sp, kernels="cpu", **kw)
    return sum(plain_layer(args, spec).values())


def megatron(args: Any, tokens: int, t: int, sp: bool) -> float:
    h, f, gd = args.dim, args.hidden_dim, args.kv_heads * args.head_dim
    if sp:
        return tokens * (12 * h + 4 * gd + 6 * f) / t
    return tokens * (8 * h + (4 * h + 4 * gd + 6 * f) / t)


def _worker(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.models.args import get_preset
    from scaletrain.parallel.tp import apply_tp

    has_switch = "regather" in inspect.signature(apply_tp).parameters
    args = get_preset(a.model).replace(vocab_size=a.vocab)
    mesh = init_device_mesh("cpu", (world,))
    rows = {}
    for mode, (sp, rg) in MODES.items():
        if mode == "tp-sp-dtensor" and not has_switch:
            continue
        one = _measure(args.replace(n_layers=1), a.mbs, a.seq, mesh, sp, rg)
        two = _measure(args.replace(n_layers=2), a.mbs, a.seq, mesh, sp, rg)
        rows[mode] = {"measured": two - one,
                      "planned": _planned(args, a.mbs, a.seq, world, sp, rg),
                      "megatron": megatron(args, a.mbs * a.seq, world, sp)}
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--label", default=None, help="name of this source tree in the results")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    import scaletrain

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"activations_tp_{os.getpid()}.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(a.tp, port, a, str(tmp)), nprocs=a.tp)
    rows = torch.load(tmp)
    tmp.unlink()
    tree = Path(scaletrain.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    mib = 2**20
    print(f"{a.label or commit}: {a.model} block dims, seq {a.seq} x mbs {a.mbs}, bf16, "
          f"TP{a.tp}, per rank and layer (MiB)")
    print(f"{'mode':<15}{'measured':>10}{'planned':>10}{'Megatron':>10}{'meas/Meg':>10}")
    with open(a.out, "a") as f:
        for mode, row in rows.items():
            print(f"{mode:<15}{row['measured'] / mib:>10.2f}{row['planned'] / mib:>10.2f}"
                  f"{row['megatron'] / mib:>10.2f}{row['measured'] / row['megatron']:>10.3f}")
            f.write(json.dumps({"label": a.label or commit, "tree": str(tree), "commit": commit,
                                "model": a.model, "seq": a.seq, "mbs": a.mbs, "tp": a.tp,
                                "vocab": a.vocab, "dtype": "bf16", "mode": mode,
                                **{k: int(v) for k, v in row.items()}}) + "\n")


if __name__ == "__main__":
    main()
