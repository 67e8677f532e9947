"""Read PyTorch-profiler / Kineto Chrome traces of any version into one columnar `Trace`.

Handled: plain or gzip JSON; a top-level object with `traceEvents` or a bare event list;
the 2021 category names (`Kernel`, `Runtime`, `Operator`, `Memcpy`, `Memset`) and the 2022+
ones (`kernel`, `cuda_runtime`, `cpu_op`, `gpu_memcpy`, `gpu_memset`, `user_annotation`);
microsecond or nanosecond timestamps; CUDA, ROCm (HIP) and CPU-only traces; `[memory]`
instant events from `profile_memory=True`.

Which events are analysed follows HolisticTraceAnalysis (HTA), so figures are comparable:
when a GPU trace has two or more `ProfilerStep#N` ranges, CPU events from the start of the
last step on are dropped (that step is usually cut short by the profiler stopping) and GPU
events are kept only when the runtime call that launched them was kept.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class TraceError(ValueError):
    """A file that cannot be read as a profiler trace; the message says why and what to do."""


# GPU activity kinds.
COMPUTE, COMM, MEMORY, OTHER = 0, 1, 2, 3
KIND_NAMES = ("compute", "communication", "memory", "other")

# NCCL/RCCL kernels (HTA's rule) and all-to-all kernels of MoE dispatch libraries (DeepEP, ...).
_COMM_RE = re.compile(r"^nccl.*Kernel|^rccl.*Kernel|all_?to_?all|^nvshmem|deep_ep::", re.I)
_MEMORY_RE = re.compile(r"^Memcpy|^Memset|^dma")
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")  # HTA's, as is

_KERNEL_CATS = {"kernel", "Kernel"}
_MEMCPY_CATS = {"gpu_memcpy", "Memcpy"}
_MEMSET_CATS = {"gpu_memset", "Memset"}
# mtia_ccp_events: MTIA's timed device-side events (its kernels and copies), as Kineto writes them
_GPU_CATS = _KERNEL_CATS | _MEMCPY_CATS | _MEMSET_CATS | {"mtia_ccp_events"}
_RUNTIME_CATS = {"cuda_runtime", "Runtime", "runtime", "cuda_driver", "mtia_runtime",
                 "xpu_runtime", "privateuse1_runtime", "privateuse1_driver"}
_OP_CATS = {"cpu_op", "Operator", "operator"}
_CPU_CATS = _OP_CATS | {"user_annotation", "User Annotation"}
_SYNC_CATS = {"cuda_sync"}
# Categories that only a device job writes (Kineto's ActivityType names): their presence makes
# the trace a device trace even when it holds no kernel timing.
_DEVICE_CATS = {
    "cuda_runtime": "cuda", "Runtime": "cuda", "cuda_driver": "cuda", "cuda_sync": "cuda",
    "cuda_profiler_range": "cuda", "gpu_user_annotation": "cuda", "mtia_runtime": "mtia",
    "mtia_ccp_events": "mtia", "mtia_insight": "mtia", "xpu_runtime": "xpu",
    "privateuse1_runtime": "privateuse1", "hpu_op": "hpu",
}
_RANGE_PROFILE_CATS = {"cuda_profiler_range"}
# Calls that enqueue one kernel or copy (HTA's launch events; nsys adds a _vNNNN suffix).
_DIRECT_LAUNCH = re.compile(r"^(cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|"
                            r"cudaMemcpyAsync|cudaMemsetAsync|hipLaunchKernel|"
                            r"hipExtModuleLaunchKernel|hipMemcpyAsync|hipMemsetAsync|"
                            r"hipMemcpyWithStream)(_v\d+)?$")
_STEP_RE = re.compile(r"(?:ProfilerStep|scaletrain/step)\s*#\s*(\d+)")


def kernel_kind(name: str) -> int:
    """Compute, communication, memory or other, by HTA's name rules."""
    if _COMM_RE.search(name):
        return COMM
    if _MEMORY_RE.match(name):
        return MEMORY
    if not _NOT_COMPUTE_RE.match(name):
        return COMPUTE
    return OTHER


@dataclass
class Spans:
    """Columnar (name, start, duration, thread, correlation, stream) records; times in us."""

    name: list[str] = field(default_factory=list)
    ts: np.ndarray = field(default_factory=lambda: np.empty(0))
    dur: np.ndarray = field(default_factory=lambda: np.empty(0))
    tid: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    corr: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    stream: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @property
    def end(self) -> np.ndarray:
        """`ts + dur`, computed once per (ts, dur) pair of arrays: analyses read it inside
        loops, where recomputing it made them quadratic in the number of spans."""
        cached = self.__dict__.get("_end")
        if cached is None or cached[0] is not self.ts or cached[1] is not self.dur:
            cached = (self.ts, self.dur, self.ts + self.dur)
            self.__dict__["_end"] = cached
        return cached[2]

    def matches(self, pattern: re.Pattern[str], how: str = "search") -> np.ndarray:
        """Boolean mask of the spans whose name matches: the pattern runs once per distinct
        name (a trace repeats a few hundred names millions of times)."""
        names, codes = self.name_codes()
        test = pattern.search if how == "search" else pattern.match
        hit = np.fromiter((test(n) is not None for n in names), dtype=bool, count=len(names))
        return hit[codes] if len(codes) else np.zeros(0, dtype=bool)

    def name_codes(self) -> tuple[list[str], np.ndarray]:
        """The distinct names (in order of first appearance) and each span's index into them."""
        cached = self.__dict__.get("_codes")
        if cached is None or cached[0] is not self.name:
            index: dict[str, int] = {}
            codes = np.fromiter((index.setdefault(n, len(index)) for n in self.name),
                                dtype=np.int64, count=len(self.name))
            cached = (self.name, list(index), codes)
            self.__dict__["_codes"] = cached
        return cached[1], cached[2]

    def __len__(self) -> int:
        return len(self.name)

    def take(self, index: np.ndarray) -> Spans:
        """The rows selected by a boolean mask or an index array, in that order."""
        idx = np.flatnonzero(index) if index.dtype == bool else index
        return Spans([self.name[i] for i in idx], self.ts[idx], self.dur[idx], self.tid[idx],
                     self.corr[idx], self.stream[idx])

    @classmethod
    def from_columns(cls, c: tuple[list, ...]) -> Spans:
        return cls(c[0], np.asarray(c[1], dtype=np.float64), np.asarray(c[2], dtype=np.float64),
                   np.asarray(c[3], dtype=np.int64), np.asarray(c[4], dtype=np.int64),
                   np.asarray(c[5], dtype=np.int64))


@dataclass
class Trace:
    """One rank's profile, reduced to what the analyses need."""

    source: str
    rank: int
    world_size: int | None
    platform: str  # "cuda", "rocm" or "cpu"
    device_name: str | None
    device_memory: int | None  # bytes
    steps: list[tuple[int, float, float]]  # (step number, start, end) of the analysed steps
    gpu: Spans  # kernels, memcpys and memsets, sorted by start
    gpu_kind: np.ndarray  # COMPUTE / COMM / MEMORY / OTHER per gpu entry
    launch_ts: np.ndarray  # start of the launching runtime call (NaN when unknown)
    direct_launch: np.ndarray  # launched by a kernel/memcpy/memset call (not a graph launch)
    runtime: Spans  # CUDA/HIP runtime calls
    cpu: Spans  # operators and record_function ranges
    memory: np.ndarray  # (n, 3): ts, allocated bytes, reserved bytes
    memory_device: str | None = None
    time_unit: str = "us"
    syncs: Spans = field(default_factory=Spans)  # cuda_sync events (stream/event/device waits)
    device_cats: tuple[str, ...] = ()  # device-only event categories seen in the file
    kernel_timing: bool = True  # False: a device job whose trace has no kernel durations
    job: str | None = None  # an identifier of the job (distributedInfo), to spot mixed traces
    all_steps: int = 0
    base_us: float = 0.0  # add to a timestamp for epoch time (Kineto's baseTimeNanoseconds)
    # message arguments of communication kernels (Collective name, In/Out msg nelems, dtype,
    # Group size) by correlation id
    comm_args: dict[int, dict[str, Any]] = field(default_factory=dict)
    # events left out because their duration (or start) was missing or not a number, by kind
    untimed: dict[str, int] = field(default_factory=dict)

    @property
    def has_gpu(self) -> bool:
        """Kernel timing to analyse (not just a device job)."""
        return len(self.gpu) > 0 and self.kernel_timing

    @property
    def is_device_job(self) -> bool:
        return self.platform != "cpu"


def read_json(path: Path) -> Any:
    """Parse a JSON or gzip-JSON file; errors name the file and what is wrong with it."""
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    try:
        with path.open("rb") as f:
            head = f.read(2)
        opener: Any = gzip.open if head == b"\x1f\x8b" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (EOFError, gzip.BadGzipFile) as e:
        raise TraceError(f"{path}: truncated or corrupt gzip file ({e}); copy the trace again "
                         "or re-run the profiler") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON at line {e.lineno} column {e.colno} ({e.msg}); "
                         "the trace is truncated or not a Chrome trace") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text or gzip file; expected a Chrome trace "
                         "(.json or .json.gz) or an nsys SQLite export (.sqlite)") from None


def _time_scale(events: list[dict[str, Any]], unit: str) -> tuple[float, str]:
    """Factor that converts the file's timestamps to microseconds, and the unit found."""
    if unit == "us":
        return 1.0, "us"
    if unit == "ns":
        return 1e-3, "ns"
    ts = [e["ts"] for e in events[:2000] if isinstance(e.get("ts"), (int, float))]
    if ts and max(ts) > 1e17:  # epoch nanoseconds (epoch microseconds are ~1.7e15)
        return 1e-3, "ns"
    # The quickest calls show the unit: a runtime call (cudaLaunchKernel, cudaEventQuery) or a
    # small aten operator (aten::empty) takes ~1-5 us, i.e. thousands of nanoseconds.
    for cats in (_RUNTIME_CATS, _OP_CATS):
        durs = [e["dur"] for e in events
                if e.get("cat") in cats and isinstance(e.get("dur"), (int, float))][:20000]
        if len(durs) >= 5:
            return (1e-3, "ns") if float(np.percentile(durs, 10)) > 300 else (1.0, "us")
    return 1.0, "us"


def _rank_of(meta: dict[str, Any], path: Path, default: int) -> int:
    info = meta.get("distributedInfo") or {}
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = re.search(r"rank[_-]?(\d+)", path.name)
    return int(m.group(1)) if m else default


def _as_int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def load_kineto(path: str | Path, rank: int = 0, time_unit: str = "auto") -> Trace:
    """Read one Chrome trace written by torch.profiler / Kineto."""
    path = Path(path)
    data = read_json(path)
    meta: dict[str, Any] = data if isinstance(data, dict) else {}
    _refuse_other_profiler_files(path, data)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path}: no 'traceEvents' list; this is not a PyTorch profiler / "
                         "Chrome trace (a memory timeline? pass it with --memory-timeline)")
    events = [e for e in events if isinstance(e, dict)]
    if not events:
        raise TraceError(f"{path}: the trace has no events (did the profiler schedule reach its "
                         "active steps before the run stopped?)")
    scale, unit = _time_scale(events, time_unit)
    cols: dict[str, tuple[list, ...]] = {k: ([], [], [], [], [], [])
                                         for k in ("gpu", "rt", "cpu", "sync")}
    seen: set[str] = set()
    memory: list[tuple[float, float, float, int]] = []
    comm_args: dict[int, dict[str, Any]] = {}
    untimed: dict[str, int] = {}
    for e in events:
        cat, ph = e.get("cat"), e.get("ph")
        if cat in _DEVICE_CATS:
            seen.add(cat)
        if ph == "X":
            key = ("gpu" if cat in _GPU_CATS else "rt" if cat in _RUNTIME_CATS
                   else "cpu" if cat in _CPU_CATS else "sync" if cat in _SYNC_CATS else None)
            if key is None:
                continue
            try:
                ts, dur = float(e["ts"]) * scale, float(e["dur"]) * scale
            except (KeyError, TypeError, ValueError):
                ts = dur = math.nan
            if not (math.isfinite(ts) and math.isfinite(dur)):
                # a missing or NaN duration is not a zero-length event: leave it out, count it
                untimed[key] = untimed.get(key, 0) + 1
                continue
            args = e.get("args") or {}
            if key == "gpu" and "In msg nelems" in args:
                comm_args[_as_int(args.get("correlation", -1))] = args
            c = cols[key]
            c[0].append(str(e.get("name", "")))
            c[1].append(ts)
            c[2].append(dur)
            c[3].append(_as_int(e.get("tid")))
            c[4].append(_as_int(args.get("correlation", args.get("correlation id", -1))))
            # gpu: the stream; cpu: 1 for an operator, 0 for a record_function range
            c[5].append(_as_int(args.get("stream", -1)) if key == "gpu"
                        else int(cat in _OP_CATS) if key == "cpu" else -1)
        elif e.get("name") == "[memory]" and ph in ("i", "I"):
            a = e.get("args") or {}
            if "Total Allocated" in a:
                memory.append((float(e.get("ts", 0)) * scale, float(a["Total Allocated"]),
                               float(a.get("Total Reserved", 0)), _as_int(a.get("Device Type"))))
    gpu, rt, cpu, sync = (_whole_us(Spans.from_columns(cols[k]))
                          for k in ("gpu", "rt", "cpu", "sync"))
    if not seen and any(e.get("cat") in _GPU_CATS for e in events):
        seen.add("kernel")
    t = assemble(str(path), meta, _rank_of(meta, path, rank), unit, gpu, rt, cpu, memory)
    t.syncs = sync
    t.comm_args, t.untimed = comm_args, untimed
    t.device_cats = tuple(sorted(seen))
    device_facts(t, meta)
    return t


def _refuse_other_profiler_files(path: Path, data: Any) -> None:
    """A memory timeline or an execution trace is not a Kineto trace: say which file it is."""
    if isinstance(data, list) and data and (
            (isinstance(data[0], list) and len(data[0]) == 4 and all(
                isinstance(x, (int, float)) for x in data[0]))
            or (len(data) == 2 and isinstance(data[0], list) and isinstance(data[1], list)
                and data[1] and isinstance(data[1][0], list))):
        raise TraceError(f"{path}: a memory timeline (export_memory_timeline), not a trace; "
                         f"pass it with --memory-timeline {path} next to the trace of the run")
    if isinstance(data, dict) and "nodes" in data and "traceEvents" not in data:
        raise TraceError(f"{path}: a PyTorch execution trace (ExecutionTraceObserver), which "
                         "has no timing; pass the Kineto trace (.pt.trace.json[.gz]) recorded "
                         "with it instead")


def device_facts(t: Trace, meta: dict[str, Any]) -> None:
    """The device kind from device events, runtime calls and device properties: a job that
    ran on a device is never called 'cpu', even when its trace holds no kernel timing."""
    kinds = [_DEVICE_CATS[c] for c in t.device_cats if c in _DEVICE_CATS]
    if t.platform == "cpu":
        if "mtia" in kinds:
            t.platform = "mtia"
        elif kinds or meta.get("deviceProperties") or t.untimed.get("gpu") or (
                meta.get("cupti_version") is not None and len(t.runtime)):
            t.platform = "rocm" if any(n.startswith("hip") for n in t.runtime.name[:500]) else (
                next((k for k in kinds if k != "cuda"), "cuda"))
    elif "mtia" in kinds:
        t.platform = "mtia"
    if t.platform != "cpu" and (not len(t.gpu) or float(t.gpu.dur.max(initial=0)) <= 0):
        t.kernel_timing = False


def _whole_us(s: Spans) -> Spans:
    """Round sub-microsecond times inward (start up, end down) as HTA does: Kineto's
    nanosecond-resolution timestamps can make consecutive kernels on one stream overlap
    (pytorch/pytorch#122425)."""
    if len(s) and (np.any(s.ts != np.floor(s.ts)) or np.any(s.dur != np.floor(s.dur))):
        start, end = np.ceil(s.ts), np.floor(s.ts + s.dur)
        s.ts, s.dur = start, np.maximum(end - start, 0.0)
    return s


def assemble(source: str, meta: dict[str, Any], rank: int, unit: str, gpu: Spans, rt: Spans,
             cpu: Spans, memory: list[tuple[float, float, float, int]]) -> Trace:
    """Steps, HTA's event window, launch times and device facts from the parsed columns."""
    is_step = np.flatnonzero(cpu.matches(_STEP_RE))
    steps = sorted(
        (int(_STEP_RE.search(cpu.name[i]).group(1)), float(cpu.ts[i]),  # type: ignore[union-attr]
         float(cpu.ts[i] + cpu.dur[i])) for i in is_step.tolist()
    )
    steps = list(dict.fromkeys(steps))
    n_steps = len(steps)
    if len(gpu) and n_steps >= 2:
        cutoff = steps[-1][1]
        cpu = cpu.take(cpu.ts < cutoff)
        rt = rt.take(rt.ts < cutoff)
        gpu = gpu.take(np.isin(gpu.corr, rt.corr))
        steps = steps[:-1]
    gpu = gpu.take(np.argsort(gpu.ts, kind="stable"))
    names, codes = gpu.name_codes()
    kinds = np.array([kernel_kind(n) for n in names], dtype=np.int8)[codes] if len(gpu) else \
        np.zeros(0, dtype=np.int8)
    launch = np.full(len(gpu), np.nan)
    direct = np.zeros(len(gpu), dtype=bool)
    if len(gpu) and len(rt):
        by_corr = dict(zip(rt.corr.tolist(), rt.ts.tolist()))
        launch = np.array([by_corr.get(c, np.nan) for c in gpu.corr.tolist()])
        api = dict(zip(rt.corr.tolist(), rt.name))
        direct = np.array([_DIRECT_LAUNCH.match(api.get(c, "")) is not None
                           for c in gpu.corr.tolist()], dtype=bool)
    props = meta.get("deviceProperties") or []
    dev = props[0] if props and isinstance(props[0], dict) else {}
    hip = any(n.startswith("hip") for n in rt.name[:500])
    platform = "cpu" if not len(gpu) else (
        "rocm" if hip or "AMD" in str(dev.get("name")) else "cuda")
    mem = np.asarray(memory, dtype=np.float64).reshape(-1, 4)
    mem_device = None
    if len(mem):
        on_gpu = mem[:, 3] > 0  # Device Type 0 is the CPU
        mem = mem[on_gpu] if on_gpu.any() else mem
        mem_device = "gpu" if on_gpu.any() else "cpu"
        mem = mem[np.argsort(mem[:, 0], kind="stable")]
    info = meta.get("distributedInfo") or {}
    world = info.get("world_size") if isinstance(info, dict) else None
    return Trace(
        source=source, rank=rank, world_size=world, platform=platform,
        device_name=dev.get("name"), device_memory=dev.get("totalGlobalMem"), steps=steps,
        gpu=gpu, gpu_kind=kinds, launch_ts=launch, direct_launch=direct, runtime=rt, cpu=cpu,
        memory=mem[:, :3],
        memory_device=mem_device, time_unit=unit, all_steps=n_steps,
        base_us=float(meta.get("baseTimeNanoseconds") or 0) / 1e3,
        job=json.dumps({k: info.get(k) for k in ("backend", "world_size")},
                       sort_keys=True) if isinstance(info, dict) and info else None,
    )
