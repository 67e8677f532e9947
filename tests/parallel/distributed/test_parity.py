"""Loss, gradient-norm, gradient and validation parity of every layout against one process
(gloo, spawned processes), with the defaults users run: gradient clipping at 1.0, gradient
accumulation (2 or 4 micro-batches), fused AdamW; fp32, bf16 and fp16.

Each spawn runs several layouts in one process group (a launch costs seconds here). The
single-process reference sees the same data: a global micro-batch of micro_batch_size x dp
rows, the same accumulation steps, the same seed. Validation is over a fixed number of
sequences, so it must match whatever the layout and micro-batch size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_compare import grad_error
from tests.helpers.dist_worker import run_trainer, spawn

STEPS = 3
# Relative to the reference. Step 1 checks the forward pass: 1e-6. Later steps also carry
# AdamW's updates, which turn the rounding differences of another reduction order into small
# weight differences: 1e-5 on every step's loss and gradient norm, and on validation.
FIRST_LOSS_TOL = 1e-6
LOSS_TOL = 1e-5
GRAD_TOL = 2e-6  # max |g - g_ref| / max |g_ref| per tensor (the first step's gradients)
LOW_TOL = 2e-2  # bf16/fp16 layouts against one bf16/fp16 process: rounding noise
# A tied embedding/head (llama3.2-1b): FSDP keeps one shared parameter; TP shards both over the
# vocabulary (the same Shard(0) placement), so the head shares the embedding's DTensor.
TIED = ["--model.tie_embeddings", "true"]
TABLE = os.environ.get("SCALETRAIN_PARITY_TABLE")  # append the table rows to this file
# GPT-2 (LayerNorm, learned positions, GELU MLP with biases, tied head) at the tests' size.
GPT2 = ["--model.name", "gpt2", "--model.dim", "64", "--model.n_heads", "4", "--model.ffn_dim",
        "128", "--model.vocab_size", "512", "--model.tie_embeddings", "true"]
# Mixture of Experts on the tests' model: 4 experts, top-2, the balancing loss on.
MOE = ["--model.n_experts", "4", "--model.n_experts_per_token", "2", "--model.moe_ffn_dim",
       "64", "--model.moe_aux_loss_coef", "0.01"]


def _rel(got: list[float], ref: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]


def _reference(tmp: Path, cache: Path, mbs: int, ga: int, model: tuple[str, ...],
               dtype: str) -> dict[str, Any]:
    name = f"ref-{mbs}-{ga}-{len(model)}-{dtype}"
    out = run_trainer([str(tmp / name), str(cache), "--training.micro_batch_size", str(mbs),
                       "--training.grad_accum_steps", str(ga), *model, "--precision.dtype",
                       dtype], STEPS, capture=dtype == "fp32")
    out.pop("trainer")
    return out


def _compare(result: list[dict[str, Any]], name: str,
             ref: dict[str, Any]) -> tuple[float, float, float, float, float]:
    """(step-1 loss, max loss, max grad-norm, max gradient, validation) relative errors."""
    rel = _rel(result[0][name]["losses"], ref["losses"])
    assert rel[0] <= FIRST_LOSS_TOL, (name, "first-step loss", rel[0])
    dloss = max(rel)
    dnorm = max(max(_rel(rank[name]["norms"], ref["norms"])) for rank in result)
    dval = max(abs(rank[name]["val"] - ref["val"]) / ref["val"] for rank in result)
    dgrad = grad_error((rank[name]["grads"] for rank in result), ref["grads"], name)
    return rel[0], dloss, dnorm, dgrad, dval


def _compare_low(result: list[dict[str, Any]], name: str, dtype: str,
                 ref: dict[str, Any]) -> float:
    """Max relative loss/grad-norm/validation difference of a bf16/fp16 layout against one
    process in that dtype; its losses must differ from the same layout in fp32 (autocast really
    ran)."""
    fp32 = result[0][name]["losses"]
    got = result[0][f"{name}-{dtype}"]
    assert got["losses"] != fp32, f"{name}: {dtype} losses equal the fp32 ones (dtype ignored)"
    return max(*_rel(got["losses"], ref["losses"]), *_rel(got["norms"], ref["norms"]),
               abs(got["val"] - ref["val"]) / ref["val"])


# name, parallel flags, data-parallel degree, accumulation steps[, model flags of both runs]
LAYOUTS_2 = [
    ("ddp", ["--parallel.data_parallel", "ddp"], 2, 2),
    ("zero1", ["--parallel.data_parallel", "zero1"], 2, 2),
    ("zero2", ["--parallel.data_parallel", "zero2"], 2, 2),
    ("zero3-tied", ["--parallel.data_parallel", "zero3"], 2, 2, TIED),
    ("tp-tied", ["--parallel.tp", "2"], 1, 2, TIED),
    ("zero3", ["--parallel.data_parallel", "zero3"], 2, 2),
    ("tp-sp", ["--parallel.tp", "2"], 1, 2),
    ("tp-nosp", ["--parallel.tp", "2", "--parallel.sequence_parallel", "false",
                 "--parallel.loss_parallel", "false"], 1, 2),
    # sequence parallel re-gathers the projections' inputs in backward; under checkpointing the
    # recomputed forward gathers again (whole blocks; every 2nd block's attention only)
    ("tp-sp-ac", ["--parallel.tp", "2", "--activation_checkpoint.mode", "full"], 1, 2),
    ("tp-sp-ac-attn", ["--parallel.tp", "2", "--activation_checkpoint.mode", "partial",
                       "--activation_checkpoint.scope", "attention"], 1, 2),
    ("tp-gpt2", ["--parallel.tp", "2", "--parallel.sequence_parallel", "false"], 1, 2, GPT2),
    # sequence parallel: each rank adds its sequence shard of the learned positions
    ("tp-sp-gpt2", ["--parallel.tp", "2"], 1, 2, GPT2),
    ("cp", ["--parallel.cp", "2"], 1, 2),
    ("cp-nolb", ["--parallel.cp", "2", "--parallel.cp_load_balance", "false"], 1, 2),
    ("pp-gpipe", ["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe"], 1, 2),
    ("pp-1f1b", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B"], 1, 4),
    # the step's 4 micro-batches in two schedule runs of 2 (`parallel.pp_microbatches`)
    ("pp-1f1b-runs", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B",
                      "--parallel.pp_microbatches", "2"], 1, 4),
    *[(f"pp-{s}", ["--parallel.pp", "2", "--parallel.pp_schedule", s,
                   "--parallel.pp_virtual_stages", "2"], 1, 4)
      for s in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")],
    ("ep", ["--parallel.ep", "2"], 2, 2, MOE),
    ("moe-zero2", ["--parallel.data_parallel", "zero2"], 2, 2, MOE),
    ("tp-moe", ["--parallel.tp", "2"], 1, 2, [*MOE, "--model.n_shared_experts", "1"]),
    ("tp-moe-nosp", ["--parallel.tp", "2", "--parallel.sequence_parallel", "false"], 1, 2,
     MOE),
    ("pp-moe", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B"], 1, 2, MOE),
    # FSDP's CPU offload: gradients on the host, norms reduced on the training device
    ("zero3-offload", ["--parallel.data_parallel", "zero3", "--parallel.cpu_offload", "true"],
     2, 2),
]
# Low-precision runs of one layout per technique (each adds a run to the spawn); fp16 uses the
# loss scaler (sharded where gradients differ between ranks).
LOW_2 = {"ep": ("bf16",), "tp-moe": ("bf16",), "ddp": ("bf16",), "zero1": ("bf16",),
         "zero3": ("bf16", "fp16"), "tp-sp": ("bf16",), "tp-sp-ac": ("bf16",), "cp": ("bf16",),
         "pp-gpipe": ("bf16", "fp16"), "pp-ZBVZeroBubble": ("bf16",)}
LAYOUTS_4 = [
    ("hsdp", ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"], 4, 2),
    ("fsdp-x-tp", ["--parallel.tp", "2"], 2, 2),
    ("fsdp-x-tp-tied", ["--parallel.tp", "2"], 2, 2, TIED),
    ("hsdp-x-tp", ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                   "--parallel.tp", "2"], 2, 2),
    ("pp-x-fsdp", ["--parallel.pp", "2"], 2, 2),
    # FSDP reduces after each of the two schedule runs and sums the reduced shards
    ("pp-x-fsdp-runs", ["--parallel.pp", "2", "--parallel.pp_microbatches", "2"], 2, 4),
    ("fsdp-x-cp", ["--parallel.cp", "2"], 2, 2),
    ("pp-x-tp", ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.dp_shard", "1"], 1, 2),
    ("pp-x-cp", ["--parallel.pp", "2", "--parallel.cp", "2", "--parallel.dp_shard", "1"], 1, 2),
    ("zero3-4", ["--parallel.data_parallel", "zero3"], 4, 2),
    ("ep-x-fsdp", ["--parallel.ep", "2"], 4, 2, MOE),
    # ZeRO-0 with TP / PP: replicas of the sharded model, gradients all-reduced by the step
    ("ddp-x-tp", ["--parallel.data_parallel", "ddp", "--parallel.tp", "2"], 2, 2),
    ("ddp-x-pp", ["--parallel.data_parallel", "ddp", "--parallel.pp", "2"], 2, 2),
    # ZeRO-1 with TP / PP: the same, the optimizer state partitioned over the replicas
    ("zero1-x-tp", ["--parallel.data_parallel", "zero1", "--parallel.tp", "2"], 2, 2),
    ("zero1-x-pp", ["--parallel.data_parallel", "zero1", "--parallel.pp", "2"], 2, 2),
    # ZeRO-2 (FSDP2 without resharding after forward) with TP / PP
    ("zero2-x-tp", ["--parallel.data_parallel", "zero2", "--parallel.tp", "2"], 2, 2),
    ("zero2-x-pp", ["--parallel.data_parallel", "zero2", "--parallel.pp", "2"], 2, 2),
    ("fsdp-x-tp-moe", ["--parallel.tp", "2"], 2, 2, MOE),
    ("pp-x-ep", ["--parallel.pp", "2", "--parallel.ep", "2"], 2, 2, MOE),
    ("ep4-bias", ["--parallel.ep", "4"], 4, 2, [*MOE, "--model.moe_bias_update_rate", "0.01"]),
]
LOW_4 = {"ddp-x-tp": ("fp16",), "zero1-x-tp": ("bf16", "fp16"), "fsdp-x-tp": ("bf16", "fp16"),
         "hsdp-x-tp": ("bf16",), "pp-x-fsdp": ("bf16",), "pp-x-tp": ("bf16",)}
# Expert parallelism composed with tensor parallelism (parallel/ep_tp.py): 4 experts over
# ep 2 x tp 2 (one per rank), attention tensor parallel, FSDP over dp_shard 2 (= ep).
LAYOUTS_EP_TP = [
    ("ep-x-tp", ["--parallel.ep", "2", "--parallel.tp", "2"], 2, 2,
     [*MOE, "--model.n_shared_experts", "1"]),
    ("ep-x-tp-zero2-nosp", ["--parallel.data_parallel", "zero2", "--parallel.ep", "2",
                            "--parallel.tp", "2", "--parallel.sequence_parallel", "false"],
     2, 2, [*MOE, "--model.moe_bias_update_rate", "0.01"]),
]
LOW_EP_TP = {"ep-x-tp": ("bf16",)}
LAYOUTS_8 = [("pp-x-tp-x-fsdp", ["--parallel.pp", "2", "--parallel.tp", "2"], 2, 2),
             # EP x TP with dp_shard 4 > ep 2: FSDP shards each expert chunk over
             # dp_shard_mod_ep 2 (FSDP2's 3-D dp x ep x tp sharding of the experts)
             ("ep-x-tp-x-fsdp", ["--parallel.ep", "2", "--parallel.tp", "2"], 4, 2, MOE)]
LOW_8 = {"pp-x-tp-x-fsdp": ("bf16",)}


def _run(tmp: Path, cache: Path, world: int, layouts: list, low: dict[str, tuple[str, ...]],
         refs_out: dict | None = None) -> tuple[dict, dict, list]:
    layouts = [(*lay, []) if len(lay) == 4 else lay for lay in layouts]
    keys = {(4 * dp, ga, tuple(m), dtype) for name, _, dp, ga, m in layouts
            for dtype in ("fp32", *low.get(name, ()))}
    refs = {key: _reference(tmp, cache, *key) for key in sorted(keys)}
    if refs_out is not None:  # the single-process references, for further checks
        refs_out.update(refs)
    jobs = []
    for name, flags, _, ga, m in layouts:
        argv = [*flags, *m, "--training.grad_accum_steps", str(ga)]
        jobs.append((name, [str(tmp / name), str(cache), *argv]))
        for dtype in low.get(name, ()):
            jobs.append((f"{name}-{dtype}", [str(tmp / f"{name}-{dtype}"), str(cache), *argv,
                                             "--precision.dtype", dtype], {"capture": False}))
    result = spawn(world, jobs, STEPS, tmp)
    table = {name: _compare(result, name, refs[(4 * dp, ga, tuple(m), "fp32")])
             for name, _, dp, ga, m in layouts}
    errors = {name: {dtype: _compare_low(result, name, dtype,
                                         refs[(4 * dp, ga, tuple(m), dtype)])
                     for dtype in low[name]}
              for name, _, dp, ga, m in layouts if name in low}
    return table, errors, result


def _check(world: int, table: dict[str, tuple[float, ...]],
           low: dict[str, dict[str, float]], norm_tol: float = LOSS_TOL) -> None:
    bad, rows = [], []
    for name, (_, dloss, dnorm, dgrad, dval) in table.items():
        cells = [f"{low.get(name, {})[d]:.1e}" if d in low.get(name, {}) else "-"
                 for d in ("bf16", "fp16")]
        rows.append(f"| {name} | {world} | {dloss:.1e} | {dnorm:.1e} | {dgrad:.1e} | "
                    f"{dval:.1e} | {' | '.join(cells)} |")
        print(rows[-1])
        if not (dloss <= LOSS_TOL and dnorm <= norm_tol and dgrad <= GRAD_TOL
                and dval <= LOSS_TOL):
            bad.append((name, dloss, dnorm, dgrad, dval))
        bad += [(name, d, e) for d, e in low.get(name, {}).items() if e > LOW_TOL]
    if TABLE:
        with open(TABLE, "a") as f:
            f.write("\n".join(rows) + "\n")
    assert not bad, bad


@pytest.mark.distributed
def test_two_rank_layouts_match_one_process(tmp_path: Path) -> None:
    table, low, result = _run(tmp_path, tmp_path / "cache", 2, LAYOUTS_2, LOW_2)
    _check(2, table, low)
    # Memory per rank: ZeRO-3 holds about half the parameters, ZeRO-1/2 half the optimizer
    # state of DDP (counted as tensor bytes on each rank).
    ddp = result[0]["ddp"]["bytes"]
    for rank in result:
        assert rank["zero3"]["bytes"]["params"] <= 0.55 * ddp["params"]
        for name in ("zero1", "zero2", "zero3"):
            assert rank[name]["bytes"]["optim"] <= 0.55 * ddp["optim"], name


@pytest.mark.distributed
def test_four_rank_layouts_match_one_process(tmp_path: Path) -> None:
    table, low, result = _run(tmp_path, tmp_path / "cache", 4, LAYOUTS_4, LOW_4)
    _check(4, table, low)
    for rank in result:  # ZeRO-1 keeps half the optimizer state of its ZeRO-0 twin
        for name in ("tp", "pp"):
            ddp = rank[f"ddp-x-{name}"]["bytes"]
            zero1 = rank[f"zero1-x-{name}"]["bytes"]
            assert zero1["params"] == ddp["params"], name
            assert zero1["optim"] <= 0.55 * ddp["optim"], name


def _check_moe_stats(result: list[dict[str, Any]], name: str, ref: dict[str, Any]) -> float:
    """The router statistics of the steps (expert loads summed over the data-parallel ranks,
    router entropy and balancing loss of the last micro-batch) against one process: the loads
    equal, the rest to the loss tolerance. Returns the largest relative difference."""
    got, want = result[0][name]["moe"], ref["moe"]
    assert got is not None and set(got["layers"]) == set(want["layers"]), name
    worst = 0.0
    for layer, w in want["layers"].items():
        g = got["layers"][layer]
        assert g["tokens_per_expert"] == w["tokens_per_expert"], (name, layer, g, w)
        for key in ("router_entropy", "aux_loss"):
            worst = max(worst, abs(g[key] - w[key]) / abs(w[key]))
    assert worst <= LOSS_TOL, (name, worst)
    return worst


@pytest.mark.distributed
def test_four_rank_ep_x_tp_matches_one_process(tmp_path: Path) -> None:
    refs: dict = {}
    table, low, result = _run(tmp_path, tmp_path / "cache", 4, LAYOUTS_EP_TP, LOW_EP_TP, refs)
    _check(4, table, low)
    for name, _, dp, ga, model in LAYOUTS_EP_TP:
        ref = refs[(4 * dp, ga, tuple(model), "fp32")]
        print(name, "router statistics: max rel. difference", _check_moe_stats(result, name, ref))


@pytest.mark.distributed
def test_eight_rank_pp_x_tp_x_fsdp_matches_one_process(tmp_path: Path) -> None:
    table, low, _ = _run(tmp_path, tmp_path / "cache", 8, LAYOUTS_8, LOW_8)
    _check(8, table, low)
