"""The CPU allocator policy (`train/host_allocator.py`): with the threshold fixed, a large
block freed does not move glibc's mmap threshold, so the next large block is mmapped (and goes
back to the system when freed); glibc as it comes serves it from its heap instead. Each case
runs in a fresh interpreter: the threshold is process state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.train.host_allocator import glibc

ROOT = Path(__file__).parents[2]
PROBE = """
import ctypes, sys
from scaletrain.train.host_allocator import apply_mmap_threshold, glibc
print(apply_mmap_threshold(float(sys.argv[1])))
libc = glibc()
class Info(ctypes.Structure):  # struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks "
                                               "fsmblks uordblks fordblks keepcost").split()]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))  # glibc as it comes raises its threshold to 8 MiB here
block = libc.malloc(6 << 20)
print(libc.mallinfo2().hblkhd >= 6 << 20)  # the 6 MiB block is mmapped
"""

needs_glibc = pytest.mark.skipif(glibc() is None or not hasattr(glibc(), "mallinfo2"),
                                 reason="glibc >= 2.33 only (mallopt, mallinfo2)")


def _probe(mib: float, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(mib)], capture_output=True,
                          text=True, env={**clean, "PYTHONPATH": str(ROOT), **env}, check=True)
    return done.stdout.splitlines()


@needs_glibc
def test_a_fixed_threshold_keeps_large_blocks_mmapped() -> None:
    said, mmapped = _probe(4)
    assert said == "glibc's mmap threshold fixed at 4 MiB" and mmapped == "True"


@needs_glibc
def test_glibc_as_it_comes_serves_them_from_its_heap() -> None:
    said, mmapped = _probe(0)
    assert "as it comes" in said and mmapped == "False"


@needs_glibc
def test_the_environment_takes_precedence() -> None:
    said, mmapped = _probe(4, MALLOC_MMAP_THRESHOLD_=str(16 << 20))
    assert said == "glibc's mmap threshold as the environment sets it" and mmapped == "False"


@needs_glibc
def test_threshold_is_capped_at_glibc_maximum() -> None:
    """A value above glibc's 32 MiB ceiling is clamped, not refused."""
    said, mmapped = _probe(1000)
    assert said == "glibc's mmap threshold fixed at 32 MiB" and mmapped == "False"
