"""Vocabulary-parallel fused loss under tensor parallelism on CPU (gloo): peak memory per rank
of one micro-batch's forward + backward with the plain head + loss-parallel cross-entropy
against `training.fused_loss` (chunked, vocabulary-parallel), at a 128k vocabulary.

    python bench/fused_loss_tp_cpu.py                 # tp 2, vocab 128256, dim 256, 1024 tokens

Peak memory is the CPU allocator's: the largest "Total Allocated" of torch.profiler's memory
events during forward + backward, above the bytes allocated before it (model, inputs). Both
variants run the same model (one block, sequence parallel on, fp32) in the same ranks; each
rank reports its own figures. Raw output: bench/results/fused_loss_tp_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results" / "fused_loss_tp_cpu.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_above_start(prof: torch.profiler.profile) -> float:
    """MiB: the highest allocator total during the profile minus the total at its start."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                 if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {}))
    if not mem:
        return float("nan")
    start = mem[0][1] - mem[0][2]
    return (max(m[1] for m in mem) - start) / 2**20


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from scaletrain.models.args import ModelArgs
    from scaletrain.models.transformer import Transformer
    from scaletrain.parallel.tp import apply_tp
    from scaletrain.train.chunked_loss_tp import vocab_parallel_linear_cross_entropy
    from scaletrain.train.loss import cross_entropy_sum

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    args = ModelArgs(dim=a.dim, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=a.vocab,
                     ffn_dim=2 * a.dim, max_seq_len=a.seq, tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(args)
    apply_tp(model, mesh, sequence_parallel=True, loss_parallel=True)
    x = torch.randint(0, a.vocab, (a.batch, a.seq))
    y = torch.randint(0, a.vocab, (a.batch, a.seq))
    rows = []
    for variant in ("plain", "fused", "plain", "fused"):  # the second round is reported
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof, loss_parallel():
            if variant == "plain":
                loss = cross_entropy_sum(model(x), y)
            else:
                loss = vocab_parallel_linear_cross_entropy(model(x, hidden=True),
                                                           model.output.weight, y, a.chunk)
            loss.backward()
        seconds = time.perf_counter() - t0
        value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        rows.append({"rank": rank, "variant": variant, "loss": value,
                     "peak_above_start_mib": round(peak_above_start(prof), 1),
                     "seconds_profiled": round(seconds, 3)})
        model.zero_grad(set_to_none=True)
    tokens = a.batch * a.seq
    shard_logits = tokens * (a.vocab // world) * 4 / 2**20
    for r in rows[2:]:
        r.update(tp=world, vocab=a.vocab, dim=a.dim, tokens=tokens, chunk=a.chunk,
                 logits_shard_fp32_mib=round(shard_logits, 1),
                 chunk_logits_fp32_mib=round(a.chunk * (a.vocab // world) * 4 / 2**20, 1))
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows[2:]))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--json", type=Path, default=RESULTS)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(a.tp, free_port(), a, d), nprocs=a.tp)
        rows = [r for k in range(a.tp) for r in json.loads(Path(d, f"rank{k}.json").read_text())]
    for r in rows:
        print(json.dumps(r))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"command": " ".join(["python", *sys.argv]),
                                  "torch": torch.__version__, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
