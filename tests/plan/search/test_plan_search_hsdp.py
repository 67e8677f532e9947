"""HSDP in the layout search: shard groups inside a node (and larger), replicated across the
rest of data parallelism; proposed where the network is thin (fms-fsdp's Llama 2 7B on 128
A100 with 400 Gb/s per node), planned with the states sharded over the shard group, and printed
with the flags that run it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from scaletrain.cli import main as cli
from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.hardware import get_device
from scaletrain.plan.layout import Layout
from scaletrain.plan.search.space import ZERO_OF_MODE, search, shard_groups
from scaletrain.plan.timing.step_time import Cluster, step_time

A100 = get_device("A100-80GB")
LLAMA2_7B = get_preset("llama2-7b")
SEQ, GBS = 4096, 256
# fms-fsdp's setting: bf16 parameters gathered, gradients reduced in bf16
BASE = Layout(precision="bf16", fsdp_reduce_dtype="bf16")


def _search(inter_node_gbs: float):
    device = dataclasses.replace(A100, inter_node_gbs=inter_node_gbs)
    fitting, every = search(LLAMA2_7B, Cluster(device, 128), SEQ, SEQ * GBS, BASE,
                            model="llama2-7b")
    return fitting, every


def _hsdp(c) -> bool:
    return c.layout.fsdp and c.layout.dims.dp_replicate > 1


def test_shard_groups_start_at_the_node_and_double_below_dp() -> None:
    cluster = Cluster(A100, 1536)
    assert shard_groups(cluster, 1, 1, 1536) == [512, 256, 128, 64, 32, 16, 8]
    assert shard_groups(cluster, 2, 1, 768) == [256, 128, 64, 32, 16, 8, 4]
    assert shard_groups(cluster, 1, 1, 96) == [32, 16, 8]  # 64 does not divide 96
    assert shard_groups(cluster, 4, 2, 192) == []  # one DP rank per node: nothing to shard
    assert shard_groups(cluster, 1, 1, 8) == []  # the node is all of DP: that is FSDP


def test_thin_network_ranks_hsdp_above_fsdp_and_its_command_runs_it() -> None:
    fitting, _ = _search(6.25)  # 400 Gb/s per 8-GPU node, as fms-fsdp measured
    zero3 = [c for c in fitting if c.layout.zero == 3]
    best = zero3[0]
    d = best.layout.dims
    assert _hsdp(best) and (d.dp_replicate, d.dp_shard, d.tp, d.pp) == (16, 8, 1, 1)
    fsdp = next(c for c in zero3 if not _hsdp(c) and c.layout.mbs == best.layout.mbs
                and c.layout.recompute == best.layout.recompute and c.layout.dims.tp == 1
                and c.layout.dims.pp == 1)
    assert fitting.index(best) < fitting.index(fsdp)
    assert best.step_time_s < fsdp.step_time_s
    assert best.times["dp_comm_exposed"] < fsdp.times["dp_comm_exposed"]
    # shards over 8 ranks hold more than shards over 128
    assert best.plan.peak_bytes > fsdp.plan.peak_bytes
    cmd = best.command
    for flag in ("--parallel.dp_replicate 16", "--parallel.dp_shard 8",
                 "--parallel.data_parallel zero3", "--parallel.fsdp_reduce_dtype bf16"):
        assert flag in cmd
    j = best.to_json()
    assert (j["dp"], j["dp_replicate"], j["dp_shard"]) == (128, 16, 8)


def test_thick_network_keeps_fsdp_over_every_rank() -> None:
    fitting, every = _search(25.0)  # 8 x 200 Gb/s per node
    zero3 = [c for c in fitting if c.layout.zero == 3 and c.layout.dims.tp == 1]
    assert not _hsdp(zero3[0]) and zero3[0].layout.dims.dp_shard == 128
    # an HSDP layout is kept only where it beats FSDP over every rank of the same layout, and
    # each layout keeps one (its fastest that fits)
    def rest(c) -> tuple:
        lay = c.layout
        return (lay.zero, lay.mbs, lay.recompute, lay.dims.tp, lay.dims.pp, lay.vpp,
                lay.dims.cp, lay.schedule)

    kept = [c for c in every if _hsdp(c) and c.fits]
    assert kept  # tp 2: four DP ranks per node
    assert len({rest(c) for c in kept}) == len(kept)
    for c in kept:
        twin = next(f for f in every if f.fits and not _hsdp(f) and rest(f) == rest(c))
        assert c.step_time_s < twin.step_time_s


def test_hsdp_memory_shards_the_states_over_the_shard_group() -> None:
    def plan(replicate: int, shard: int):
        lay = BASE.replace(dims=ParallelDims(dp_replicate=replicate, dp_shard=shard), mbs=2,
                           gbs=GBS, seq_len=SEQ, zero=3, fsdp_param_dtype="bf16")
        return estimate(LLAMA2_7B, lay)

    fsdp, hsdp = plan(1, 128), plan(16, 8)
    for state in ("optimizer", "gradients"):
        assert hsdp.memory_bytes[state] == pytest.approx(16 * fsdp.memory_bytes[state],
                                                         rel=1e-3)
    assert hsdp.memory_bytes["activations"] == fsdp.memory_bytes["activations"]


def test_every_hsdp_candidate_command_matches_its_label() -> None:
    _, every = _search(6.25)
    hsdp = [c for c in every if _hsdp(c)]
    assert hsdp
    for c in hsdp:
        d = c.layout.dims
        cmd = c.command
        mode = re.search(r"--parallel\.data_parallel (\w+)", cmd).group(1)
        assert c.to_json()["zero"] == ZERO_OF_MODE[mode] == c.layout.zero >= 2
        assert f"--parallel.dp_replicate {d.dp_replicate} --parallel.dp_shard {d.dp_shard}" \
            in cmd
        assert d.dp_replicate * d.dp_shard * d.tp * d.pp * d.cp == 128


def test_cli_table_and_json_show_hsdp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "search", "--model", "llama2-7b", "--gpus", "128", "--gpu", "A100-80GB",
            "--seq-len", "4096", "--gbs", "256", "--inter-node-gbs", "6.25",
            "--fsdp-reduce-dtype", "bf16", "--top", "3"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ 2 +16x8 +1 +1 ", out, re.M), out
    assert "dp RxS: HSDP" in out
    assert cli([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["dp_replicate"] == 16 and r["dp_shard"] == 8 for r in rows)


def test_hsdp_all_reduce_is_charged_once_per_step_as_the_trainer_runs_it() -> None:
    """The trainer all-reduces HSDP's gradients across the replicas in the last micro-batch
    only (`Parallelism.micro_batch_sync`; `tests/parallel/distributed/test_reductions_per_step.py`):
    more micro-batches add what FSDP over the shard group adds, not one all-reduce each."""
    device = dataclasses.replace(A100, inter_node_gbs=6.25)

    def exposed(replicas: int, m: int) -> float:
        dims = ParallelDims(dp_replicate=replicas, dp_shard=8)
        lay = dataclasses.replace(BASE, dims=dims, mbs=2, seq_len=SEQ, zero=3,
                                  gbs=2 * m * replicas * 8)
        plan = estimate(LLAMA2_7B, lay)
        _, times = step_time(plan, Cluster(device, replicas * 8), SEQ * lay.gbs)
        return times["dp_comm_exposed"]

    hsdp_more = exposed(16, 4) - exposed(16, 1)
    fsdp_more = exposed(1, 4) - exposed(1, 1)  # the same shard group, no replicas
    assert hsdp_more == pytest.approx(fsdp_more, rel=1e-9)
    assert exposed(16, 1) > exposed(1, 1)  # the all-reduce itself is charged


def test_fsdp_under_pp_reduces_once_per_step_as_torch_schedules_it() -> None:
    """torch's pipeline schedules reduce a stage's FSDP gradients once, after its last backward
    (`tests/parallel/distributed/test_reductions_per_step.py` counts it): under PP more
    micro-batches add gathers only, so the gradients' wire dtype does not change what they add;
    without PP each micro-batch reduce-scatters."""
    h100 = get_device("H100")

    def added(pp: int, reduce_dtype: str) -> float:
        def exposed(m: int) -> float:
            dims = ParallelDims(pp=pp, dp_shard=8)
            lay = dataclasses.replace(BASE, dims=dims, mbs=1, seq_len=SEQ, zero=3, gbs=8 * m,
                                      fsdp_reduce_dtype=reduce_dtype)
            _, times = step_time(estimate(LLAMA2_7B, lay), Cluster(h100, 8 * pp), SEQ * 8 * m)
            return times["dp_comm_exposed"]
        return exposed(8) - exposed(4)

    assert added(2, "fp32") == pytest.approx(added(2, "bf16"), rel=1e-9)
    assert added(1, "fp32") > added(1, "bf16")
