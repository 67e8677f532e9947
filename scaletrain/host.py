"""This host and this process, as the operating system reports them: RAM (physical and
available now) and the resident set (now, its peak, and restarting the peak's count). One
place for every room that measures or plans host memory: the trainer's metrics, the sharded
loader's report, the planner's CPU device and the out-of-memory pre-check."""

from __future__ import annotations

import os
import resource


def host_ram_bytes() -> int:
    """This host's physical RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int | None:
    """The RAM a new process can use without swapping now (`MemAvailable`); None where
    /proc/meminfo does not say."""
    return _kib_field("/proc/meminfo", "MemAvailable")


def current_rss_bytes() -> int | None:
    """This process's resident set size now (`VmRSS`); None where /proc does not say."""
    return _kib_field("/proc/self/status", "VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (`VmHWM`; ru_maxrss where /proc is
    absent)."""
    hwm = _kib_field("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def file_rss_bytes() -> int | None:
    """The file-backed part of this process's resident set now (`RssFile`: the pages of its
    libraries and memory-mapped files); None where /proc does not say. Those pages are the
    kernel's to drop (they are read again from their files), so how many are mapped depends on
    the host's memory pressure, not on what the process allocated."""
    return _kib_field("/proc/self/status", "RssFile")


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS count from its current RSS (Linux: `clear_refs` 5), so
    a later `peak_rss_bytes` measures one phase; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kib_field(path: str, name: str) -> int | None:
    """`name:  N kB` of a /proc file, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
