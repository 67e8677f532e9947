"""Plan and run are one contract: dry-run = plan, the search proposes only what the trainer
runs (and its commands reproduce its layouts), SP and TP bytes, device names, HF configs."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from scaletrain.cli import main as cli
from scaletrain.config import load_config
from scaletrain.models.args import get_preset
from scaletrain.models.hf import hf_config_from_model_args
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.from_config import layout_from_config
from scaletrain.plan.hardware import get_device, match_device
from scaletrain.plan.layout import Layout
from scaletrain.plan.search.space import search
from scaletrain.plan.timing.step_time import Cluster
from scaletrain.runtime import resolve_device

GIB = 2**30
MODEL = "llama3.2-1b"
TRAIN = ["--model.name", MODEL, "--training.device", "cpu", "--data.seq_len", "1024",
         "--training.micro_batch_size", "1", "--precision.dtype", "bf16"]
PLAN = ["plan", "--model", MODEL, "--seq-len", "1024", "--mbs", "1", "--dp", "8",
        "--precision", "bf16", "--param-dtype", "fp32", "--kernels", "cpu", "--json"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _dry_run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, world: int,
             *flags: str) -> tuple[int, dict, str]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    rc, out, err = _run(capsys, "train", "--dry-run", "--json", *TRAIN, *flags)
    return rc, (json.loads(out) if out.strip() else {}), err


@pytest.mark.parametrize(("mode", "zero"), [("ddp", 0), ("zero1", 1), ("zero2", 2),
                                            ("zero3", 3)])
def test_dry_run_json_is_the_plan_of_each_data_parallel_mode(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mode: str,
        zero: int) -> None:
    rc, dry, _ = _dry_run(capsys, monkeypatch, 8, "--parallel.dp_shard", "8",
                          "--parallel.data_parallel", mode)
    # 0 fits this host, 3 does not (8 ranks of a 1B model share its RAM): the JSON is the plan
    assert rc in (0, 3) and dry["layout"]["data_parallel"] == mode
    assert dry["layout"]["zero"] == zero
    rc, out, _ = _run(capsys, *PLAN, "--zero", str(zero), "--dp-replicate", "1")
    plan = json.loads(out)
    dry.pop("device")
    assert rc == 0 and plan == dry  # the same JSON, field for field
    mem, params = dry["memory_bytes"], dry["params"]
    # fp32 parameters under autocast: 4 B weights; sharded 8 ways only from ZeRO-2 (FSDP) on.
    assert mem["weights"] == pytest.approx(4 * params / (8 if zero >= 2 else 1), rel=0.01)
    assert mem["optimizer"] == pytest.approx(8 * params / (8 if zero >= 1 else 1), rel=0.01)
    assert (mem["gathered_weights"] > 0) == (zero == 2)  # ZeRO-2 keeps blocks gathered


def test_dry_run_offload_and_fsdp_param_dtype_change_the_plan(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    shard = ("--parallel.dp_shard", "8", "--parallel.data_parallel", "zero3")
    _, base, _ = _dry_run(capsys, monkeypatch, 8, *shard)
    _, bf16, _ = _dry_run(capsys, monkeypatch, 8, *shard, "--parallel.fsdp_param_dtype", "bf16")
    _, off, _ = _dry_run(capsys, monkeypatch, 8, *shard, "--parallel.cpu_offload", "true")
    assert base["memory_bytes"]["cast_weights"] > 0 == bf16["memory_bytes"]["cast_weights"]
    assert bf16["comm_bytes_per_step"]["all_gather"] < base["comm_bytes_per_step"]["all_gather"]
    assert off["layout"]["cpu_offload"] and off["memory_bytes"]["optimizer"] == 0
    assert off["memory_bytes"]["weights"] == off["memory_bytes"]["gradients"] == 0
    moved = sum(base["memory_bytes"][k] for k in ("weights", "gradients", "optimizer"))
    assert off["cpu_offload_bytes"] == pytest.approx(moved, rel=1e-6)
    # One process: optimizer.offload moves the optimizer state only.
    _, one, _ = _dry_run(capsys, monkeypatch, 1, "--optimizer.offload", "true")
    assert one["layout"]["offload"] and one["memory_bytes"]["optimizer"] == 0
    assert one["memory_bytes"]["weights"] > 0


def test_dry_run_exit_codes(capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    rc, plan, _ = _dry_run(capsys, monkeypatch, 1)
    assert rc == 0 and plan["device"]["fits"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc, out, _ = _run(capsys, "train", "--dry-run", *TRAIN, "--model.name", "llama3.1-405b")
    assert rc == 3 and "DOES NOT FIT" in out
    assert "no change the trainer offers makes it fit" in out
    assert "--optimizer.offload true: peak" in out
    rc, _, err = _run(capsys, "train", "--dry-run", "--model.name", "no-such-model")
    assert rc == 2 and "unknown preset" in err
    # A layout the trainer refuses is a config error: FSDP's CPU offload without FSDP.
    rc, _, err = _dry_run(capsys, monkeypatch, 4, "--parallel.tp", "2",
                          "--parallel.data_parallel", "zero1", "--parallel.cpu_offload", "true")
    assert rc == 2 and "parallel.cpu_offload needs data_parallel zero2 or zero3" in err
    # ZeRO-1 with tensor parallelism plans (and runs); whether 4 ranks of it fit in this
    # host's RAM (each gets a quarter) depends on the host.
    rc, out, err = _dry_run(capsys, monkeypatch, 4, "--parallel.tp", "2",
                            "--parallel.data_parallel", "zero1")
    assert rc in (0, 3) and out["device"]["name"] == "cpu (host RAM / 4 ranks)", err


def test_sequence_parallel_moves_plain_tensor_parallels_bytes_plus_the_regathers() -> None:
    """Each all-reduce becomes an all-gather + reduce-scatter (the same bytes); backward
    all-gathers the attention and MLP inputs once more (2 per layer and micro-batch)."""
    args = get_preset("llama3-8b")
    for recompute in ("none", "full"):
        lay = Layout(dims=ParallelDims(tp=2, dp_shard=1), mbs=1, seq_len=4096,
                     recompute=recompute)
        sp = estimate(args, lay.replace(sequence_parallel=True))
        plain = estimate(args, lay.replace(sequence_parallel=False)).comm_bytes_by_dim["tp"]
        layers = args.n_layers
        one = (2 - 1) / 2 * 4096 * args.dim * 2  # an all-gather of the bf16 activation
        assert sp.comm_bytes_by_dim["tp"] == pytest.approx(plain + 2 * layers * one, abs=8)
        assert sp.comm_bytes_per_step["all_gather"] == pytest.approx(
            sp.comm_bytes_per_step["reduce_scatter"] + 2 * layers * one, abs=8)


def test_search_proposes_only_what_the_trainer_runs_and_commands_reproduce_it() -> None:
    cluster = Cluster(get_device("H100"), 16)
    for model in ("llama3-8b", "gpt2-xl"):
        args = get_preset(model)
        fitting, every = search(args, cluster, 1024, 1024 * 256, model=model)
        assert fitting
        assert all(not c.plan.trainer_problems for c in every)
        if args.arch == "gpt2":  # GPT-2 runs tensor parallel without sequence parallelism
            assert all(not c.layout.sequence_parallel for c in every)
        for c in fitting[:3]:
            argv = shlex.split(c.command)
            assert argv[:2] == ["torchrun", "--nnodes"] and "scaletrain" in argv
            flags = argv[argv.index("train") + 1:]
            cfg = load_config(flags)
            lay = layout_from_config(cfg, resolve_device("cpu"), c.layout.dims.world_size)
            planned = c.layout
            for field in ("dims", "mbs", "seq_len", "grad_accum", "zero", "recompute", "vpp",
                          "schedule", "fsdp_param_dtype", "precision", "data_parallel"):
                assert getattr(lay, field) == getattr(planned, field), (c.command, field)


def test_device_names_match_exactly_with_aliases() -> None:
    assert match_device("NVIDIA H100 80GB HBM3") is get_device("h100")
    assert match_device("L40").name == "L40" and match_device("L40S").name == "L40S"
    assert match_device("NVIDIA GH200 480GB").name == "GH200"
    assert match_device("H100 NVL").memory_gib > get_device("H100").memory_gib
    for unknown in ("H1000", "L40X", "H100-SXM-XL"):
        assert match_device(unknown) is None
    with pytest.raises(ValueError, match="Known: .*H100-SXM.*MI300X"):
        get_device("H1000")


def test_hf_config_file_or_folder_is_a_model(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    args = get_preset("llama3.2-1b")
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config_from_model_args(args)))
    common = ["--seq-len", "2048", "--mbs", "1", "--json"]
    _, preset, _ = _run(capsys, "plan", "--model", "llama3.2-1b", *common)
    for source in (folder, folder / "config.json"):
        rc, out, _ = _run(capsys, "plan", "--model", str(source), *common)
        assert rc == 0 and json.loads(out) == json.loads(preset)
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc, dry, _ = _dry_run(capsys, monkeypatch, 1, "--model.name", str(folder))
    assert rc == 0 and dry["params"] == json.loads(preset)["params"]
    rc, _, err = _run(capsys, "plan", "--model", str(tmp_path), *common)
    assert rc == 2 and "config.json" in err


def test_advice_names_changes_that_make_it_fit() -> None:
    from scaletrain.plan.search.advice import advise, combine

    args = get_preset("llama3-8b")
    budget = get_device("H100").memory_bytes
    lay = Layout(dims=ParallelDims(dp_replicate=8, dp_shard=1), mbs=1, seq_len=4096,
                 param_dtype="fp32")
    plan = estimate(args, lay)
    assert plan.peak_bytes > budget
    found = advise(plan, budget)
    assert found and all(a.plan.peak_bytes <= budget and not a.plan.trainer_problems
                         for a in found)
    costs = [(a.flops_cost, a.comm_cost_bytes, a.plan.cpu_offload_bytes) for a in found]
    assert costs == sorted(costs)  # cheapest first
    # A micro-batch of 2 at 8k needs two changes: each step lowers the peak, the last fits.
    big = estimate(args, lay.replace(mbs=2, seq_len=8192))
    steps = combine(big, budget)
    assert len(steps) >= 2 and steps[-1].plan.peak_bytes <= budget
    peaks = [big.peak_bytes] + [a.plan.peak_bytes for a in steps]
    assert peaks == sorted(peaks, reverse=True)


def test_advice_for_a_fine_tuning_plan_stays_fine_tuning() -> None:
    """Each change offered for a LoRA plan is re-planned as the same LoRA run (frozen base,
    adapter-only states), equal to planning the changed layout with the method directly."""
    from scaletrain.plan.finetune.plan import finetune_plan
    from scaletrain.plan.search.advice import advise, combine

    args = get_preset("llama3.1-8b")
    # bf16 weights (`--precision.param_dtype bf16`): with the trainer's fp32 default the frozen
    # base alone (32 GB) exceeds the budget on one device
    lay = Layout(dims=ParallelDims(), mbs=8, seq_len=4096, precision="bf16", param_dtype="bf16")
    plan = finetune_plan(estimate(args, lay), "lora", rank=16)
    budget = 24 * GIB
    assert plan.peak_bytes > budget
    found = advise(plan, budget, limit=50)
    assert found
    for a in found:
        assert a.plan.finetune == plan.finetune
        direct = finetune_plan(estimate(args, a.plan.layout), "lora", rank=16)
        assert a.plan.peak_bytes == direct.peak_bytes
        # pretraining states of an 8B model alone exceed 24 GiB; LoRA's do not
        assert a.plan.memory_bytes["optimizer"] < GIB
    steps = combine(plan, budget, steps=6)
    assert steps and steps[-1].plan.peak_bytes <= budget


def test_zero3_under_zero_bubble_plans_the_blocks_gathered_like_the_trainer_runs_them() -> None:
    """The trainer keeps ZeRO-3 blocks gathered from forward to backward under zero-bubble
    schedules (their split backward needs them): the plan counts ZeRO-2's gathered weights and
    one all-gather per block and micro-batch there. Under 1F1B ZeRO-3 gathers again in the
    backward (twice ZeRO-2's all-gather bytes), and torch's schedule leaves the stage gathered
    after each backward, which both stages count
    (`tests/plan/memory/distributed/test_pp_fsdp_memory.py`)."""
    from scaletrain.parallel.feasibility import reshards_after_forward

    args = get_preset("llama3-8b")
    base = Layout(dims=ParallelDims(pp=4, dp_shard=8), mbs=1, seq_len=4096, gbs=64, zero=3)
    plans = {(zero, s): estimate(args, base.replace(zero=zero, schedule=s,
                                                    vpp=1 if s == "1F1B" else 2))
             for zero in (2, 3) for s in ("1F1B", "ZBVZeroBubble", "InterleavedZeroBubble")}
    for s in ("ZBVZeroBubble", "InterleavedZeroBubble"):
        assert not reshards_after_forward("zero3", 4, s)
        zb3, zb2 = plans[(3, s)], plans[(2, s)]
        assert zb3.memory_bytes["gathered_weights"] == zb2.memory_bytes["gathered_weights"] > 0
        assert zb3.comm_bytes_per_step["all_gather"] == zb2.comm_bytes_per_step["all_gather"]
    assert reshards_after_forward("zero3", 4, "1F1B")
    assert plans[(3, "1F1B")].memory_bytes["gathered_weights"] == \
        plans[(2, "1F1B")].memory_bytes["gathered_weights"] > 0
    assert plans[(3, "1F1B")].comm_bytes_per_step["all_gather"] == \
        2 * plans[(2, "1F1B")].comm_bytes_per_step["all_gather"]


def test_plan_text_of_zero3_under_zbv_says_the_blocks_stay_gathered(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The command docs/benchmarks.md quotes, with its figures."""
    argv = shlex.split("plan --model llama3-8b --pp 4 --dp 8 --dp-replicate 1 --zero 3 "
                       "--schedule ZBVZeroBubble --vpp 2 --gbs 64 --mbs 1 --seq-len 4096 "
                       "--param-dtype bf16 --gpu H100")
    rc, zbv, _ = _run(capsys, *argv)
    rc1, one, _ = _run(capsys, *[a if a != "ZBVZeroBubble" else "1F1B" for a in argv])
    assert rc == rc1 == 0
    assert "ZeRO-3 under ZBVZeroBubble: the blocks stay gathered" in zbv
    assert "the blocks stay gathered" not in one
    assert "gradients unsharded until the last" in one and "unsharded until the last" in zbv

    def row(text: str, key: str) -> float:
        return next(float(line.split()[2]) for line in text.splitlines()
                    if line.startswith(key + " "))

    # bf16 parameters (--param-dtype bf16): FSDP gathers bf16 blocks from its fp32 shards
    # (ZBV's rank 0 holds the first and the last chunk: 8 blocks, the embedding and the head;
    # 1F1B's most loaded stage 8 blocks and the embedding), and the unsharded gradients
    # accumulate in fp32 (FSDP's reduce dtype)
    assert (row(zbv, "gathered_weights"), row(one, "gathered_weights")) == (5.21, 4.23)
    assert (row(zbv, "gradients"), row(one, "gradients")) == (10.41, 8.46)
    assert (row(one, "total"), row(zbv, "total")) == (41.90, 45.66)
