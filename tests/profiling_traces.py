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
CPU-only: op (an aten::mm operator), python (nothing recorded), data (a DataLoader range with
small operators inside), mpi (an MPI_Allreduce range).
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
            elif kind != "python":
                raise ValueError(kind)
            now += d
        t.add("user_annotation", f"ProfilerStep#{step + 1}", start, now - start)
    return t
