"""Peak dense FLOP/s per device and dtype, for MFU. Unknown devices return None: never guess."""

from __future__ import annotations

import torch

# Dense (no sparsity) peak TFLOP/s from the vendors' data sheets (SXM parts where there are two).
# fp32 is the non-tensor-core rate; bf16/fp16 the tensor-core rate.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "MI300X": {"bf16": 1307.0, "fp16": 1307.0, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7},
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_tflops(name: str, dtype: str) -> float | None:
    """Peak TFLOP/s of the device called `name` (e.g. "NVIDIA H100 80GB HBM3") in `dtype`."""
    upper = name.upper()
    # Longest key first so "L40S" is not taken for "L4".
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in upper:
            return PEAK_TFLOPS[key].get(dtype)
    return None
