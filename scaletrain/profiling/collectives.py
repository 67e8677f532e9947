"""Communication kernels by collective and message size: achieved bus bandwidth, and how much
of their time is waiting for a peer rather than moving data.

A collective kernel starts when its rank gets there and ends when the last rank has sent its
part, so its duration is the transfer plus the wait for the latest peer. Among calls of the
same collective and size, the quickest is the closest to the transfer alone; the time beyond
it is (an upper bound on) waiting. Bus bandwidth follows nccl-tests' convention, so it can be
compared with the link's rate whatever the collective: algorithm bandwidth = bytes / time,
times 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
broadcast, reduce and send/recv (n = ranks in the group). Message sizes come from the kernel's
`In msg nelems` / `Out msg nelems` / `dtype` / `Group size` arguments (PyTorch >= 2.1 writes
them); without them only durations are reported.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np

from scaletrain.profiling.trace import COMM, Trace

WAITING_SHARE = 0.5  # above this share of collective time beyond the quickest call: waiting
_KIND_RE = re.compile(r"(AllReduce|AllGather|ReduceScatter|SendRecv|AllToAll|Broadcast|Reduce|"
                      r"Send|Recv)", re.I)
_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter":
          "reduce_scatter", "sendrecv": "send_recv", "send": "send_recv", "recv": "send_recv",
          "alltoall": "all_to_all", "broadcast": "broadcast", "reduce": "reduce",
          "all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
          "all_to_all_single": "all_to_all", "alltoall_base": "all_to_all"}
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}
DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8,
               "float64": 8, "int": 4, "int32": 4, "long": 8, "int64": 8, "byte": 1,
               "char": 1, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "short": 2, "int16": 2}


def collective_name(kernel: str, args: dict[str, Any] | None) -> str:
    """all_reduce, all_gather, reduce_scatter, all_to_all, send_recv, broadcast, reduce or
    `other`, from the kernel's `Collective name` argument, else from its name."""
    name = str((args or {}).get("Collective name") or "").lower()
    if name in _NAMES:
        return _NAMES[name]
    m = _KIND_RE.search(kernel)
    return _NAMES.get(m.group(1).lower(), "other") if m else "other"


def message_bytes(kind: str, args: dict[str, Any] | None) -> float | None:
    """The bytes nccl-tests calls the size: the larger of input and output (the gathered
    output of an all-gather, the input of a reduce-scatter)."""
    if not args:
        return None
    size = DTYPE_BYTES.get(str(args.get("dtype", "")).lower())
    n_in, n_out = args.get("In msg nelems"), args.get("Out msg nelems")
    if size is None or not isinstance(n_in, (int, float)) or not isinstance(n_out, (int, float)):
        return None
    return float(max(n_in, n_out)) * size


def bus_factor(kind: str, ranks: int | None) -> float | None:
    if not ranks or ranks < 1:
        return None
    f = _BUS_FACTOR.get(kind)
    return f(ranks) if f else 1.0


def collectives(trace: Trace) -> dict[str, Any] | None:
    """Per collective and message size: calls, time, quickest and median call, bus bandwidth
    at both (GB/s); overall the share of collective time beyond the quickest call of each
    group (`waiting_share`) and the verdict it supports (`waiting on a peer` or `transfer`)."""
    g = trace.gpu
    sel = np.flatnonzero(trace.gpu_kind == COMM)
    if not len(sel):
        return None
    groups: dict[tuple[str, float | None, int | None], list[float]] = defaultdict(list)
    for i in sel.tolist():
        args = trace.comm_args.get(int(g.corr[i]))
        kind = collective_name(g.name[i], args)
        ranks = (args or {}).get("Group size")
        groups[(kind, message_bytes(kind, args),
                ranks if isinstance(ranks, int) else None)].append(float(g.dur[i]))
    rows, total, beyond = [], 0.0, 0.0
    for (kind, size, ranks), durs in groups.items():
        d = np.asarray(durs)
        d = d[d > 0]
        if not len(d):
            continue
        quickest, median = float(d.min()), float(np.median(d))
        row: dict[str, Any] = {"collective": kind, "bytes": size, "ranks": ranks,
                               "calls": int(len(d)), "total_us": float(d.sum()),
                               "quickest_us": quickest, "median_us": median}
        f = bus_factor(kind, ranks)
        if size and f:
            row["busbw_best_gbps"] = size / quickest / 1e3 * f  # bytes/us = MB/s
            row["busbw_median_gbps"] = size / median / 1e3 * f
        total += float(d.sum())
        if len(d) > 1:
            beyond += float((d - quickest).sum())
        rows.append(row)
    rows.sort(key=lambda r: -r["total_us"])
    share = beyond / total if total > 0 else 0.0
    return {"groups": rows[:20], "waiting_share": share,
            "sized": any(r.get("busbw_best_gbps") for r in rows),
            "main": rows[0]["collective"] if rows else None,
            "reading": "waiting on a peer" if share >= WAITING_SHARE else "transfer"}
