"""Loss and gradient parity of every layout against one process (gloo, spawned processes).

Each spawn runs several layouts in one process group (a launch costs seconds here). The
single-process reference sees the same data: a global micro-batch of micro_batch_size x dp
rows, the same accumulation steps, the same seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.worker import run_trainer, spawn

STEPS = 3
# Relative to the reference loss (~6.2). Step 1 checks the forward pass: 1e-6. Later steps
# also carry AdamW's updates (lr 1e-2), which turn the rounding differences of another
# reduction order into small weight differences: 1e-5.
FIRST_LOSS_TOL = 1e-6
LOSS_TOL = 1e-5
GRAD_TOL = 2e-6  # max |g - g_ref| / max |g_ref| per tensor
# A tied embedding/head (llama3.2-1b): FSDP keeps one shared parameter; TP shards both over the
# vocabulary (the same Shard(0) placement), so the head shares the embedding's DTensor.
TIED = ["--model.tie_embeddings", "true"]
# GPT-2 (LayerNorm, learned positions, GELU MLP with biases, tied head) at the tests' size.
GPT2 = ["--model.name", "gpt2", "--model.dim", "64", "--model.n_heads", "4", "--model.ffn_dim",
        "128", "--model.vocab_size", "512", "--model.tie_embeddings", "true"]


def _job(tmp: Path, cache: Path, name: str, *args: str) -> tuple[str, list[str]]:
    return name, [str(tmp / name), str(cache), *args]


def _reference(tmp: Path, cache: Path, mbs: int, ga: int, *model: str) -> dict[str, Any]:
    out = run_trainer([str(tmp / f"ref-{mbs}-{ga}-{len(model)}"), str(cache),
                       "--training.micro_batch_size", str(mbs), "--training.grad_accum_steps",
                       str(ga), *model], STEPS)
    out.pop("trainer")
    return out


def _compare(result: list[dict[str, Any]], name: str,
             ref: dict[str, Any]) -> tuple[float, float, float]:
    losses = result[0][name]["losses"]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)]
    assert rel[0] <= FIRST_LOSS_TOL, (name, "first-step loss", rel[0])
    dloss = max(rel)
    dgrad, seen = 0.0, set()
    for rank in result:
        for key, g in rank[name]["grads"].items():
            r = ref["grads"][key]
            # The floor: a key projection's bias has a zero gradient (softmax ignores a shift
            # shared by all keys), so both runs hold only rounding noise (~1e-11) there.
            dgrad = max(dgrad, float((g - r).abs().max() / max(float(r.abs().max()), 1e-4)))
            seen.add(key)
    assert seen == set(ref["grads"]), f"{name}: gradients missing for {set(ref['grads']) - seen}"
    return rel[0], dloss, dgrad


# name, parallel flags, data-parallel degree, accumulation steps[, model flags of both runs]
LAYOUTS_2 = [
    ("ddp", ["--parallel.data_parallel", "ddp"], 2, 1),
    ("ddp-ga2", ["--parallel.data_parallel", "ddp"], 2, 2),
    ("zero1", ["--parallel.data_parallel", "zero1"], 2, 1),
    ("zero2", ["--parallel.data_parallel", "zero2"], 2, 1),
    ("zero3-tied", ["--parallel.data_parallel", "zero3"], 2, 1, TIED),
    ("tp-tied", ["--parallel.tp", "2"], 1, 1, TIED),
    ("zero3", ["--parallel.data_parallel", "zero3"], 2, 2),
    ("tp-sp", ["--parallel.tp", "2"], 1, 1),
    ("tp-nosp", ["--parallel.tp", "2", "--parallel.sequence_parallel", "false",
                 "--parallel.loss_parallel", "false"], 1, 1),
    ("tp-gpt2", ["--parallel.tp", "2", "--parallel.sequence_parallel", "false"], 1, 1, GPT2),
    ("cp", ["--parallel.cp", "2"], 1, 1),
    ("cp-nolb", ["--parallel.cp", "2", "--parallel.cp_load_balance", "false"], 1, 1),
    ("pp-gpipe", ["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe"], 1, 2),
    ("pp-1f1b", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B"], 1, 4),
    *[(f"pp-{s}", ["--parallel.pp", "2", "--parallel.pp_schedule", s,
                   "--parallel.pp_virtual_stages", "2"], 1, 4)
      for s in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")],
]
LAYOUTS_4 = [
    ("hsdp", ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"], 4, 1),
    ("fsdp-x-tp", ["--parallel.tp", "2"], 2, 1),
    ("fsdp-x-tp-tied", ["--parallel.tp", "2"], 2, 1, TIED),
    ("pp-x-fsdp", ["--parallel.pp", "2"], 2, 2),
    ("fsdp-x-cp", ["--parallel.cp", "2"], 2, 1),
    ("pp-x-tp", ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.dp_shard", "1"], 1, 2),
    ("pp-x-cp", ["--parallel.pp", "2", "--parallel.cp", "2", "--parallel.dp_shard", "1"], 1, 2),
    ("zero3-4", ["--parallel.data_parallel", "zero3"], 4, 1),
]


def _run(tmp: Path, cache: Path, world: int, layouts: list) -> tuple[dict, list]:
    layouts = [(*lay, []) if len(lay) == 4 else lay for lay in layouts]
    refs = {(4 * dp, ga, tuple(m)): _reference(tmp, cache, 4 * dp, ga, *m)
            for _, _, dp, ga, m in layouts}
    jobs = [_job(tmp, cache, name, *flags, *m, "--training.grad_accum_steps", str(ga))
            for name, flags, _, ga, m in layouts]
    result = spawn(world, jobs, STEPS, tmp)
    table = {}
    for name, _, dp, ga, m in layouts:
        table[name] = _compare(result, name, refs[(4 * dp, ga, tuple(m))])
    return table, result


def _check(table: dict[str, tuple[float, float, float]]) -> None:
    bad = []
    for name, (first, dloss, dgrad) in table.items():
        print(f"parity {name:18s} step-1 loss {first:.1e} max loss {dloss:.1e} grad {dgrad:.1e}")
        if not (dloss <= LOSS_TOL and dgrad <= GRAD_TOL):
            bad.append((name, dloss, dgrad))
    assert not bad, bad


@pytest.mark.distributed
def test_two_rank_layouts_match_one_process(tmp_path: Path) -> None:
    table, result = _run(tmp_path, tmp_path / "cache", 2, LAYOUTS_2)
    _check(table)
    # Memory per rank: ZeRO-3 holds about half the parameters, ZeRO-1/2 half the optimizer
    # state of DDP (counted as tensor bytes on each rank).
    ddp = result[0]["ddp"]["bytes"]
    for rank in result:
        assert rank["zero3"]["bytes"]["params"] <= 0.55 * ddp["params"]
        for name in ("zero1", "zero2", "zero3"):
            assert rank[name]["bytes"]["optim"] <= 0.55 * ddp["optim"], name


@pytest.mark.distributed
def test_four_rank_layouts_match_one_process(tmp_path: Path) -> None:
    table, _ = _run(tmp_path, tmp_path / "cache", 4, LAYOUTS_4)
    _check(table)


@pytest.mark.distributed
def test_eight_rank_pp_x_tp_x_fsdp_matches_one_process(tmp_path: Path) -> None:
    layout = [("pp-x-tp-x-fsdp", ["--parallel.pp", "2", "--parallel.tp", "2"], 2, 2)]
    table, _ = _run(tmp_path, tmp_path / "cache", 8, layout)
    _check(table)
