"""Small synthetic traces shaped like Kineto's Chrome traces, one per cause and per pitfall.

A trace is a list of steps, each a list of segments (kind, microseconds) laid out one after the
other on the device (or, for CPU-only traces, on the main thread):
- compute: a computation kernel, launched at the start of its step (queued, no gap before it);
- exposed_comm: an NCCL kernel with nothing running beside it;
- alltoall: an all-to-all kernel of an MoE dispatch library, likewise alone;
- memcpy: a device-to-device copy, alone;
- launch: an idle gap ended by a kernel the host launched only just before it ran;
- mpi: the same gap while the host is inside an MPI_Allreduce range (a host-side collective);
- input: an idle gap while the host is in a DataLoader range, ended by a late launch;
- collective / copy / sync: an idle gap ended by work queued long before, held behind a
  collective (the next work is an all-reduce), a blocking copy call on the host
  (cudaMemcpyAsync covers the gap), or a cuda_sync event;
- optimizer_loop / optimizer_host: the host inside Optimizer.step while the device idles,
  launching 100 small kernels one by one (a for-loop optimizer) or only 2 (the update runs on
  the host);
CPU-only: op (an aten::mm operator), python (nothing recorded), data (a DataLoader range with
small operators inside), mpi (an MPI_Allreduce range), optimizer (an Optimizer.step range with
100 small operators).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

Segment = tuple[str, float]


class KinetoTrace:
    def __init__(self, rank: int = 0, world: int | None = None, device: str | None = None,
                 device_cats: bool = True) -> None:
        self.events: list[dict[str, Any]] = []
        self.corr = 0
        self.meta: dict[str, Any] = {}
        if world:
            self.meta["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
        if device:
            self.meta["deviceProperties"] = [{"name": device, "totalGlobalMem": 80 * 2**30}]

    def add(self, cat: str, name: str, ts: float, dur: float, tid: int = 1,
            **args: Any) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid,
                            "ts": ts, "dur": dur, "args": args})

    def device_op(self, name: str, ts: float, dur: float, launch: float, stream: int = 7,
                  cat: str = "kernel", api: str = "cudaLaunchKernel") -> None:
        self.corr += 1
        self.add("cuda_runtime", api, launch, 4, correlation=self.corr)
        self.add(cat, name, ts, dur, tid=stream, correlation=self.corr, stream=stream)

    def write(self, path: Path) -> Path:
        path.write_bytes(gzip.compress(json.dumps(
            {**self.meta, "traceEvents": self.events}).encode()))
        return path


GEMM = "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn"
ADAM = "void at::native::elementwise_kernel<128, 2, AdamW step>"
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def gpu_trace(segments: list[Segment], steps: int = 4, rank: int = 0, world: int | None = None,
              markers: bool = True, first_step_extra: float = 0.0,
              device: str = "NVIDIA A100-SXM4-80GB") -> KinetoTrace:
    """`steps` + 1 steps of the same segments (the profiler's last step is dropped by the
    reader, as HTA does)."""
    t = KinetoTrace(rank, world, device)
    now = 1000.0
    for step in range(steps + 1):
        start = now
        if step == 0 and first_step_extra:
            t.device_op(GEMM, now + 10, first_step_extra, launch=start)
            now += first_step_extra
        for kind, d in segments:
            if kind == "compute":
                t.device_op(GEMM, now + 10, d, launch=start)
            elif kind in ("exposed_comm", "alltoall"):
                name = NCCL if kind == "exposed_comm" else "void deep_ep::intranode::dispatch<8>"
                t.device_op(name, now + 10, d, launch=start, stream=20)
            elif kind == "memcpy":
                t.device_op("Memcpy DtoD (Device -> Device)", now + 10, d, launch=start,
                            cat="gpu_memcpy", api="cudaMemcpyAsync")
            elif kind in ("launch", "input", "mpi"):
                if kind == "mpi":
                    t.add("user_annotation", "MPI_Allreduce", now + 10, d - 10)
                if kind == "input":
                    t.add("user_annotation", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter"
                          ".__next__", now + 10, d - 10)
                t.device_op(GEMM, now + 10 + d, 20, launch=now + d)
                d += 20
            elif kind == "collective":
                t.device_op(NCCL, now + 10 + d, 50, launch=start, stream=20)
                d += 50
            elif kind == "copy":
                t.add("cuda_runtime", "cudaMemcpyAsync", now + 10, d)
                t.device_op(GEMM, now + 10 + d, 20, launch=start)
                d += 20
            elif kind in ("optimizer_loop", "optimizer_host"):
                # the host in Optimizer.step: a for-loop optimizer launches a small kernel per
                # tensor, each just before it runs; a host-side one computes, then launches 2
                t.add("user_annotation", "Optimizer.step#AdamW.step", now + 10, d)
                n = 100 if kind == "optimizer_loop" else 2
                for k in range(n):
                    at = now + 10 + (k + 1) * d / n - 8
                    t.device_op(ADAM, at + 2, 5, launch=at)
            elif kind == "sync":
                t.add("cuda_sync", "Stream Wait Event", now + 10, d, tid=7, stream=7)
                t.device_op(GEMM, now + 10 + d, 20, launch=start)
                d += 20
            else:
                raise ValueError(kind)
            now += d
        if markers:
            t.add("user_annotation", f"ProfilerStep#{step + 1}", start, now + 20 - start)
        now += 20
    return t


def cpu_trace(segments: list[Segment], steps: int = 3, rank: int = 0,
              world: int | None = None) -> KinetoTrace:
    t = KinetoTrace(rank, world)
    if world:
        t.meta["distributedInfo"]["backend"] = "gloo"
    now = 1000.0
    for step in range(steps):
        start = now
        for kind, d in segments:
            if kind == "op":
                t.add("cpu_op", "aten::mm", now, d)
            elif kind == "data":
                t.add("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter"
                      ".__next__", now, d)
                t.add("cpu_op", "aten::stack", now + 1, d / 2)
            elif kind == "mpi":
                t.add("user_annotation", "MPI_Allreduce", now, d)
            elif kind == "optimizer":  # a for-loop optimizer: 100 small operators
                t.add("user_annotation", "Optimizer.step#SGD.step", now, d)
                for k in range(100):
                    t.add("cpu_op", "aten::add_", now + k * d / 100, d / 200)
            elif kind != "python":
                raise ValueError(kind)
            now += d
        t.add("user_annotation", f"ProfilerStep#{step + 1}", start, now - start)
    return t


# --- big traces, for the scaling test and bench/diagnose_scaling.py ------------------------------
_EVENT = ('{{"ph":"X","cat":"{cat}","name":"{name}","pid":1,"tid":{tid},"ts":{ts},'
          '"dur":{dur},"args":{{{args}}}}}')


def sized_trace(path: Path, steps: int, layers: int = 24) -> Path:
    """A plain-JSON Kineto trace shaped like a data-parallel training step, written event by
    event (so a 1 GB file never sits in memory). Per step, on the main thread (tid 1): a
    DataLoader range with a host-to-device copy; `layers` top-level aten::linear operators
    outside any phase range (as in traces without scaletrain's ranges), each with an
    aten::addmm launching a GEMM; the backward in autograd ranges on tid 2, each launching
    two kernels; an Optimizer.step range with foreach operators; an NCCL all-reduce on
    stream 20. All GPU work is launched before it runs. The size grows linearly with
    `steps` (about 1.5 kB per step and layer)."""
    corr = 0
    out: list[str] = []

    def ev(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: int) -> None:
        out.append(_EVENT.format(cat=cat, name=name, tid=tid, ts=ts, dur=dur,
                                 args=",".join(f'"{k}":{v}' for k, v in args.items())))

    def launch(name: str, at: float, start: float, dur: float, cat: str = "kernel",
               stream: int = 7, api: str = "cudaLaunchKernel", tid: int = 1) -> None:
        nonlocal corr
        corr += 1
        ev("cuda_runtime", api, at, 4, tid=tid, correlation=corr)
        ev(cat, name, start, dur, tid=stream, correlation=corr, stream=stream, device=0)

    with path.open("w") as f:
        f.write('{"schemaVersion":1,"distributedInfo":{"backend":"nccl","rank":0,'
                '"world_size":8},"deviceProperties":[{"name":"NVIDIA A100-SXM4-80GB",'
                '"totalGlobalMem":85899345920}],"traceEvents":[\n')
        now, gpu = 1_000_000, 1_000_000
        first = True
        for step in range(steps + 1):
            start = now
            ev("user_annotation", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter"
               ".__next__", now, 300)
            ev("cpu_op", "aten::stack", now + 10, 200)
            launch("Memcpy HtoD (Pinned -> Device)", now + 305, max(gpu, now + 320), 40,
                   cat="gpu_memcpy", api="cudaMemcpyAsync")
            gpu = max(gpu, now + 320) + 45
            now += 320
            for _ in range(layers):
                ev("cpu_op", "aten::linear", now, 40)
                ev("cpu_op", "aten::addmm", now + 5, 30)
                launch(GEMM, now + 10, max(gpu, now + 20), 60)
                gpu = max(gpu, now + 20) + 62
                now += 45
            ev("cpu_op", "aten::cross_entropy_loss", now, 30)
            now += 35
            for _ in range(layers):
                ev("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", now, 50,
                   tid=2)
                ev("cpu_op", "aten::mm", now + 5, 20, tid=2)
                launch(GEMM, now + 8, max(gpu, now + 15), 60, tid=2)
                ev("cpu_op", "aten::mm", now + 26, 20, tid=2)
                launch(GEMM, now + 30, max(gpu, now + 40), 60, tid=2)
                gpu = max(gpu, now + 40) + 124
                now += 55
            ev("cpu_op", "record_param_comms", now, 20)
            launch(NCCL, now + 5, max(gpu, now + 20), 400, stream=20)
            gpu = max(gpu, now + 20) + 405
            now += 25
            ev("user_annotation", "Optimizer.step#AdamW.step", now, 200)
            ev("cpu_op", "aten::_foreach_add_", now + 10, 80)
            launch("void at::native::multi_tensor_apply_kernel<AdamW>", now + 20,
                   max(gpu, now + 30), 150)
            gpu = max(gpu, now + 30) + 155
            now = max(now + 210, gpu)
            ev("user_annotation", f"ProfilerStep#{step + 1}", start, now - start)
            now += 10
            for line in out:
                f.write(("" if first else ",\n") + line)
                first = False
            out.clear()
        f.write("\n]}\n")
    return path
