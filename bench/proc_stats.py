"""Resident memory of the running process (Linux /proc), for the benchmarks' child processes:
`reset_peak()` after the imports, then `status_mib("VmHWM")` is the peak of the work alone."""

from __future__ import annotations


def status_mib(key: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM, ...) in MiB; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except OSError:
        pass
    return 0.0


def reset_peak() -> None:
    """Reset the high-water mark to the current RSS (Linux >= 4.0; ignored elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def quiet_child() -> tuple[str, str]:
    """A benchmark child's start: warnings and log records off; (tool, trace path) from argv."""
    import logging
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    return sys.argv[1], sys.argv[2]
