"""Read an Nsight Systems SQLite export (`nsys export --type sqlite report.nsys-rep`).

Tables used (Nsight Systems' documented export schema; times are integer nanoseconds):
- CUPTI_ACTIVITY_KIND_KERNEL(start, end, deviceId, streamId, correlationId, demangledName,
  shortName) with names as ids into StringIds(id, value);
- CUPTI_ACTIVITY_KIND_MEMCPY(start, end, streamId, correlationId, bytes, copyKind) and
  CUPTI_ACTIVITY_KIND_MEMSET(start, end, streamId, correlationId, bytes);
- CUPTI_ACTIVITY_KIND_RUNTIME(start, end, globalTid, correlationId, nameId): CUDA API calls;
- NVTX_EVENTS(start, end, eventType, text, textId, globalTid): push/pop (59) and start/end (60)
  ranges, which play the role of record_function ranges (steps, forward, backward, ...);
- TARGET_INFO_GPU(name, totalMemory) when present.
Missing tables are treated as empty; a file without any CUDA activity table is refused.
An export of several processes (`nsys profile torchrun ...`) is read as one trace per process
and GPU (see `_read`).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.profiling.trace import Spans, Trace, TraceError, assemble, device_facts

log = logging.getLogger(__name__)

# CUpti_ActivityMemcpyKind -> the names Kineto uses, so memory ops classify the same way.
_COPY_KIND = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
              8: "DtoD", 9: "HtoH", 10: "PtoP"}
_NVTX_RANGES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _rows(db: sqlite3.Connection, table: str, cols: list[str]) -> list[tuple[Any, ...]]:
    have = _columns(db, table)
    if not have:
        return []
    select = ", ".join(c if c in have else "NULL" for c in cols)
    return db.execute(f"SELECT {select} FROM {table}").fetchall()


def load_nsys(path: str | Path, rank: int = 0) -> Trace:
    """The export as one trace (the first device's when it recorded several GPUs)."""
    return load_nsys_devices(path, rank)[0]


def load_nsys_devices(path: str | Path, rank: int = 0) -> list[Trace]:
    """One trace per GPU (`deviceId`) of the export: one process can drive several GPUs, or
    one report can hold several ranks; merged, their kernels would look overlapped."""
    p = Path(path)
    try:
        db = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{p}: not a readable SQLite database ({e}); export it again with "
                         "`nsys export --type sqlite`") from None
    try:
        if not tables & {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME"}:
            raise TraceError(f"{p}: no CUDA activity tables (CUPTI_ACTIVITY_KIND_KERNEL/RUNTIME); "
                             "profile with `nsys profile --trace=cuda,nvtx` and export to sqlite")
        strings = dict(db.execute("SELECT id, value FROM StringIds").fetchall()) \
            if "StringIds" in tables else {}
        return _read(db, p, rank, strings)
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{p}: damaged nsys export ({e})") from None
    finally:
        db.close()


# A serialized global id (globalTid / globalPid): hardware and VM ids, then the process id in
# bits 24-47 and the thread id in bits 0-23. `gid >> 24` names the process on its host.
_TID_BITS = 24


def _process(gid: Any) -> int:
    return -1 if gid is None else int(gid) >> _TID_BITS


def _read(db: sqlite3.Connection, p: Path, rank: int, strings: dict[int, str]) -> list[Trace]:
    """Every row is tagged with its process (the export of `nsys profile torchrun ...` holds
    one process per rank, each numbering its correlation ids from the same start), and the
    export is cut into one trace per process and GPU before any join: kernels meet their
    launch calls on (process, correlationId), launch calls their NVTX ranges on the thread."""
    gpu: tuple[list, ...] = ([], [], [], [], [], [])
    gpu_proc: list[int] = []
    device: list[int] = []

    def add(c: tuple[list, ...], name: str, start: int, end: int, tid: int, corr: Any,
            stream: Any) -> None:
        c[0].append(name)
        c[1].append(start / 1e3)
        c[2].append(max(end - start, 0) / 1e3)
        c[3].append(tid)
        c[4].append(-1 if corr is None else int(corr))
        c[5].append(-1 if stream is None else int(stream))

    for start, end, stream, corr, dem, short, dev, gpid in _rows(
            db, "CUPTI_ACTIVITY_KIND_KERNEL",
            ["start", "end", "streamId", "correlationId", "demangledName", "shortName",
             "deviceId", "globalPid"]):
        name = strings.get(dem) or strings.get(short) or f"kernel#{dem}"
        add(gpu, name, start, end, -1, corr, stream)
        device.append(dev or 0)
        gpu_proc.append(_process(gpid))
    for start, end, stream, corr, kind, dev, gpid in _rows(
            db, "CUPTI_ACTIVITY_KIND_MEMCPY",
            ["start", "end", "streamId", "correlationId", "copyKind", "deviceId", "globalPid"]):
        add(gpu, f"Memcpy {_COPY_KIND.get(kind, 'Unknown')}", start, end, -1, corr, stream)
        device.append(dev or 0)
        gpu_proc.append(_process(gpid))
    for start, end, stream, corr, dev, gpid in _rows(
            db, "CUPTI_ACTIVITY_KIND_MEMSET",
            ["start", "end", "streamId", "correlationId", "deviceId", "globalPid"]):
        add(gpu, "Memset (Device)", start, end, -1, corr, stream)
        device.append(dev or 0)
        gpu_proc.append(_process(gpid))
    rt: tuple[list, ...] = ([], [], [], [], [], [])
    for start, end, gtid, corr, name_id in _rows(
            db, "CUPTI_ACTIVITY_KIND_RUNTIME",
            ["start", "end", "globalTid", "correlationId", "nameId"]):
        add(rt, strings.get(name_id, "cudaRuntime"), start, end, gtid or 0, corr, None)
    cpu: tuple[list, ...] = ([], [], [], [], [], [])
    for start, end, etype, text, text_id, gtid in _rows(
            db, "NVTX_EVENTS", ["start", "end", "eventType", "text", "textId", "globalTid"]):
        if etype in _NVTX_RANGES and end is not None and end >= start:
            add(cpu, text or strings.get(text_id, ""), start, end, gtid or 0, None, None)
    meta: dict[str, Any] = {}
    gpus = _rows(db, "TARGET_INFO_GPU", ["name", "totalMemory"])
    if gpus:
        meta["deviceProperties"] = [{"name": gpus[0][0], "totalGlobalMem": gpus[0][1]}]
    g, r, c = (Spans.from_columns(x) for x in (gpu, rt, cpu))
    g_proc = np.asarray(gpu_proc, dtype=np.int64)
    r_proc, c_proc = r.tid >> _TID_BITS, c.tid >> _TID_BITS
    # Activities whose process launched nothing (no globalPid in older exports) are matched by
    # correlation id alone, as before; with a single launching process they are its own.
    launching = np.unique(r_proc)
    g_proc[~np.isin(g_proc, launching)] = launching[0] if len(launching) == 1 else -1
    units = sorted({(int(d), int(q)) for d, q in zip(device, g_proc.tolist())})
    if len(units) <= 1:
        t = assemble(str(p), meta, rank, "ns", g, r, c, memory=[])
        if len(r):  # CUDA calls were traced: a device job, with or without kernel rows
            t.device_cats = ("cuda_runtime",)
            device_facts(t, meta)
        return [t]
    procs = sorted({q for _, q in units})
    log.warning("%s: %d processes, %d GPUs; analysed as one trace per process and GPU", p,
                len(procs), len({d for d, _ in units}))
    dev = np.asarray(device)
    out = []
    for d, q in units:
        gd = g.take((dev == d) & (g_proc == q))
        # q < 0: activities without globalPid (older exports): matched by correlation id only
        of_proc_rt = (r_proc == q) if q >= 0 else np.ones(len(r), dtype=bool)
        of_proc_nvtx = (c_proc == q) if q >= 0 else np.ones(len(c), dtype=bool)
        one_gpu = q >= 0 and sum(1 for _, q2 in units if q2 == q) == 1
        rd = r.take(of_proc_rt if one_gpu else of_proc_rt & np.isin(r.corr, gd.corr))
        mine = of_proc_nvtx & np.isin(c.tid, np.unique(rd.tid))  # the launching threads' NVTX
        cd = c.take(of_proc_nvtx if one_gpu or not mine.any() else mine)
        where = f"device{d}" if len(procs) == 1 else f"pid{q & 0xFFFFFF}.device{d}"
        number = d if len(procs) == 1 else len(out)
        out.append(assemble(f"{p}#{where}", meta, number, "ns", gd, rd, cd, memory=[]))
    return out
