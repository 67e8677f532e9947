"""The search's layouts as trials: each candidate's layout, predicted step time and the
`scaletrain train` flags that run it; then the dry run's memory check of each trial's config.

A *layout* is what stays fixed inside it (the parallel degrees, the ZeRO stage, pipeline
virtual stages); its *variants* are what `tune` tunes inside it: micro-batch (with the
accumulation that keeps the global batch), recomputation and the fused loss. The search is
asked twice, without and with the fused loss, through its public entry point
(`plan.search.search`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from scaletrain.config import Config, ConfigError, load_config
from scaletrain.models.args import ModelArgs
from scaletrain.plan.estimate import estimate
from scaletrain.plan.from_config import layout_from_config
from scaletrain.plan.layout import Layout, PlanError
from scaletrain.plan.search.command import train_flags
from scaletrain.plan.search.space import Candidate, rank_key, search
from scaletrain.plan.timing.step_time import Cluster
from scaletrain.tune.flags import merge

GIB = 2**30


@dataclass
class TrialSpec:
    """One trial: a layout variant with the search's prediction, or a user's candidate."""

    id: str
    layout: str
    """The layout's label (what stays fixed): e.g. `dp 4 zero 3` or `dp 2 x tp 2`."""
    variant: str
    """What is tuned inside the layout: micro-batch, recomputation, fused loss."""
    flags: list[str]
    """The `scaletrain train` flags of this trial (over the user's own)."""
    predicted_step_s: float | None
    search_rank: int | None
    """1-based position in the search's order (None for a user's candidate)."""
    source: str = "search"
    planned_peak_bytes: float | None = None
    """The dry run's planned peak of the trial's whole config (`train --dry-run`)."""
    skip_reason: str | None = None
    """Why the dry run refuses it (does not fit, the trainer cannot run it), if it does."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "layout": self.layout, "variant": self.variant,
                "flags": self.flags, "predicted_step_s": self.predicted_step_s,
                "search_rank": self.search_rank, "source": self.source,
                "planned_peak_bytes": self.planned_peak_bytes, **self.extra}


def layout_label(lay: Layout) -> str:
    d = lay.dims
    parts = [f"dp {d.dp}"] if d.dp > 1 else []
    parts += [f"{name} {getattr(d, name)}" for name in ("tp", "pp", "cp", "ep")
              if getattr(d, name) > 1]
    label = " x ".join(parts) or "1 rank"
    if d.dp * d.cp > 1:
        label += f" zero {lay.zero}"
    if d.dp_replicate > 1 and d.dp_shard > 1:
        label += " (hsdp)"
    if lay.vpp > 1:
        label += f" vpp {lay.vpp}"
    return label


def variant_label(lay: Layout) -> str:
    return (f"mbs {lay.mbs} x ga {lay.grad_accum}, recompute {lay.recompute}, "
            f"fused loss {'on' if lay.fused_loss else 'off'}")


def trial_id(flags: list[str]) -> str:
    """Stable across runs (what `--resume` matches finished trials by)."""
    return hashlib.sha1(" ".join(flags).encode()).hexdigest()[:10]


def from_search(args: ModelArgs, cluster: Cluster, model: str, base: Layout,
                max_zero: int = 3) -> list[TrialSpec]:
    """Every fitting candidate of the search as a trial, in the search's order (fastest
    predicted first; fused loss off and on)."""
    assert base.gbs is not None
    gbs_tokens = base.gbs * base.seq_len
    pool: list[Candidate] = []
    for fused in (False, True):
        fitting, _ = search(args, cluster, base.seq_len, gbs_tokens,
                            base.replace(fused_loss=fused), max_zero=max_zero, model=model)
        pool += fitting
    pool.sort(key=lambda c: (*rank_key(c), c.layout.fused_loss))
    out = []
    for i, c in enumerate(pool, 1):
        lay = c.layout
        flags = [*train_flags(model, args, lay), "--training.fused_loss",
                 "true" if lay.fused_loss else "false"]
        out.append(TrialSpec(trial_id(flags), layout_label(lay), variant_label(lay), flags,
                             c.step_time_s, i, extra={"search_peak_bytes": c.plan.peak_bytes}))
    return out


def user_candidate(flags: list[str]) -> TrialSpec:
    """A candidate the user names (`--candidate "FLAGS"`): measured as given, no prediction."""
    return TrialSpec(trial_id(flags), "as given", " ".join(flags), flags, None, None,
                     source="user")


def dry_run(user_argv: list[str], spec: TrialSpec, device: torch.device, world: int,
            usable_bytes: float) -> Config | None:
    """The trial's config planned as `train --dry-run` plans it; sets `planned_peak_bytes`, or
    `skip_reason` when the config is invalid, the trainer refuses the layout or it does not fit
    `usable_bytes` per rank. Returns the config when it may run."""
    from scaletrain.data.sources import resolve_model_args

    try:
        cfg = load_config(merge(user_argv, spec.flags))
        lay = layout_from_config(cfg, device, world)
        plan = estimate(resolve_model_args(cfg), lay)
    except (ConfigError, PlanError, KeyError, ValueError) as e:
        spec.skip_reason = f"config refused: {e.args[0] if isinstance(e, KeyError) else e}"
        return None
    except SystemExit:  # tyro rejected a flag
        spec.skip_reason = "config refused: a flag `scaletrain train` does not know"
        return None
    spec.planned_peak_bytes = float(plan.peak_bytes)
    if plan.trainer_problems:
        spec.skip_reason = "the trainer cannot run it: " + "; ".join(plan.trainer_problems)
        return None
    if plan.peak_bytes > usable_bytes:
        spec.skip_reason = (f"does not fit: planned peak {plan.peak_bytes / GIB:.2f} GiB > "
                            f"{usable_bytes / GIB:.2f} GiB usable per rank")
        return None
    return cfg
