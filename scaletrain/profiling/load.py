"""Open a trace file by what it holds: a Kineto Chrome trace (`trace.load_kineto`) or an
Nsight Systems SQLite export (`nsys`)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.profiling.nsys import load_nsys, load_nsys_devices
from scaletrain.profiling.trace import Trace, TraceError, load_kineto


def load_all(path: str | Path, rank: int = 0, time_unit: str = "auto") -> list[Trace]:
    """Like `load`, but an nsys export that recorded several GPUs gives one trace per GPU."""
    p = Path(path)
    if p.is_file():
        with p.open("rb") as f:
            if f.read(16).startswith(b"SQLite format 3"):
                return load_nsys_devices(p, rank=rank)
    return [load(p, rank=rank, time_unit=time_unit)]


def load(path: str | Path, rank: int = 0, time_unit: str = "auto") -> Trace:
    """A Kineto Chrome trace (.json / .json.gz) or an Nsight Systems SQLite export."""
    p = Path(path)
    if p.is_dir():
        raise TraceError(f"{p}: a directory; pass the trace files in it (one per rank)")
    if p.is_file():
        with p.open("rb") as f:
            head = f.read(16)
        if head.startswith(b"SQLite format 3"):
            return load_nsys(p, rank=rank)
        if p.suffix in (".nsys-rep", ".qdrep"):
            raise TraceError(f"{p}: an Nsight Systems report; export it first with "
                             f"`nsys export --type sqlite {p}` and pass the .sqlite file")
    return load_kineto(p, rank=rank, time_unit=time_unit)


__all__ = ["load", "load_all"]
