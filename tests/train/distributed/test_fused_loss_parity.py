"""`train` with `--training.fused_loss true` in parallel layouts against the plain loss of one
process (gloo): the same losses, gradient norms, first-step gradients and validation loss over
a few steps, with the defaults (gradient clipping at 1.0, accumulation, fused AdamW), to the
tolerances of `test_parity` (the fused loss equals the plain one in fp32).

The suite runs one layout per mechanism (vocabulary-parallel TP with and without sequence
parallelism, tied and GPT-2 heads, DDP's hooks, FSDP's gathered head, context parallel, the
pipeline's last stage); SCALETRAIN_FUSED_ALL=1 adds the layouts that share those mechanisms
(ZeRO-1/2, HSDP, HSDP x TP, more pipeline schedules, untied FSDP x TP, expert parallel and TP with
Mixture-of-Experts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.parallel.distributed.test_parity import GPT2, MOE, TIED, _check, _run

FUSED = ["--training.fused_loss", "true", "--training.loss_chunk_tokens", "24"]
ALL = os.environ.get("SCALETRAIN_FUSED_ALL") == "1"
LAYOUTS_2 = [
    ("fused-tp-sp", ["--parallel.tp", "2", *FUSED], 1, 2),
    ("fused-tp-nosp", ["--parallel.tp", "2", "--parallel.sequence_parallel", "false", *FUSED],
     1, 2),
    ("fused-tp-tied", ["--parallel.tp", "2", *FUSED], 1, 2, TIED),
    ("fused-tp-gpt2", ["--parallel.tp", "2", "--parallel.sequence_parallel", "false", *FUSED],
     1, 2, GPT2),
    ("fused-ddp", ["--parallel.data_parallel", "ddp", *FUSED], 2, 2),
    ("fused-zero3-tied", ["--parallel.data_parallel", "zero3", *FUSED], 2, 2, TIED),
    ("fused-cp", ["--parallel.cp", "2", *FUSED], 1, 2),
    ("fused-pp-zbv", ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble",
                      "--parallel.pp_virtual_stages", "2", *FUSED], 1, 4),
]
EXTRA_2 = [
    ("fused-zero1", ["--parallel.data_parallel", "zero1", *FUSED], 2, 2),
    ("fused-zero2", ["--parallel.data_parallel", "zero2", *FUSED], 2, 2),
    ("fused-pp-1f1b", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B", *FUSED], 1, 4),
    ("fused-pp-izb", ["--parallel.pp", "2", "--parallel.pp_schedule", "InterleavedZeroBubble",
                      "--parallel.pp_virtual_stages", "2", *FUSED], 1, 4),
    ("fused-ep", ["--parallel.ep", "2", *FUSED], 2, 2, MOE),
    ("fused-tp-moe", ["--parallel.tp", "2", *FUSED], 1, 2, MOE),
]
LAYOUTS_4 = [
    ("fused-fsdp-x-tp-tied", ["--parallel.tp", "2", *FUSED], 2, 2, TIED),
    ("fused-ddp-x-tp", ["--parallel.data_parallel", "ddp", "--parallel.tp", "2", *FUSED], 2, 2),
    ("fused-pp-x-tp", ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.dp_shard", "1",
                       *FUSED], 1, 2),
    ("fused-pp-x-fsdp", ["--parallel.pp", "2", *FUSED], 2, 2),
]
EXTRA_4 = [
    ("fused-hsdp", ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", *FUSED], 4, 2),
    ("fused-fsdp-x-tp", ["--parallel.tp", "2", *FUSED], 2, 2),
    ("fused-hsdp-x-tp", ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                         "--parallel.tp", "2", *FUSED], 2, 2),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenized corpus for both tests."""
    return tmp_path_factory.mktemp("fused-cache")


@pytest.mark.distributed
def test_fused_loss_two_rank_layouts_match_one_process(tmp_path: Path, cache: Path) -> None:
    layouts = LAYOUTS_2 + (EXTRA_2 if ALL else [])
    table, low, _ = _run(tmp_path, cache, 2, layouts, {"fused-tp-sp": ("bf16",)})
    _check(2, table, low)


@pytest.mark.distributed
def test_fused_loss_four_rank_layouts_match_one_process(tmp_path: Path, cache: Path) -> None:
    table, low, _ = _run(tmp_path, cache, 4, LAYOUTS_4 + (EXTRA_4 if ALL else []), {})
    _check(4, table, low)
