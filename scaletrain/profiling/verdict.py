"""The bottleneck verdict and the config changes that address it.

Each candidate bottleneck gets a score: the share of the step (GPU span, or CPU step time for
CPU-only runs) that it costs.
- input: the GPU (or the CPU-only step) is idle while the training loop waits for a batch.
- cpu/launch: the GPU is idle waiting for the host to launch work (host wait and short
  launch gaps, less the input part).
- communication: communication kernels not hidden behind compute, plus GPU idle time with work
  already queued (waiting on other streams/ranks) when the trace communicates at all.
- memory: memory copies/sets not hidden behind compute; or the peak near the device's capacity.
- compute: the GPU busy with computation kernels.
The verdict is the largest loss when it costs at least `LOSS_THRESHOLD` of the step; otherwise
the run is compute-bound (what remains is the speed of the kernels themselves).
"""

from __future__ import annotations

import dataclasses
from typing import Any

LOSS_THRESHOLD = 0.15
SECONDARY_THRESHOLD = 0.08
MEMORY_CAPACITY_THRESHOLD = 0.92
VERDICTS = ("compute-bound", "memory-bound", "communication-bound", "input-bound",
            "cpu/launch-bound")


def scores(r: dict[str, Any]) -> dict[str, float]:
    """Loss share per bottleneck for one rank's analysis."""
    b = r.get("breakdown") or {}
    idle = b.get("idle", 0.0)
    ib = r.get("idle_breakdown") or {}
    input_wait = r.get("input_wait", 0.0)
    if r.get("platform") == "cpu":
        return {"compute": b.get("compute", 0.0), "communication": b.get("communication", 0.0),
                "input": input_wait, "cpu/launch": max(idle - input_wait, 0.0), "memory": 0.0}
    has_comm = (r.get("communication_us") or 0) > 0
    queued_wait = idle * ib.get("other", 0.0)
    host = idle * (ib.get("host_wait", 0.0) + ib.get("kernel_wait", 0.0))
    if not has_comm:
        host += queued_wait
    mem = b.get("memory", 0.0)
    cap = (r.get("memory") or {}).get("peak_fraction_of_device") or 0.0
    if cap >= MEMORY_CAPACITY_THRESHOLD:
        mem = max(mem, cap)
    return {
        "compute": b.get("compute", 0.0),
        "communication": b.get("communication", 0.0) + (queued_wait if has_comm else 0.0),
        "input": input_wait,
        "cpu/launch": max(host - input_wait, 0.0),
        "memory": mem,
    }


def decide(r: dict[str, Any]) -> dict[str, Any]:
    """{'verdict', 'scores', 'evidence', 'secondary'} for one rank's analysis."""
    s = scores(r)
    losses = {k: v for k, v in s.items() if k != "compute"}
    worst = max(losses, key=losses.get)  # type: ignore[arg-type]
    main = worst if losses[worst] >= LOSS_THRESHOLD else "compute"
    secondary = [k for k, v in sorted(losses.items(), key=lambda kv: -kv[1])
                 if k != main and v >= SECONDARY_THRESHOLD]
    return {"verdict": f"{main}-bound", "scores": s, "evidence": evidence(main, r, s),
            "secondary": [f"{k}-bound" for k in secondary]}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def evidence(kind: str, r: dict[str, Any], s: dict[str, float]) -> list[str]:
    """The numbers that justify the verdict, as sentences."""
    b = r.get("breakdown") or {}
    ib = r.get("idle_breakdown") or {}
    out: list[str] = []
    where = "of each step" if r.get("platform") == "cpu" else "of the GPU's time"
    if kind == "input":
        phases = (r.get("cpu") or {}).get("phases", {})
        data = phases.get("data", {})
        out.append(f"{_pct(s['input'])} {where} waits for the data loader"
                   + (f" ({data['ms_per_step']:.1f} ms per step in data loading)" if data else ""))
    elif kind == "cpu/launch":
        out.append(f"the GPU is idle {_pct(b.get('idle'))} of the time; "
                   f"{_pct(ib.get('host_wait'))} of that idle time is host wait (the GPU waits "
                   "for the CPU to launch work)" if r.get("platform") != "cpu" else
                   f"{_pct(s['cpu/launch'])} of each step is outside the model's operators "
                   "(Python and framework overhead)")
        outside = (r.get("cpu") or {}).get("outside_phases") or []
        if outside:
            out.append("outside the training phases: " + ", ".join(
                f"{o['name']} {o['ms_per_step']:.2f} ms" for o in outside[:3]) + " per step")
        q = _main_queue(r)
        if q is not None:
            state = "short" if q["mean"] < 4 else "not the limit"
            out.append(f"the launch queue is {state}: {q['mean']:.1f} outstanding launches on "
                       f"average (max {q['max']})")
        short = (r.get("launch") or {}).get("short_kernels")
        if short:
            out.append(f"{_pct(short['share_of_kernels'])} of kernels run under "
                       f"{short['threshold_us']:.0f} us")
    elif kind == "communication" and r.get("platform") == "cpu":
        out.append(f"collective calls take {_pct(b.get('communication'))} of each step")
    elif kind == "communication":
        kt = r.get("kernel_time_by_kind") or {}
        if kt:
            out.append(f"communication kernels take {_pct(kt.get('communication'))} of busy GPU "
                       "time on their own")
        out.append(f"only {_pct(r.get('overlap'))} of communication overlaps computation")
        if ib.get("other"):
            out.append(f"the GPU is idle {_pct(b.get('idle'))} of the time, "
                       f"{_pct(ib.get('other'))} of it with work queued (waiting on other "
                       "streams or ranks)")
    elif kind == "memory":
        m = r.get("memory") or {}
        if m.get("peak_fraction_of_device"):
            out.append(f"peak reserved memory is {_pct(m['peak_fraction_of_device'])} of the "
                       "device")
        out.append(f"memory copies/sets take {_pct(b.get('memory'))} of the GPU's time")
    else:
        device = "CPU" if r.get("platform") == "cpu" else "GPU"
        out.append(f"computation keeps the {device} busy {_pct(s['compute'])} of the time")
        q = _main_queue(r)
        if q is not None and q["mean"] > 100:
            out.append(f"the launch queue is full ({q['mean']:.0f} outstanding on average, max "
                       f"{q['max']}): the CPU waits on the GPU")
        ks = r.get("kernels_summary") or {}
        if ks:
            out.append(f"tensor-core GEMMs take {_pct(ks.get('tensor_core_gemm_share'))} of "
                       f"kernel time (all GEMMs {_pct(ks.get('gemm_share'))})")
    return out


def _main_queue(r: dict[str, Any]) -> dict[str, Any] | None:
    q = (r.get("launch") or {}).get("queue_length") or {}
    if not q:
        return None
    return max(q.values(), key=lambda v: v["launches"])


# --- remedies ------------------------------------------------------------------------------
_REMEDIES: dict[str, list[tuple[str, str, str]]] = {
    "input": [
        ("data.num_workers", "4", "load batches in worker processes, in parallel with the step"),
        ("data.prefetch_factor", "4", "keep more batches ready per worker"),
        ("data.pin_memory", "true", "page-locked batches copy to the GPU asynchronously "
                                    "(the trainer then uses non_blocking copies)"),
        ("", "", "pre-tokenize and pack the corpus (`scaletrain data tokenize`) so a batch is a "
                 "slice of a memory-mapped array"),
    ],
    "cpu/launch": [
        ("compile.enabled", "true", "torch.compile fuses small kernels: fewer launches per step"),
        ("compile.mode", "reduce-overhead", "CUDA graphs replay a whole step with one launch"),
        ("training.micro_batch_size", "x2", "larger micro-batches: same launches, more work each"),
        ("metrics.log_interval", "50", "fewer host-device synchronisations for logging"),
    ],
    "communication": [
        ("parallel.bucket_cap_mb", "100", "larger gradient buckets: fewer, better-sized "
                                          "all-reduces that overlap with backward"),
        ("training.grad_accum_steps", "x2", "communicate once per more micro-batches"),
        ("parallel.dp_shard", "-1", "ZeRO/FSDP: reduce-scatter + all-gather that overlap with "
                                    "compute instead of one exposed all-reduce"),
        ("parallel.tp", "8", "keep tensor parallelism inside a node (NVLink); do not exceed the "
                             "GPUs per node"),
    ],
    "memory": [
        ("activation_checkpoint.mode", "selective", "recompute activations instead of storing "
                                                    "them ('full' saves the most)"),
        ("training.micro_batch_size", "/2", "smaller micro-batches ..."),
        ("training.grad_accum_steps", "x2", "... with more accumulation keep the global batch"),
        ("parallel.dp_shard", "-1", "ZeRO-3/FSDP: shard parameters, gradients and optimizer "
                                    "state across data-parallel ranks"),
        ("parallel.tp", "2", "tensor parallelism splits each layer's weights and activations"),
        ("optimizer.offload", "true", "keep optimizer state and master weights in CPU memory"),
    ],
    "compute": [
        ("precision.dtype", "bf16", "bf16 autocast runs GEMMs on tensor cores"),
        ("compile.enabled", "true", "fused kernels for norms, activations and the loss"),
        ("training.micro_batch_size", "x2", "larger GEMMs use the device better (keep dims "
                                            "multiples of 64)"),
    ],
}
_TRANSFER_REMEDIES = [
    ("data.pin_memory", "true", "pinned host memory makes host-to-device copies asynchronous"),
    ("", "", "avoid tensor.to()/.cpu()/.item() inside the step; keep tensors on the device"),
]


def remedies(verdict: str, r: dict[str, Any], cfg: Any | None = None) -> list[dict[str, str]]:
    """Concrete changes for the verdict; `flag` is the command-line override when scaletrain's
    config has that key, `current` the value in `cfg` when the run's config is known."""
    kind = verdict.removesuffix("-bound")
    items = list(_REMEDIES.get(kind, []))
    m = r.get("memory") or {}
    if kind == "memory" and (m.get("peak_fraction_of_device") or 0) < MEMORY_CAPACITY_THRESHOLD:
        items = _TRANSFER_REMEDIES  # copies, not capacity, are the problem
    if kind == "compute" and r.get("platform") == "cpu":
        items = [(k, v, "bf16 autocast is faster on CPUs with AVX-512 bf16 (slower without)"
                  if k == "precision.dtype" else w) for k, v, w in items]
    out = []
    for key, value, why in items:
        rec: dict[str, str] = {"change": why}
        if key:
            rec["key"] = key
            current = _config_value(cfg, key)
            if current is not _MISSING:
                rec["current"] = str(current).lower() if isinstance(current, bool) else str(current)
                value = _resolve(value, current)
                if rec["current"] == value:
                    continue  # already set: not a change to suggest
            if value[:1] in "x/":  # relative to a value we do not know
                rec["value"] = ("double" if value[0] == "x" else "halve") + " it"
            else:
                rec["value"] = value
                if _config_has(key):
                    rec["flag"] = f"--{key} {value}"
        out.append(rec)
    return out


_MISSING = object()


def _config_has(key: str) -> bool:
    from scaletrain.config import Config

    obj: Any = Config()
    for part in key.split("."):
        if not dataclasses.is_dataclass(obj) or not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _config_value(cfg: Any, key: str) -> Any:
    if cfg is None:
        return _MISSING
    obj = cfg
    for part in key.split("."):
        if not hasattr(obj, part):
            return _MISSING
        obj = getattr(obj, part)
    return obj


def _resolve(value: str, current: Any) -> str:
    """'x2' and '/2' relative to the current value."""
    if isinstance(current, int) and not isinstance(current, bool) and value[:1] in "x/":
        n = int(value[1:])
        return str(current * n if value[0] == "x" else max(current // n, 1))
    return value
