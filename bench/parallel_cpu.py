"""CPU (gloo) measurements for the parallel layouts; prints tables, writes
bench/results/parallel_cpu.json.

1. Bytes handed to collectives per training step per rank, per layout, against the textbook
   volume (in units of the parameter bytes P): DDP all-reduce P; ZeRO-1 all-reduce P +
   broadcast P; ZeRO-2 all-gather P + reduce-scatter P; ZeRO-3 all-gather 2P + reduce-scatter P.
   Counted by wrapping torch.distributed's collective functions (payload = full tensor size;
   a ring moves 2(N-1)/N of an all-reduce payload and (N-1)/N of the others over each link).
   TP uses DTensor's functional collectives, counted with CommDebugMode (counts only).
2. Pipeline idle share per stage, measured: 1 - (the stage's own compute for m micro-batches,
   timed without communication) / (the schedule's step time), against the bubble (p-1)/m
   (idle time over compute time) and the same as a share of the step, (p-1)/(m+p-1).

Run: python bench/parallel_cpu.py [--quick]. The machine may be shared: timings are noisy.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain.config import ActivationCheckpointConfig, CompileConfig, ParallelConfig  # noqa: E402
from scaletrain.models.args import ModelArgs, count_params  # noqa: E402
from scaletrain.train.loss import cross_entropy_sum  # noqa: E402
from scaletrain.train.step import TrainStep  # noqa: E402

ARGS = ModelArgs(dim=128, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=256,
                 max_seq_len=64)
SEQ, MBS = 64, 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CommBytes(TorchDispatchMode):
    """Counts collectives and their full-size payload bytes as they reach the dispatcher
    (c10d ops from DDP/FSDP/ZeRO and DTensor's functional collectives alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func.overloadpacket)
        if name.startswith(("c10d.", "_c10d_functional.", "c10d_functional.")) and \
                "wait" not in name and "wrap" not in name:
            tensors = [t for t in pytree.tree_leaves((args, kwargs or {}))
                       if isinstance(t, torch.Tensor)]
            size = max((t.numel() * t.element_size() for t in tensors), default=0)
            if "functional" in name and "all_gather" in name:
                size *= int(args[1])  # (input, group_size, group): the gathered size
            short = name.split(".", 1)[1]
            self.bytes[short] = self.bytes.get(short, 0) + size
            self.calls[short] = self.calls.get(short, 0) + 1
        return func(*args, **(kwargs or {}))


def _setup(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def _build(cfg: ParallelConfig):
    from scaletrain.parallel.parallelize import Parallelism

    par = Parallelism(cfg, torch.device("cpu"))
    par.start()
    model = par.build_model(ARGS, 0, ActivationCheckpointConfig(), CompileConfig())
    return par, model


def _comm_worker(rank: int, world: int, port: int, out: str) -> None:
    _setup(rank, world, port)
    from scaletrain.config import OptimizerConfig
    from scaletrain.train.optim import param_groups
    from scaletrain.train.zero1 import PartitionedOptimizer

    layouts = {
        "ddp": ParallelConfig(data_parallel="ddp"),
        "zero1": ParallelConfig(data_parallel="zero1"),
        "zero2": ParallelConfig(data_parallel="zero2"),
        "zero3": ParallelConfig(data_parallel="zero3"),
        "tp-sp": ParallelConfig(tp=world, dp_shard=1),
        "tp-nosp": ParallelConfig(tp=world, dp_shard=1, sequence_parallel=False,
                                  loss_parallel=False),
    }
    results = {}
    torch.manual_seed(1)
    x = torch.randint(0, ARGS.vocab_size, (MBS, SEQ))
    for name, cfg in layouts.items():
        par, model = _build(cfg)
        p_bytes = count_params(ARGS).total * 4
        if cfg.data_parallel == "zero1":
            opt = PartitionedOptimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.0),
                                       torch.device("cpu"), par.mesh.group("dp_cp"))
        else:
            opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-3, foreach=True)
        # The trainer's step (loss, gradient norm, optimizer): its scalar reductions (token
        # count, loss, norm) are counted with the gradient traffic.
        train_step = TrainStep(model, opt, par, torch.device("cpu"), "fp32", cross_entropy_sum,
                               max_grad_norm=1.0)
        for step in range(2):  # the second step is counted
            counter = CommBytes()
            with counter if step == 1 else contextlib.nullcontext():
                train_step([(x, x)])
        results[name] = {"bytes": counter.bytes, "calls": counter.calls,
                         "param_bytes": p_bytes}
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _pp_worker(rank: int, world: int, port: int, schedule: str, micro: int, out: str) -> None:
    _setup(rank, world, port)
    par, model = _build(ParallelConfig(pp=world, dp_shard=1, pp_schedule=schedule,
                                       pp_microbatches=micro))
    par.attach_pipeline(model, cross_entropy_sum, micro)
    torch.manual_seed(1)
    x = torch.randint(0, ARGS.vocab_size, (MBS * micro, SEQ))
    batches = [(x[i * MBS:(i + 1) * MBS], x[i * MBS:(i + 1) * MBS]) for i in range(micro)]
    n = torch.tensor(float(x.numel()))

    def forward_backward() -> None:
        par.pipeline_forward_backward(batches, n, lambda t: t)

    forward_backward()  # warm
    times = []
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        forward_backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad()
    # This stage's own compute for the same micro-batches, all ranks at once, no communication.
    stage = par.stage_modules[0]
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(micro):
        mb = batches[i][0]
        inp = mb if stage.spec.embed else torch.randn(MBS, SEQ, ARGS.dim, requires_grad=True)
        y = stage(inp)
        (cross_entropy_sum(y, mb) if stage.spec.head else y.float().sum()).backward()
    compute = time.perf_counter() - t0
    step = min(times)
    res = torch.tensor([compute, step], dtype=torch.float64)
    gathered = [torch.zeros_like(res) for _ in range(world)]
    dist.all_gather(gathered, res)
    if rank == 0:
        rows = [{"stage": r, "compute_s": float(g[0]), "step_s": float(g[1]),
                 "idle_share": max(0.0, 1 - float(g[0]) / float(g[1]))}
                for r, g in enumerate(gathered)]
        Path(out).write_text(json.dumps(rows))
    dist.barrier()  # no rank tears gloo down while a peer's pipeline sends are in flight
    dist.destroy_process_group()


def main() -> None:
    quick = "--quick" in sys.argv
    tmp = Path("bench/results")
    tmp.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": "2 shared CPU cores, gloo, fp32", "model": ARGS.to_dict(),
                    "seq_len": SEQ, "micro_batch": MBS}
    comm_file = tmp / ".comm.json"
    if "--pp-only" not in sys.argv:
        mp.spawn(_comm_worker, args=(2, _port(), str(comm_file)), nprocs=2)
    else:
        comm_file.write_text("{}")
    comm = json.loads(comm_file.read_text())
    comm_file.unlink()
    # Payload in units of P. DDP: all-reduce of the gradients. ZeRO-1: that + broadcast of
    # the updated parameter slices. ZeRO-2: all-gather (forward) + reduce-scatter. ZeRO-3:
    # all-gather in forward and again in backward + reduce-scatter.
    textbook = {"ddp": 1.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0}
    print("bytes handed to collectives per step per rank (N=2), in units of P (param bytes)")
    print(f"{'layout':10s} {'measured/P':>10s} {'textbook/P':>10s}  detail")
    for name, r in comm.items():
        total = sum(r["bytes"].values()) / r["param_bytes"]
        r["measured_over_P"] = total
        r["textbook_over_P"] = textbook.get(name)
        if name.startswith("tp"):  # activations, not parameters: report MB per step
            total = sum(r["bytes"].values()) / 2**20
            print(f"{name:10s} {total:8.2f}MB {'-':>10s}  calls {r['calls']}")
            continue
        print(f"{name:10s} {total:10.2f} {textbook.get(name, float('nan')):10.2f}  "
              f"calls {r['calls']}")
    n_layers = ARGS.n_layers
    print(f"TP textbook (L={n_layers}): no SP: 2 all-reduces per layer forward + 2 backward "
          f"= {4 * n_layers}; SP: the same count as reduce-scatter + all-gather pairs")
    report["comm"] = comm
    pipeline = []
    ps = (2,) if quick else (2, 4)
    ms = (4, 8) if quick else (4, 8, 16)
    print("\npipeline idle share per stage (measured: 1 - own compute / step time) vs theory")
    for schedule in ("GPipe", "1F1B"):
        for p in ps:
            for m in ms:
                f = tmp / ".pp.json"
                mp.spawn(_pp_worker, args=(p, _port(), schedule, m, str(f)), nprocs=p)
                rows = json.loads(f.read_text())
                f.unlink()
                bubble = (p - 1) / m  # bubble time / ideal compute time
                idle_theory = (p - 1) / (m + p - 1)  # the same as a share of the step
                pipeline.append({"schedule": schedule, "p": p, "m": m, "bubble": bubble,
                                 "idle_share_theory": idle_theory, "stages": rows})
                idle = " ".join(f"{r['idle_share']:.2f}" for r in rows)
                print(f"{schedule:6s} p={p} m={m:2d}  (p-1)/m {bubble:.2f}  "
                      f"(p-1)/(m+p-1) {idle_theory:.2f}  measured per stage {idle}")
    report["pipeline"] = pipeline
    out = tmp / "parallel_cpu.json"
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(report, indent=1))
    tmp_out.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
