"""The config changes that address what the diagnosis found.

Chosen from each cause and where its time falls: every loss of at least `CAUSE_THRESHOLD` of
the span gets remedies (the headline's all of them, the others their first two), and a cause
whose idle time falls mostly in one host phase gets that phase's remedy first (host launch
inside `Optimizer.step`: a fused optimizer; inside a logging range: a longer log interval).
Communication remedies follow the collective that is exposed (a data-parallel all-reduce is
not helped by tensor parallelism) and whether its time is transfer or waiting for a peer. A
remedy already in effect is left out: from the run's config when it is known, else from the
trace (GEMMs already in bf16/fp16 get no bf16 advice).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from scaletrain.profiling.verdict import CAUSE_THRESHOLD, MEMORY_CAPACITY_THRESHOLD

Remedy = tuple[str, str, str]  # (config key or "", value, what it changes)

_GENERIC: dict[str, list[Remedy]] = {
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
    "memory": [  # capacity: the peak is near the device's memory
        ("activation_checkpoint.mode", "partial", "recompute activations instead of storing "
                                                    "them ('full' saves the most)"),
        ("training.micro_batch_size", "/2", "smaller micro-batches ..."),
        ("training.grad_accum_steps", "x2", "... with more accumulation keep the global batch"),
        ("parallel.data_parallel", "zero3", "ZeRO-3/FSDP: shard parameters, gradients and "
                                            "optimizer state across data-parallel ranks"),
        ("optimizer.offload", "true", "keep optimizer state and master weights in CPU memory"),
    ],
    "copy": [  # transfers, not capacity
        ("data.pin_memory", "true", "pinned host memory makes host-to-device copies "
                                    "asynchronous"),
        ("", "", "avoid tensor.to()/.cpu()/.item() inside the step; keep tensors on the device"),
    ],
    "compute": [
        ("precision.dtype", "bf16", "bf16 autocast runs GEMMs on tensor cores"),
        ("compile.enabled", "true", "fused kernels for norms, activations and the loss"),
        ("training.micro_batch_size", "x2", "larger GEMMs use the device better (keep dims "
                                            "multiples of 64)"),
    ],
    "sync": [
        ("metrics.log_interval", "50", "fewer host-device synchronisations for logging"),
        ("", "", "avoid .item(), .cpu(), .tolist() and torch.cuda.synchronize() inside the "
                 "step; record events and read them at log steps"),
    ],
    "overhead": [
        ("compile.enabled", "true", "torch.compile removes Python and framework work between "
                                    "operators"),
        ("training.micro_batch_size", "x2", "larger micro-batches: the same overhead per step, "
                                            "more work each"),
    ],
    "unattributed": [],
}
_COMMUNICATION: dict[str, list[Remedy]] = {
    "all_reduce": [
        ("parallel.bucket_cap_mb", "100", "larger gradient buckets: fewer all-reduces, "
                                          "better sized, overlapped with backward"),
        ("training.grad_accum_steps", "x2", "all-reduce once per more micro-batches"),
    ],
    "all_gather": [
        ("parallel.fsdp_param_dtype", "bf16", "all-gather parameters in bf16: half the bytes"),
        ("parallel.data_parallel", "zero2", "keep parameters gathered after forward: no "
                                            "second all-gather in backward (more memory)"),
        ("training.grad_accum_steps", "x2", "communicate once per more micro-batches"),
    ],
    "reduce_scatter": [
        ("parallel.fsdp_reduce_dtype", "bf16", "reduce-scatter gradients in bf16: half the "
                                               "bytes"),
        ("training.grad_accum_steps", "x2", "communicate once per more micro-batches"),
    ],
    "other": [
        ("training.grad_accum_steps", "x2", "communicate once per more micro-batches"),
        ("parallel.bucket_cap_mb", "100", "larger gradient buckets: fewer, better-sized "
                                          "all-reduces that overlap with backward"),
    ],
}
_WAITING: Remedy = ("", "", "most collective time is waiting for a peer, not moving data: "
                            "even out the ranks' work (see the straggler and its cause) before "
                            "tuning communication")
# GPUs before Ampere: tensor cores for fp16, none for bf16
_NO_BF16_RE = re.compile(r"V100|T4\b|P100|P40|TITAN V|Quadro RTX|RTX 20|GTX", re.I)
_RAW = {"cpu/launch": "host_launch", "sync": "blocked_sync", "unattributed": "blocked_other",
        "communication": "blocked_collective", "memory": "blocked_copy"}
# For-loop optimizers launch several kernels per parameter tensor per step; a fused or
# foreach one a few per step. Above this the optimizer's launches are what the host waits on.
MANY_OPTIMIZER_LAUNCHES = 50


def remedies(verdict: str, r: dict[str, Any], cfg: Any | None = None) -> list[dict[str, str]]:
    """Concrete changes for the verdict and for every other cause of at least
    CAUSE_THRESHOLD; `flag` is the command-line override when scaletrain's config has that
    key, `current` the value in `cfg` when the run's config is known, `cause` what it is for."""
    kind = verdict.removesuffix("-bound")
    causes = [c["cause"] for c in r.get("causes") or [] if c["share"] >= CAUSE_THRESHOLD]
    plan: list[tuple[str, list[Remedy]]] = []
    if kind == "mixed":
        plan = [(c, _for_cause(c, r)[:2]) for c in causes]
    elif kind in _GENERIC or kind == "communication":
        plan = [(kind, _for_cause(kind, r))]
        plan += [(c, _for_cause(c, r)[:2]) for c in causes if c != kind]
    device = r.get("straggler_device") or {}
    if device.get("cause") == "slow device":
        plan.insert(0, ("slow device", [("", "", (
            f"rank {device['rank']}'s GPU runs the same kernels "
            f"{device['same_kernels_ratio']:.2f}x slower: check its clocks, temperature and "
            "power (`nvidia-smi -q -d CLOCK,TEMPERATURE,POWER,PERFORMANCE` for throttle "
            "reasons) and its PCIe/NVLink link; exclude the node if it stays slow. Config "
            "changes do not fix a slow device"))]))
    elif device.get("cause") == "extra work":
        plan.insert(0, ("extra work", [("", "", (
            f"rank {device['rank']} runs more kernels than the others: give every rank the same "
            "work (equal micro-batches and sequence lengths, packed sequences) and keep "
            "rank-0-only work such as evaluation, logging or checkpointing out of the step"))]))
    plan[:0] = _cpu_optimizer(r)
    out, seen = [], set()
    for cause, items in plan:
        for key, value, why in items:
            if (key or why) in seen:
                continue
            seen.add(key or why)
            rec = _record(key, value, why, r, cfg)
            if rec is not None:
                rec["cause"] = cause
                out.append(rec)
    return out


def _for_cause(cause: str, r: dict[str, Any]) -> list[Remedy]:
    """The phase-specific remedies of a cause first, then its generic ones."""
    items = _by_phase(cause, r)
    if cause == "communication":
        coll = r.get("collectives") or {}
        if coll.get("reading") == "waiting on a peer":
            items.append(_WAITING)
        items += _COMMUNICATION.get(coll.get("main") or "other", _COMMUNICATION["other"])
    elif cause == "memory":
        m = r.get("memory") or {}
        capacity = (m.get("peak_fraction_of_device") or 0) >= MEMORY_CAPACITY_THRESHOLD
        items += _GENERIC["memory" if capacity else "copy"]
    elif cause == "compute" and _NO_BF16_RE.search(str(r.get("device") or "")):
        items += [("precision.dtype", "fp16", "fp16 autocast runs GEMMs on tensor cores (this "
                                              "GPU has no bf16 tensor cores)")
                  if k == "precision.dtype" else (k, v, w) for k, v, w in _GENERIC["compute"]]
    elif cause == "compute" and r.get("platform") == "cpu":
        items += [(k, v, "bf16 autocast is faster on CPUs with AVX-512 bf16 (slower without)"
                   if k == "precision.dtype" else w) for k, v, w in _GENERIC["compute"]]
    else:
        items += _GENERIC.get(cause, [])
    return items


def _by_phase(cause: str, r: dict[str, Any]) -> list[Remedy]:
    """Remedies for the host phase that holds most of the cause's idle time."""
    phases = (r.get("idle_by_phase") or {}).get(_RAW.get(cause, ""), {})
    total = sum(phases.values())
    if total <= 0:
        return []
    phase, share = max(phases.items(), key=lambda kv: kv[1])
    if phase == "other" or share < 0.5 * total:
        return []
    where = f"{100 * share:.1f} % of the device's time is lost while the host is in {phase}"
    if phase == "optimizer":
        launches = r.get("optimizer_launches_per_step")
        if launches is not None and launches >= MANY_OPTIMIZER_LAUNCHES:
            return [("optimizer.implementation", "fused",
                     f"{where}, launching {launches:.0f} kernels per step: a fused optimizer "
                     "updates every parameter in a few kernels")]
        return [("optimizer.offload", "false",
                 f"{where}, with few device kernels ({launches or 0:.0f} launches per step): "
                 "the update runs on the host; keep the optimizer on the device if memory "
                 "allows"),
                ("optimizer.implementation", "fused", "a fused optimizer on the device")]
    if phase == "logging":
        return [("metrics.log_interval", "50", f"{where}: log less often")]
    return []


def _cpu_optimizer(r: dict[str, Any]) -> list[tuple[str, list[Remedy]]]:
    """A CPU-only run whose optimizer step takes a large share of the step in many small
    operators (a for-loop over parameter tensors): a fused/foreach optimizer first."""
    if r.get("platform") != "cpu":
        return []
    opt = ((r.get("cpu") or {}).get("phases") or {}).get("optimizer") or {}
    ops = r.get("optimizer_launches_per_step")
    if opt.get("share", 0.0) < CAUSE_THRESHOLD * 3 or ops is None or ops < MANY_OPTIMIZER_LAUNCHES:
        return []
    return [("optimizer", [("optimizer.implementation", "fused",
                            f"the optimizer step takes {100 * opt['share']:.1f} % of each step "
                            f"in {ops:.0f} operators: a fused optimizer updates every parameter "
                            "in a few")])]


def _record(key: str, value: str, why: str, r: dict[str, Any], cfg: Any) -> dict[str, str] | None:
    rec: dict[str, str] = {"change": why}
    if not key:
        return rec
    rec["key"] = key
    current = _config_value(cfg, key)
    if current is not _MISSING:
        rec["current"] = str(current).lower() if isinstance(current, bool) else str(current)
        value = _resolve(value, current)
        if _in_effect(key, value, current, r):
            return None
    elif _in_effect_by_trace(key, value, r):
        return None
    if value[:1] in "x/":  # relative to a value we do not know
        rec["value"] = ("double" if value[0] == "x" else "halve") + " it"
    else:
        rec["value"] = value
        if _config_has(key):
            rec["flag"] = f"--{key} {value}"
    return rec


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


def _in_effect(key: str, value: str, current: Any, r: dict[str, Any]) -> bool:
    """The suggested value is what the run already uses: equal, `auto` that resolves to it on
    this device, or a count that is already at least the suggestion."""
    cur = str(current).lower() if isinstance(current, bool) else str(current)
    if cur == value:
        return True
    if key == "precision.dtype" and cur == "auto" and value == "bf16":
        return r.get("platform") != "cpu" or bool(r.get("cpu_bf16"))
    if key == "optimizer.implementation" and cur == "auto" and value == "fused":
        return r.get("platform") in ("cuda", "cpu")  # auto takes fused there
    if isinstance(current, (int, float)) and not isinstance(current, bool) and _number(value):
        return current >= float(value)
    return False


def _in_effect_by_trace(key: str, value: str, r: dict[str, Any]) -> bool:
    """Without the run's config: what the trace shows is already done."""
    ks = r.get("kernels_summary") or {}
    if key == "precision.dtype" and r.get("platform") != "cpu":
        # suggest bf16 only where the GEMMs' names say fp32/tf32
        return (ks.get("full_precision_gemm_share") or 0.0) < 0.5
    return False


def _number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _resolve(value: str, current: Any) -> str:
    """'x2' and '/2' relative to the current value."""
    if isinstance(current, int) and not isinstance(current, bool) and value[:1] in "x/":
        n = int(value[1:])
        return str(current * n if value[0] == "x" else max(current // n, 1))
    return value
