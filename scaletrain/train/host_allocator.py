"""The C allocator policy of a CPU training run (glibc only): a fixed mmap threshold, and the
heap's free pages given back after each forward pass.

On CPU every tensor comes from the C library's `malloc`. glibc serves blocks below its mmap
threshold from its heap, and by default raises that threshold to the size of the largest
mmapped block freed (up to 32 MiB). After the first training step most activations, gradients
and FSDP buffers therefore come from the heap, and the freed ones stay resident wherever later
blocks do not fit exactly: the peak resident set was 7-38 % above the plan on the debug model,
most with FSDP (ZeRO-3) and tensor parallelism (`bench/cpu_malloc_policy.py`, docs/plan.md
"The allocator policy of CPU runs").

The policy has two parts, each with its config field:
- `apply_mmap_threshold` (`training.cpu_mmap_threshold_mb`, 4 MiB): `mallopt(M_MMAP_THRESHOLD)`
  fixes the threshold, which also turns glibc's dynamic raise off: blocks of 4 MiB or more
  (logits, large activations, FSDP's all-gathered layers) are mmapped and go back to the system
  when freed. It acts on blocks allocated from then on, so the trainer calls it before it loads
  the data and builds the model.
- `malloc_trim` and `trim_after_forward` (`training.cpu_malloc_trim`): `malloc_trim(0)` once
  before the trainer's memory baseline and after every forward pass of the model gives the
  heap's free pages back (glibc releases whole free pages inside the heap, not only its top),
  so the forward pass's freed temporaries do not stay resident under the backward pass's peak.

A fixed threshold alone is not enough: small tensors (tensor-parallel shards of a few hundred
KiB) fragment the heap as much as large ones, and fixing the threshold that low (128-512 KiB)
cost more CPU time per step than trimming (the page faults of every block mmapped anew); a
second trim after the optimizer step cost more and kept no less.

Left alone: a non-glibc C library (musl, macOS: nothing is done), a threshold of 0, and a
process whose environment already sets the threshold (`MALLOC_MMAP_THRESHOLD_`, or
`glibc.malloc.mmap_threshold` in `GLIBC_TUNABLES`): the user's own choice wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from functools import cache
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
"""glibc's `mallopt` parameters (malloc.h)."""
MAX_MMAP_THRESHOLD = 32 * 2**20
"""glibc's ceiling for the threshold on 64-bit hosts (HEAP_MAX_SIZE / 2): larger values are
refused."""


@cache
def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has `mallopt` and `malloc_trim`)."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def mallopt(param: int, value: int) -> bool:
    """`mallopt(param, value)` through glibc; False where it is not glibc or glibc refuses."""
    libc = glibc()
    return bool(libc is not None and libc.mallopt(param, value))


def malloc_trim() -> bool:
    """Give the heap's free pages back to the system (`malloc_trim(0)`); False where nothing
    was released or it is not glibc."""
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def threshold_set_by_environment() -> bool:
    """The process was started with glibc's mmap threshold set in its environment."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in tunables


def apply_mmap_threshold(mib: float) -> str:
    """Fix glibc's mmap threshold at `mib` MiB for the rest of the process (module docstring);
    what was done, in words (for the log)."""
    if mib <= 0:
        return "glibc's allocator as it comes (training.cpu_mmap_threshold_mb 0)"
    if threshold_set_by_environment():
        return "glibc's mmap threshold as the environment sets it"
    size = min(int(mib * 2**20), MAX_MMAP_THRESHOLD)
    if glibc() is None:
        return "the C library's allocator as it comes (not glibc)"
    if not mallopt(M_MMAP_THRESHOLD, size):
        return f"glibc's allocator as it comes (mallopt refused a threshold of {size} bytes)"
    return f"glibc's mmap threshold fixed at {size / 2**20:g} MiB"


def _trim_hook(module: Any, args: Any, output: Any) -> None:
    malloc_trim()


def trim_after_forward(model: Any) -> bool:
    """Register `malloc_trim(0)` after every forward pass of `model` (a torch module; its hooks
    run after those of the wrappers applied before, FSDP's resharding included); False where
    it is not glibc (nothing registered)."""
    if glibc() is None:
        return False
    model.register_forward_hook(_trim_hook)
    return True
