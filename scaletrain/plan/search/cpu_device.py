"""A `cpu` device for `plan search`: this host, measured, shared by the ranks it runs.

A CPU has no data-sheet peak in the device table, and the table never guesses one; so the
peak is measured here: a few large matmuls in each dtype the host runs fast (fp32, and bf16
only with AVX-512 bf16, as the trainer decides), on every thread torch uses, split evenly
between the `ranks_per_host` processes of a gloo run. Memory is the host's RAM split the same
way. Ranks of one host talk through shared memory and loopback; their bandwidth is taken from
a measured large copy (an upper bound: gloo's all-reduce over loopback moves less). Between
hosts the default is one 10 GbE link per host shared by its ranks (`--inter-node-gbs`
overrides it).
"""

from __future__ import annotations

import time

import torch

from scaletrain.host import host_ram_bytes
from scaletrain.plan.hardware import Device
from scaletrain.runtime import cpu_has_fast_bf16

ETHERNET_GBS = 1.25
"""10 GbE in GB/s: the default link between CPU hosts."""


def matmul_tflops(dtype: torch.dtype, bursts: int = 5, burst_s: float = 0.1,
                  n: int = 1024) -> float:
    """TFLOP/s of square matrix products on this host's CPU threads in `dtype`: the best of a
    few short bursts (a peak: other work on a shared host only lowers a burst)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # first call: kernel selection, page faults
    best = 0.0
    for _ in range(bursts):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < burst_s or count == 0:
            torch.mm(a, b)
            count += 1
        best = max(best, 2 * n**3 * count / elapsed / 1e12)
    return best


def _copy_gbs(mib: int = 256, repeats: int = 4) -> float:
    src = torch.empty(mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return mib * 2**20 * repeats / (time.perf_counter() - start) / 1e9


def cpu_device(ranks_per_host: int = 1) -> Device:
    """This host as the device of one of `ranks_per_host` processes (measured: ~1 s)."""
    ranks = max(1, ranks_per_host)
    peaks = {"fp32": matmul_tflops(torch.float32) / ranks}
    if cpu_has_fast_bf16():
        peaks["bf16"] = matmul_tflops(torch.bfloat16) / ranks
    return Device("cpu", host_ram_bytes() / ranks / 2**30, peaks,
                  intra_node_gbs=_copy_gbs() / ranks, inter_node_gbs=ETHERNET_GBS / ranks,
                  gpus_per_node=ranks, gemm_efficiency=1.0, attention_efficiency=0.5,
                  intra_latency_us=20.0, inter_latency_us=50.0)
