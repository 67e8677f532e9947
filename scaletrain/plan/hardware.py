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
    NVLink/Infinity Fabric, `inter_node_gbs` over the node's network (one NIC per GPU, the
    common layout of training clusters).
    """

    name: str
    memory_gib: float
    peak_tflops: dict[str, float] = field(default_factory=dict)
    intra_node_gbs: float = 0.0
    inter_node_gbs: float = 0.0
    gpus_per_node: int = 8

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


def _dev(name: str, mem: float, bf16: float, fp32: float, intra: float, inter: float,
         fp8: float | None = None) -> Device:
    peaks = {"bf16": bf16, "fp16": bf16, "fp32": fp32}
    if fp8 is not None:
        peaks["fp8"] = fp8
    return Device(name, mem, peaks, intra, inter)


# Data-sheet figures (SXM parts). NVLink: A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s
# bidirectional -> half per direction. Network: 200 Gb/s HDR per A100, 400 Gb/s NDR per
# H100/H200/B200 (ConnectX-7) = 25 / 50 GB/s.
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        _dev("A100-40GB", 40.0, 312.0, 19.5, 300.0, 25.0),
        _dev("A100-80GB", 80.0, 312.0, 19.5, 300.0, 25.0),
        _dev("H100", 79.6, 989.0, 67.0, 450.0, 50.0, fp8=1979.0),
        _dev("H200", 140.4, 989.0, 67.0, 450.0, 50.0, fp8=1979.0),
        _dev("B200", 179.1, 2250.0, 80.0, 900.0, 50.0, fp8=4500.0),
        _dev("A10G", 22.1, 70.0, 31.2, 0.0, 12.5),
        _dev("L4", 22.5, 121.0, 30.3, 0.0, 12.5),
        _dev("L40S", 44.5, 362.0, 91.6, 0.0, 25.0),
        Device("V100", 32.0, {"fp16": 125.0, "fp32": 15.7}, 150.0, 12.5),
        _dev("MI300X", 192.0, 1307.0, 163.4, 448.0, 50.0),
        _dev("MI250X", 128.0, 383.0, 95.7, 200.0, 25.0),
    )
}

# Peak TFLOP/s keyed by device family (kept for callers that read the table directly).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    **{k: v.peak_tflops for k, v in DEVICES.items() if not k.startswith("A100")},
    "A100": DEVICES["A100-80GB"].peak_tflops,
}


def match_device(name: str) -> Device | None:
    """The table entry for a device name as CUDA reports it ("NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB") or as a user types it ("h100", "a100-40gb"); None if unknown."""
    upper = name.upper().replace("_", "-")
    for key, dev in DEVICES.items():
        if upper == key.upper():
            return dev
    if "A100" in upper:
        return DEVICES["A100-40GB" if "40G" in upper else "A100-80GB"]
    # Longest key first so "L40S" is not taken for "L4".
    for key in sorted(DEVICES, key=len, reverse=True):
        if key.upper() in upper:
            return DEVICES[key]
    return None


def get_device(name: str) -> Device:
    """Like `match_device`, but an unknown name raises a ValueError listing the known ones."""
    dev = match_device(name)
    if dev is None:
        near = difflib.get_close_matches(name.upper(), list(DEVICES), n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise ValueError(
            f"unknown GPU '{name}'.{hint} Known: {', '.join(DEVICES)}"
        )
    return dev


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_tflops(name: str, dtype: str) -> float | None:
    """Peak TFLOP/s of the device called `name` (e.g. "NVIDIA H100 80GB HBM3") in `dtype`."""
    dev = match_device(name)
    return None if dev is None else dev.peak_tflops.get(dtype)
