"""The device the search predicts for: the device table's entry for this machine's GPU, or
for a CPU run the table's `cpu` entry when it has one, else a CPU device measured here.

The measured CPU device: peak = the matrix-multiply rate of this host in the run's precision
(all threads, shared by the ranks of the node), memory = the host RAM available now shared by
the ranks. Gloo over loopback has no data sheet: its bandwidth and latency are assumptions
(`CPU_LOOPBACK_GBS`, `CPU_LOOPBACK_LATENCY_US`) that `--intra-node-gbs` replaces; the rank
correlation `tune` prints shows how far they are from this machine.
"""

from __future__ import annotations

import dataclasses

import torch

from scaletrain.host import available_ram_bytes, host_ram_bytes
from scaletrain.plan.hardware import Device, match_device
from scaletrain.plan.search.cpu_device import matmul_tflops
from scaletrain.train.precision import DTYPES

CPU_LOOPBACK_GBS = 2.0
CPU_LOOPBACK_LATENCY_US = 50.0


def cpu_device(precision: str, ranks_per_node: int) -> Device:
    """The table's `cpu` entry if there is one, else this host measured (module docstring);
    memory is per rank either way (the ranks of a CPU node share its RAM)."""
    ram_gib = (available_ram_bytes() or host_ram_bytes()) / ranks_per_node / 2**30
    known = match_device("cpu")
    if known is not None:
        return dataclasses.replace(known, memory_gib=ram_gib)
    peak = matmul_tflops(DTYPES.get(precision, torch.float32)) / ranks_per_node
    return Device("cpu (measured here)", ram_gib, {precision: peak},
                  intra_node_gbs=CPU_LOOPBACK_GBS, inter_node_gbs=CPU_LOOPBACK_GBS,
                  gpus_per_node=ranks_per_node, intra_latency_us=CPU_LOOPBACK_LATENCY_US,
                  inter_latency_us=CPU_LOOPBACK_LATENCY_US)


def this_device(device: torch.device, precision: str, ranks_per_node: int,
                peak_tflops: float | None = None, memory_gib: float | None = None) -> Device:
    """The Device of this machine for the search. A GPU missing from the table needs the
    user's peak and memory (never guess a peak)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = match_device(name)
        if known is not None:
            return known
        if peak_tflops is None or memory_gib is None:
            raise ValueError(f"'{name}' is not in the device table (scaletrain/plan/"
                             "hardware.py); pass --peak-tflops and --memory-gib to tune on it")
        return Device(name, memory_gib, {precision: peak_tflops}, gpus_per_node=ranks_per_node)
    return cpu_device(precision, ranks_per_node)


def with_overrides(dev: Device, precision: str, peak_tflops: float | None,
                   memory_gib: float | None, intra_node_gbs: float | None) -> Device:
    """The device with the user's figures in place of the table's or the measured ones."""
    if peak_tflops is not None:
        dev = dataclasses.replace(dev, peak_tflops={**dev.peak_tflops, precision: peak_tflops})
    if memory_gib is not None:
        dev = dataclasses.replace(dev, memory_gib=memory_gib)
    if intra_node_gbs is not None:
        dev = dataclasses.replace(dev, intra_node_gbs=intra_node_gbs,
                                  inter_node_gbs=intra_node_gbs)
    return dev
