"""precision.fp8 (torchao float8 linears, emulated on the CPU) in one process and in parallel
layouts, against one fp8 process with the same micro-batches (gloo, spawned processes), with
gradient clipping on.

The reference runs micro-batches of 4 rows with 4 accumulation steps; each layout runs the same
micro-batches (data parallel: 2 ranks x 2 steps of 4 rows; TP and PP: all 4 steps), so every
tensorwise activation scale is taken over the same rows. FSDP (weights all-gathered in fp8,
their scales precomputed after each step), HSDP, DDP, ZeRO-1 and PP then do the very same fp8
matmuls: losses and gradient norms match to 1e-7 (measured: at most 7.8e-8 and 1.4e-7 over 3
steps). TP in fp32 (tensorwise, rowwise, FSDP x TP): the first loss is equal (measured 7.6e-8
and 0), later steps differ a little (tensorwise: loss 1.2e-6 to 2.8e-6, gradient norm 1.3e-3 to
5.4e-3): a TP-split sum rounds differently by an ulp, its amax and so the (non-power-of-two)
tensorwise scale follow, and elements near an fp8 rounding boundary (e4m3 steps are 6 %, e5m2 12
%) flip. With power-of-two scales forced, the same TP run matched to 1e-7, which locates the
difference there. Rowwise scales are powers of two, so they move only when an amax crosses one:
one machine measured 0 and 7e-8 over 3 steps, an AMD EPYC (AVX-512) one 5.1e-6 and 1.5e-3 at the
third step, so rowwise TP is held to the TP tolerances too. CP is not bit-comparable (scales
taken over tokens cover one rank's half of each sequence) and is held to the bf16 layout
tolerance. The other checks also assert that one process without fp8 differs by more than 10x
their tolerance (TP: 10x the layout's own difference), so fp8 really ran in the layout.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_worker import run_trainer, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao"),
]

STEPS = 3
SAME_MATMULS_TOL = 1e-6  # the same fp8 matmuls as the reference
TP_FIRST_LOSS_TOL = 1e-6  # tensorwise TP, fp32: the first forward (measured 7.6e-8)
TP_LOSS_TOL = 2e-4  # later steps carry fp8 rounding flips (measured 1.2e-6; 6e-5 seen)
TP_NORM_TOL = 1e-2  # (measured 1.3e-3; 4e-3 seen)
LOW_TOL = 2e-2  # CP in bf16: test_parity's tolerance for bf16 layouts against one process
REF = ["--training.micro_batch_size", "4", "--training.grad_accum_steps", "4"]
DP2 = ["--training.micro_batch_size", "4", "--training.grad_accum_steps", "2"]


def _args(dtype: str, fp8: str) -> list[str]:
    return ["--precision.dtype", dtype, "--precision.fp8", fp8]


# name, recipe, dtype, layout flags
LAYOUTS = [
    ("zero3-tensorwise", "tensorwise", "bf16", [*DP2, "--parallel.data_parallel", "zero3"]),
    ("zero2-rowwise", "rowwise", "bf16", [*DP2, "--parallel.data_parallel", "zero2"]),
    ("ddp-rowwise", "rowwise", "bf16", [*DP2, "--parallel.data_parallel", "ddp"]),
    ("zero1-tensorwise", "tensorwise", "bf16", [*DP2, "--parallel.data_parallel", "zero1"]),
    ("pp-tensorwise", "tensorwise", "bf16", [*REF, "--parallel.pp", "2",
                                              "--parallel.pp_schedule", "1F1B"]),
    ("tp-tensorwise-fp32", "tensorwise", "fp32", [*REF, "--parallel.tp", "2"]),
    ("tp-rowwise-fp32", "rowwise", "fp32", [*REF, "--parallel.tp", "2"]),
    # CP halves each sequence: the scales over tokens (tensorwise; rowwise's gradient-weight
    # casts) cover one rank's half (measured: loss 3.4e-5, gradient norm 1.1e-3)
    ("cp-rowwise", "rowwise", "bf16", [*REF, "--parallel.cp", "2"]),
]
# 4 ranks: FSDP (fp8 all-gather) x TP on a 2-D mesh; HSDP
LAYOUTS_4 = [
    ("fsdp-x-tp-tensorwise-fp32", "tensorwise", "fp32", [*DP2, "--parallel.tp", "2"]),
    ("hsdp-tensorwise", "tensorwise", "bf16",
     ["--training.micro_batch_size", "4", "--training.grad_accum_steps", "1",
      "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
]


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """One process, with and without fp8, keyed by (recipe, dtype)."""
    tmp = tmp_path_factory.mktemp("fp8-ref")
    out = {}
    for fp8, dtype in (("none", "bf16"), ("tensorwise", "bf16"), ("rowwise", "bf16"),
                       ("none", "fp32"), ("tensorwise", "fp32"), ("rowwise", "fp32")):
        res = run_trainer([str(tmp / f"{fp8}-{dtype}"), str(tmp / "cache"), *REF,
                           *_args(dtype, fp8)], STEPS, capture=False)
        out[fp8, dtype] = {"losses": res["losses"], "norms": res["norms"],
                           "fp8": type(res["trainer"].model.layers["0"].attention.wq).__name__}
    return out


def _rel(got: list[float], ref: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]


def test_one_process_fp8_trains_close_to_bf16(refs: dict) -> None:
    bf16 = refs["none", "bf16"]["losses"]
    for recipe in ("tensorwise", "rowwise"):
        ref = refs[recipe, "bf16"]
        assert ref["fp8"] == "Float8Linear"
        assert all(math.isfinite(x) for x in ref["losses"] + ref["norms"])
        assert ref["losses"] != bf16, f"{recipe}: fp8 losses equal bf16 (fp8 not applied)"
        assert max(_rel(ref["losses"], bf16)) < 0.02, (recipe, ref["losses"], bf16)
        assert ref["losses"][-1] < ref["losses"][0]  # it learns


def _check(refs: dict, layouts: list, world: int, tmp_path: Path) -> None:
    jobs = [(name, [str(tmp_path / name), str(tmp_path / "cache"), *flags,
                    *_args(dtype, recipe)], {"capture": False})
            for name, recipe, dtype, flags in layouts]
    out = tmp_path / "out"
    out.mkdir()
    result = spawn(world, jobs, STEPS, out)
    for name, recipe, dtype, _ in layouts:
        ref, plain = refs[recipe, dtype], refs["none", dtype]
        dloss = _rel(result[0][name]["losses"], ref["losses"])
        dnorm = max(max(_rel(rank[name]["norms"], ref["norms"])) for rank in result)
        print(f"{name}: loss {max(dloss):.1e} (first {dloss[0]:.1e}), grad norm {dnorm:.1e}")
        # FSDP without TP gathers the 28 block weights (4 layers x 7 linears) in fp8
        gathered = 28 if recipe == "tensorwise" and name.startswith(("zero3", "hsdp")) else 0
        assert all(rank[name]["fp8_gathered"] == gathered for rank in result), name
        fp8_effect = _rel(plain["losses"], ref["losses"])  # what skipping fp8 would change
        if name.startswith("cp"):  # other scales, and bf16 CP alone differs by 1.9e-3
            assert max(*dloss, dnorm) <= LOW_TOL, (name, dloss, dnorm)
        elif "tp" in name.split("-"):
            assert dloss[0] <= TP_FIRST_LOSS_TOL, (name, dloss)
            assert max(dloss) <= TP_LOSS_TOL and dnorm <= TP_NORM_TOL, (name, dloss, dnorm)
            # fp8 ran: the layout is far closer to the fp8 process than the run without fp8 is
            assert max(fp8_effect) > 10 * max(dloss), (name, fp8_effect, dloss)
        else:
            norm_effect = max(_rel(plain["norms"], ref["norms"]))
            assert max(*fp8_effect, norm_effect) > 10 * SAME_MATMULS_TOL
            assert max(dloss) <= SAME_MATMULS_TOL and dnorm <= SAME_MATMULS_TOL, \
                (name, dloss, dnorm)


def test_fp8_layouts_match_one_fp8_process(refs: dict, tmp_path: Path) -> None:
    _check(refs, LAYOUTS, 2, tmp_path)


def test_fp8_2d_layouts_match_one_fp8_process(refs: dict, tmp_path: Path) -> None:
    _check(refs, LAYOUTS_4, 4, tmp_path)
