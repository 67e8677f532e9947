"""The trainer's CPU peak (`MemoryBaseline`) counts what the process allocates, not the library
pages the kernel maps in or drops: pages of torch's own library mapped after the baseline (as
on a host under memory pressure, where they were dropped before it and the first step maps
them again) leave the peak where it was; an anonymous buffer raises it, and it stays counted
after it is freed."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.host import file_rss_bytes
from scaletrain.train.metrics import MemoryBaseline

MIB = 2**20
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the resident set's split is read from /proc")


def _map_library_pages(nbytes: int) -> mmap.mmap:
    """`nbytes` of torch's CPU library mapped read-only and touched (file-backed pages)."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not lib.exists() or lib.stat().st_size < nbytes:
        pytest.skip("no libtorch_cpu.so of that size to map")
    with lib.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
    sum(mapped[i] for i in range(0, nbytes, mmap.PAGESIZE))
    return mapped


def test_library_pages_mapped_after_the_baseline_are_not_counted() -> None:
    baseline = MemoryBaseline(torch.device("cpu"))
    file_before = file_rss_bytes()
    mapped = _map_library_pages(64 * MIB)
    try:
        assert file_rss_bytes() - file_before > 48 * MIB  # the resident set did grow
        assert baseline.peak_above_gib() * 2**30 < 16 * MIB
        buffer = torch.ones(48 * MIB // 4)  # written: anonymous pages
        del buffer
        assert baseline.peak_above_gib() * 2**30 > 40 * MIB
        assert baseline.peak_above_gib() * 2**30 > 40 * MIB  # the peak is kept across reads
    finally:
        mapped.close()
