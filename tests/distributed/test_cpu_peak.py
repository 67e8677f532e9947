"""A CPU run's planned peak is what the trainer measures, within 10 %, for one process, DDP
(2 ranks), ZeRO-3 (2 ranks) and TP 2 x DP 2 (4 ranks) on the debug model.

Both sides are the same quantity: the trainer's `peak_mem_gib` (the peak of the process's
private memory, its resident set less the file-backed library pages, above its memory baseline,
from metrics.jsonl of rank 0: `train/metrics.py` `MemoryBaseline`) against the `peak` that
`train --dry-run --json` prints for the same flags and world size (`estimate_for_config`).
The runs use the trainer's defaults, its allocator policy included (`training.
cpu_mmap_threshold_mb`, `train/host_allocator.py`): no allocator setting comes from the
environment (`MALLOC_MMAP_THRESHOLD_` and `GLIBC_TUNABLES` are removed from it), so what is
checked is what a user's run peaks at. The figures of each layout go to `--junitxml` as
properties (`bench/cpu_peak_test_runs.py` collects them).

When the peak was the whole resident set's, TP 2 x DP 2 failed in full CI runs on a shared
machine (-10.7 %) and passed alone: library pages reclaimed under memory pressure before the
baseline were mapped again by the first step and counted (docs/plan.md, "What the CPU peak
counts").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.proc_helpers import scaled

ROOT = Path(__file__).parents[2]
LAYOUTS = {
    "one process": (1, []),
    "ddp": (2, ["--parallel.data_parallel", "ddp"]),
    "zero3": (2, ["--parallel.data_parallel", "zero3"]),
    "tp2_dp2": (4, ["--parallel.tp", "2", "--parallel.data_parallel", "ddp"]),
}


def _env() -> dict[str, str]:
    own = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    return {**own, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _flags(out: Path, cache: Path) -> list[str]:
    """The debug preset (its model and micro-batch; 128 tokens instead of 256 to halve the
    time) on a small corpus, 3 steps: from the second on the optimizer state is there, from the
    third DDP's buckets too (DDP rebuilds them after the first step; the new ones are resident
    once the second backward has written them)."""
    return ["--output", str(out), "--data.cache_dir", str(cache), "--data.max_bytes", "400000",
            "--data.seq_len", "128",
            "--data.curate", "false", "--training.steps", "3", "--training.eval_interval", "0",
            "--training.sample_tokens", "0", "--checkpoint.interval", "0",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--metrics.log_interval", "1"]


def _planned(flags: list[str], world: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    """What `train --dry-run --json` prints for these flags under torchrun's WORLD_SIZE."""
    from scaletrain.config import load_config
    from scaletrain.plan.from_config import estimate_for_config

    monkeypatch.setenv("WORLD_SIZE", str(world))
    return estimate_for_config(load_config(flags))


def _measured(flags: list[str], world: int) -> float:
    """Rank 0's peak over the run (bytes), as the trainer logs it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(world), "-m", "scaletrain", "train", *flags]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-3000:]
    out = Path(flags[flags.index("--output") + 1])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    return max(m["peak_mem_gib"] for m in lines) * 2**30


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cpu_plan_peak_within_10_percent_of_the_measured_peak(
        layout: str, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    world, extra = LAYOUTS[layout]
    cache = tmp_path_factory.getbasetemp() / "cpu_peak_cache"  # one tokenizer for all four
    flags = [*_flags(tmp_path_factory.mktemp(layout), cache), *extra]
    plan = _planned(flags, world, monkeypatch)
    mem = plan["memory_bytes"]
    assert mem["host_runtime"] > 0 and mem["batches"] > 0  # the host's own terms are counted
    measured = _measured(flags, world)
    record_property("planned_mib", round(mem["peak"] / 2**20, 1))  # for --junitxml
    record_property("measured_mib", round(measured / 2**20, 1))
    assert mem["peak"] == pytest.approx(measured, rel=0.10), (
        f"{layout}: planned {mem['peak'] / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")


@pytest.mark.distributed
def test_ddp_gradients_are_its_buckets() -> None:
    """The plan's premise for DDP, on the trainer's own `apply_ddp` (one gloo rank, in this
    process): the gradients live in the buckets (no bytes beyond them), several buckets from a
    small cap, and from the second step on (after DDP rebuilds them) the same buckets every
    step, whatever `zero_grad` frees."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.models.args import get_preset
    from scaletrain.models.transformer import build_model
    from scaletrain.parallel.ddp import apply_ddp

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = get_preset("debug").replace(dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                           ffn_dim=128, vocab_size=512)
        model = apply_ddp(build_model(args, torch.device("cpu"), seed=0),
                          init_device_mesh("cpu", (1,)), bucket_cap_mb=0.05)
        tokens = torch.randint(0, 512, (2, 16))
        seen = []
        for _ in range(3):
            model(tokens).float().sum().backward()
            grads = [p.grad for p in model.parameters()]
            storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                        for g in grads}
            assert len(storages) < len(grads)  # views into shared buckets, not own tensors
            assert sum(storages.values()) == sum(g.numel() * g.element_size() for g in grads)
            seen.append(set(storages))
            model.zero_grad(set_to_none=True)
        assert len(seen[-1]) > 2 and seen[1] == seen[2]
    finally:
        dist.destroy_process_group()
