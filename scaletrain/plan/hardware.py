"""The device table: memory, peak dense FLOP/s per dtype and typical bandwidths per GPU.

Used by the planner (does it fit, how fast) and by the trainer (MFU). An unknown device returns
None from the lookups that the trainer uses: never guess a peak.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Device:
    """One accelerator as the planner sees it.

    `memory_gib`: device memory as `nvidia-smi` reports it (GiB). `peak_tflops`: dense (no
    sparsity) tensor-core TFLOP/s per dtype from the vendor data sheet; fp32 is the
    non-tensor-core rate. Bandwidths are GB/s per GPU and direction: `intra_node_gbs` over
    NVLink/Infinity Fabric (PCIe where a part has none), `inter_node_gbs` over the node's
    network (one NIC per GPU, the common layout of training clusters). `rail_optimized`: GPU i
    of every node sits on the same leaf switch (NVIDIA's SuperPOD layout), so collectives
    across nodes between same-rank GPUs take one switch hop. Latencies (microseconds) are the
    alpha of the alpha-beta collective model (`plan.timing.collectives`).
    """

    name: str
    memory_gib: float
    peak_tflops: dict[str, float] = field(default_factory=dict)
    intra_node_gbs: float = 0.0
    inter_node_gbs: float = 0.0
    gpus_per_node: int = 8
    aliases: tuple[str, ...] = ()
    rail_optimized: bool = False
    intra_latency_us: float = 3.0
    inter_latency_us: float = 8.0
    gemm_efficiency: float = 0.76
    """Fraction of `peak_tflops` large training matmuls sustain (before the size factors of
    `plan.search.compute_time`); fitted to the calibration table (`plan/search/calibration/`)."""
    attention_efficiency: float = 0.5
    """Fraction of peak the fused attention kernels (FlashAttention-2 through SDPA) reach."""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


def _dev(name: str, mem: float, bf16: float, fp32: float, intra: float, inter: float,
         fp8: float | None = None, aliases: tuple[str, ...] = (), rail: bool = False,
         per_node: int = 8, gemm: float = Device.gemm_efficiency,
         attention: float = Device.attention_efficiency) -> Device:
    peaks = {"bf16": bf16, "fp16": bf16, "fp32": fp32}
    if fp8 is not None:
        peaks["fp8"] = fp8
    return Device(name, mem, peaks, intra, inter, per_node, aliases, rail,
                  gemm_efficiency=gemm, attention_efficiency=attention)


# Attainable fractions of peak (`gemm`, `attention`). Attention: FlashAttention-2 reaches
# 50-73 % of an A100's peak in forward + backward (Dao 2023, arXiv 2307.08691) and about 35 %
# of an H100's (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608); the A100 value is the
# low end, for causal masks and head dim 128. Matmuls: fitted to the published runs of
# `plan/search/calibration/published_runs.toml` (29 A100 and 30 H100 rows) by
# `bench/plan_calibration_fit.py` (bench/results/plan_calibration_fit.txt): the smallest largest
# |log(predicted / measured)| with every group's measured order kept. Hopper-class parts sustain
# a smaller fraction of their data-sheet peak than the A100 (0.72 against 0.76). Parts without
# published runs in the table keep the A100 value.
_HOPPER = dict(gemm=0.72, attention=0.35)


# Data-sheet figures. NVLink: A100 600 GB/s, H100/H200 SXM 900 GB/s, B200 1.8 TB/s
# bidirectional -> half per direction; PCIe parts: PCIe 4.0/5.0 x16 (32/64 GB/s); H100 NVL's
# bridge joins pairs only (the planner treats the node as PCIe). Network: 200 Gb/s HDR per
# A100, 400 Gb/s NDR per H100/H200/B200 (ConnectX-7) = 25 / 50 GB/s. Memory as nvidia-smi
# shows it (MiB / 1024). The aliases are the names CUDA reports (`torch.cuda.get_device_name`)
# and the short names users type; matching is exact after normalization, never by substring.
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        _dev("A100-SXM4-40GB", 40.0, 312.0, 19.5, 300.0, 25.0, rail=True,
             aliases=("A100-40GB", "A100-SXM-40GB")),
        _dev("A100-SXM4-80GB", 80.0, 312.0, 19.5, 300.0, 25.0, rail=True,
             aliases=("A100-80GB", "A100", "A100-SXM-80GB")),
        _dev("A100-PCIE-40GB", 40.0, 312.0, 19.5, 32.0, 25.0, aliases=("A100-40GB-PCIE",)),
        _dev("A100-PCIE-80GB", 80.0, 312.0, 19.5, 32.0, 25.0, aliases=("A100-80GB-PCIE",)),
        _dev("H100-SXM", 79.6, 989.0, 67.0, 450.0, 50.0, fp8=1979.0, rail=True,
             aliases=("H100", "H100-SXM5", "H100-SXM5-80GB", "H100-80GB-HBM3"), **_HOPPER),
        _dev("H100-PCIE", 79.6, 756.0, 51.0, 64.0, 50.0, fp8=1513.0,
             aliases=("H100-PCIE-80GB",), **_HOPPER),
        _dev("H100-NVL", 93.6, 835.0, 60.0, 64.0, 50.0, fp8=1670.0, aliases=("H100-NVL-94GB",),
             **_HOPPER),
        _dev("H200", 140.4, 989.0, 67.0, 450.0, 50.0, fp8=1979.0, rail=True,
             aliases=("H200-SXM", "H200-SXM-141GB", "H200-141GB"), **_HOPPER),
        _dev("H200-NVL", 140.4, 835.0, 60.0, 64.0, 50.0, fp8=1670.0, **_HOPPER),
        _dev("GH200", 95.6, 989.0, 67.0, 450.0, 50.0, fp8=1979.0, per_node=4,
             aliases=("GH200-480GB", "GH200-96GB"), **_HOPPER),
        _dev("GH200-144GB", 140.4, 989.0, 67.0, 450.0, 50.0, fp8=1979.0, per_node=4,
             aliases=("GH200-144G-HBM3E", "GH200-624GB"), **_HOPPER),
        _dev("B200", 179.1, 2250.0, 80.0, 900.0, 50.0, fp8=4500.0, rail=True,
             aliases=("B200-SXM", "B200-180GB"), **_HOPPER),
        _dev("A10G", 22.1, 70.0, 31.2, 0.0, 12.5),
        _dev("L4", 22.5, 121.0, 30.3, 0.0, 12.5),
        _dev("L40", 44.5, 181.0, 90.5, 0.0, 25.0),
        _dev("L40S", 44.5, 362.0, 91.6, 0.0, 25.0),
        Device("V100-SXM2-32GB", 32.0, {"fp16": 125.0, "fp32": 15.7}, 150.0, 12.5,
               aliases=("V100", "V100-32GB", "V100-SXM2")),
        _dev("MI300X", 192.0, 1307.0, 163.4, 448.0, 50.0, aliases=("MI300X-OAM",)),
        _dev("MI250X", 128.0, 383.0, 95.7, 200.0, 25.0),
    )
}

_PREFIXES = ("NVIDIA-", "TESLA-", "AMD-INSTINCT-", "AMD-")


def _normalize(name: str) -> str:
    key = "-".join(name.upper().replace("_", " ").replace("-", " ").split())
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


_LOOKUP: dict[str, Device] = {
    _normalize(alias): dev for dev in DEVICES.values() for alias in (dev.name, *dev.aliases)
}


def match_device(name: str) -> Device | None:
    """The table entry for a device name as CUDA reports it ("NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB") or as a user types it ("h100", "a100-40gb", "H100 NVL"); None if
    unknown. Names match exactly (case, spaces, dashes and the vendor prefix aside): "L40" is
    not "L4", "H1000" is not "H100"."""
    return _LOOKUP.get(_normalize(name))


def known_names() -> list[str]:
    """Every accepted name: each entry with its aliases."""
    return [f"{d.name} ({', '.join(d.aliases)})" if d.aliases else d.name
            for d in DEVICES.values()]


def get_device(name: str) -> Device:
    """Like `match_device`, but an unknown name raises a ValueError listing the known ones."""
    dev = match_device(name)
    if dev is None:
        near = difflib.get_close_matches(_normalize(name), list(_LOOKUP), n=1)
        hint = f" Did you mean '{_LOOKUP[near[0]].name}'?" if near else ""
        raise ValueError(f"unknown GPU '{name}'.{hint} Known: {'; '.join(known_names())}")
    return dev


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_tflops(name: str, dtype: str) -> float | None:
    """Peak TFLOP/s of the device called `name` (e.g. "NVIDIA H100 80GB HBM3") in `dtype`."""
    dev = match_device(name)
    return None if dev is None else dev.peak_tflops.get(dtype)
