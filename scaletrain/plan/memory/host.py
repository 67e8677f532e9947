"""What a CPU training process holds besides its tensors, when the device is this host's RAM.

The trainer reports a CPU run's peak as its private memory's peak (the resident set less its
file-backed pages: anonymous and shared-memory pages, what it allocates) above its memory
baseline, taken after the data is loaded and before the model is built (`train/metrics.py`
`MemoryBaseline`). File-backed pages (library code) are not counted: the kernel drops them
under memory pressure and the process maps them again when it next runs that code, so they
are the host's state, not the run's. Above the tensors the plan counts, that peak holds:

- `host_runtime`: the process's own private memory that training adds after the baseline:
  the allocator's per-thread state, torch's lazily built kernel tables and caches, the Python
  objects of the model and optimizer; with several processes also gloo's process groups (their
  threads and transport buffers) and the DeviceMesh, DTensor and FSDP objects. Measured with
  the tiny model of `bench/cpu_peak_vs_plan.py` (dim 64, 2 layers, 32 tokens: its tensors plan
  at 3-6 MiB) as its peak less those: 9.2 MiB for one process, 10.1-10.6 (DDP), 12.3-12.6
  (ZeRO-3) and 14.2-14.5 MiB (TP 2 x DP 2) per rank (`bench/results/cpu_peak_runtime.txt`);
  `RUNTIME_BYTES` is 12 MiB for every layout (torch 2.13 CPU, one OpenMP thread per rank as
  torchrun sets it). The library pages the first steps map in (15-17 MiB) are file-backed and
  no longer part of it.
- `batches`: the micro-batches of one step as the data loader hands them over (int64 token
  ids and targets), and with loader workers the batches they prefetch into shared memory,
  which the training process maps.
- `loader_workers` (`data.num_workers` > 0): each DataLoader worker is a forked process whose
  pages are shared with the trainer until written; what it holds of its own (its unique set
  size, USS) was 8-13 MiB per worker on the debug preset (two runs, `/proc/PID/smaps_rollup`
  sampled while training): `LOADER_WORKER_BYTES` is 12 MiB. It is host RAM the rank's share
  must hold, but not in the trainer's `peak_mem_gib`, which is this process's own.

Not counted: glibc's heap fragmentation, which the trainer's allocator policy keeps out of
the peak (`train/host_allocator.py`: a fixed 4 MiB mmap threshold and `malloc_trim` after each
forward pass; measured within 3 % of this plan in `bench/cpu_malloc_policy.py`). With glibc's
allocator as it comes (`training.cpu_mmap_threshold_mb 0`, `training.cpu_malloc_trim false`)
the heap keeps freed tensors resident: 7-38 % above the plan on the debug model.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNTIME_BYTES = 12 * 2**20
"""`host_runtime`: one training process's own private memory above its baseline (module
docstring)."""
LOADER_WORKER_BYTES = 12 * 2**20
"""`loader_workers`: the private memory of one DataLoader worker process (module docstring)."""


@dataclass(frozen=True)
class HostProcess:
    """A CPU run: the device is the host's RAM and the process's own memory counts."""

    loader_workers: int = 0
    """`data.num_workers`: DataLoader worker processes (their batches reach this process)."""
    prefetch_factor: int = 2
    """`data.prefetch_factor`: batches each worker loads ahead."""


def batch_bytes(host: HostProcess, mbs: int, seq_len: int, grad_accum: int) -> int:
    """Token ids and targets (int64) of a step's micro-batches, plus those the loader workers
    hold ahead (`num_workers x prefetch_factor` batches) in shared memory."""
    per_batch = 2 * 8 * mbs * seq_len
    ahead = host.loader_workers * host.prefetch_factor
    return per_batch * (grad_accum + ahead)
