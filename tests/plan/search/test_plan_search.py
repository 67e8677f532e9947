"""Layout search: sane anchors (where teams that trained such models landed), JSON, CLI."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.cli import main as cli
from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.hardware import get_device
from scaletrain.plan.layout import DDP_BUCKET_BYTES, Layout
from scaletrain.plan.search.space import search
from scaletrain.plan.timing.collectives import Fabric, per_node
from scaletrain.plan.timing.step_time import CONTENTION, Cluster, step_time

H100 = get_device("H100")
M = 2**20


def _best(model: str, gpus: int, seq: int, gbs_tokens: int, **kw: int):
    args = get_preset(model)
    if seq > args.max_seq_len:
        args = args.replace(max_seq_len=seq)
    fitting, every = search(args, Cluster(H100, gpus), seq, gbs_tokens, **kw)
    assert fitting, "no layout fits"
    return fitting, every


def test_every_fitting_layout_fits_and_respects_the_procedure() -> None:
    fitting, every = _best("llama3-70b", 64, 8192, 4 * M)
    usable = Cluster(H100, 64).usable_bytes
    assert any(not c.fits for c in every)
    for c in fitting:
        d = c.layout.dims
        assert c.plan.peak_bytes <= usable
        assert d.tp <= 8  # tensor parallel never leaves the node
        assert d.world_size == 64
        assert c.layout.grad_accum * c.layout.mbs * d.dp * 8192 == 4 * M
    times = [c.step_time_s for c in fitting]
    assert times[0] <= min(times) * 1.005
    # tensor parallel below the node size combines with pipeline parallel (BLOOM's TP 4 x PP 12)
    assert any(1 < c.layout.dims.tp < 8 and c.layout.dims.pp > 1 for c in fitting)


def test_llama3_70b_on_eight_nodes_shards_or_splits_the_model() -> None:
    fitting, _ = _best("llama3-70b", 64, 8192, 4 * M)
    best = fitting[0].layout
    assert best.dims.cp == 1 and (best.zero == 3 or best.dims.tp * best.dims.pp > 1)
    # With replicated weights (ZeRO-0/1), data parallelism composes with TP and PP as
    # Megatron's data parallelism and distributed optimizer do; ZeRO-1 keeps less per rank.
    args = get_preset("llama3-70b")
    fitting, every = search(args, Cluster(H100, 64), 8192, 4 * M, max_zero=1)
    model_parallel = [c for c in every if c.layout.dims.dp > 1
                      and c.layout.dims.tp * c.layout.dims.pp > 1]
    assert {c.layout.zero for c in model_parallel} == {0, 1}
    assert all(not c.plan.trainer_problems for c in every)
    assert any(c.layout.zero == 1 and c.layout.dims.tp > 1 for c in fitting[:10])


def test_llama3_405b_context_parallel_only_for_long_sequences() -> None:
    short, _ = _best("llama3.1-405b", 2048, 8192, 16 * M)
    assert short[0].layout.dims.cp == 1
    long, _ = _best("llama3.1-405b", 2048, 131072, 16 * M)
    assert long[0].layout.dims.cp > 1 and long[0].layout.dims.tp == 8


def test_small_model_stays_data_parallel() -> None:
    fitting, _ = _best("llama3.2-1b", 8, 4096, M // 2)
    best = fitting[0].layout
    assert best.dims.dp == 8 and best.dims.tp == 1 and best.recompute == "none"
    # Sharding only as far as it pays (here for a larger micro-batch); ties go to the simpler.
    assert best.zero < 3


def test_cli_search_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--gpu", "H100",
              "--seq-len", "8192", "--gbs-tokens", str(M), "--json", "--top", "3"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and 1 <= len(rows) <= 3
    for key in ("dp", "tp", "pp", "vpp", "cp", "zero", "mbs", "ga", "recompute",
                "memory_bytes_per_gpu", "step_time_s", "mfu"):
        assert key in rows[0]
    assert rows[0]["step_time_s"] <= rows[-1]["step_time_s"] * 1.005
    assert 0 < rows[0]["mfu"] < 1
    rc = cli(["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--gpu", "H100",
              "--seq-len", "8192", "--gbs-tokens", str(M), "--top", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "why #1" in out and "nearest alternatives" in out


def test_cli_search_bad_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["plan", "search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "Z80",
              "--seq-len", "8192", "--gbs-tokens", str(M)])
    assert rc == 2 and "unknown GPU 'Z80'" in capsys.readouterr().err
    rc = cli(["plan", "search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "H100",
              "--seq-len", "8192", "--gbs-tokens", "1000"])
    assert rc == 2 and "multiple of --seq-len" in capsys.readouterr().err
    rc = cli(["plan", "search", "--model", "llama3.1-405b", "--gpus", "8", "--gpu", "A100-40GB",
              "--seq-len", "8192", "--gbs-tokens", str(M)])
    assert rc == 1 and "no layout" in capsys.readouterr().out


def test_cli_search_takes_the_global_batch_in_sequences(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--gbs (sequences, as `scaletrain plan` takes it) is --gbs-tokens / --seq-len; it used to
    be read as an abbreviation of --gbs-tokens."""
    common = ["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--gpu", "H100",
              "--seq-len", "8192", "--json", "--top", "3"]
    assert cli([*common, "--gbs", str(M // 8192)]) == 0
    by_sequences = json.loads(capsys.readouterr().out)
    assert cli([*common, "--gbs-tokens", str(M)]) == 0
    assert by_sequences == json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cli([*common, "--gbs", "8", "--gbs-tokens", str(M)])
    assert "not allowed with" in capsys.readouterr().err


def test_commands_spell_every_model_override_the_trainer_takes() -> None:
    import dataclasses

    from scaletrain.config_sections import ModelConfig
    from scaletrain.plan.search.command import MODEL_OVERRIDES

    assert set(MODEL_OVERRIDES) == {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}


def test_moe_plan_counts_active_flops_ep_memory_and_all_to_all() -> None:
    from scaletrain.models.args import count_active_params, get_preset
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.flops import attention_forward_flops, flops_per_token
    from scaletrain.plan.layout import Layout

    mixtral = get_preset("mixtral-8x7b")
    # 6 x the active parameters but the embedding lookup (the head multiplies), + attention
    matmul = count_active_params(mixtral) - mixtral.vocab_size * mixtral.dim
    assert flops_per_token(mixtral, 4096) == 6 * matmul + 3 * attention_forward_flops(mixtral,
                                                                                        4096)
    args = get_preset("qwen3-30b-a3b")
    plans = {ep: estimate(args, Layout(dims=ParallelDims(dp_shard=8, ep=ep), mbs=1,
                                       seq_len=4096, gbs=16, zero=3, precision="bf16"))
             for ep in (1, 8)}
    # FSDP shards everything over dp_shard either way; EP gathers only a rank's own experts.
    assert plans[8].memory_bytes["weights"] == plans[1].memory_bytes["weights"]
    assert plans[8].memory_bytes["comm_buffers"] < plans[1].memory_bytes["comm_buffers"] / 3
    assert plans[8].comm_bytes_per_step["all_gather"] < plans[1].comm_bytes_per_step[
        "all_gather"] / 3
    # 4 all-to-alls per MoE layer and micro-batch of tokens x k x dim x 2 bytes, 7/8 leaving
    tokens_k = 4096 * args.n_experts_per_token
    expected = args.n_layers * 2 * 4 * 7 / 8 * tokens_k * args.dim * 2
    assert plans[8].comm_bytes_per_step["all_to_all"] == int(expected)
    assert plans[1].comm_bytes_per_step["all_to_all"] == 0


def test_search_proposes_expert_parallel_degrees_the_trainer_accepts() -> None:
    from scaletrain.models.args import get_preset
    from scaletrain.plan.hardware import get_device
    from scaletrain.plan.layout import Layout
    from scaletrain.plan.search.space import search
    from scaletrain.plan.timing.step_time import Cluster

    args = get_preset("qwen3-30b-a3b").replace(n_layers=8, n_experts=8)
    fitting, _ = search(args, Cluster(get_device("H100"), 16), 4096, 4096 * 64,
                        Layout(precision="bf16"), model="qwen3-30b-a3b")
    eps = {c.layout.dims.ep for c in fitting}
    assert eps > {1} and max(eps) <= 8  # never beyond the number of experts
    for c in fitting:
        d = c.layout.dims
        assert d.dp_shard % d.ep == 0 and (d.ep == 1 or c.layout.zero >= 2)
        assert (f"--parallel.ep {d.ep}" in c.command) == (d.ep > 1)


def test_ep_x_tp_plan_counts_experts_split_over_both() -> None:
    """EP composed with TP (`parallel/ep_tp.py`): a rank gathers 1/(ep x tp) of each layer's
    experts, and sends only its TP share (1/tp) of the routed pairs over EP."""
    from scaletrain.models.args import get_preset
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.parallel.feasibility import layout_problems
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.layout import Layout
    from scaletrain.plan.timing.comm import expert_params

    args = get_preset("qwen3-30b-a3b")
    plans = {ep: estimate(args, Layout(dims=ParallelDims(dp_shard=8, tp=2, ep=ep), mbs=1,
                                       seq_len=4096, gbs=16, zero=3, precision="bf16",
                                       param_dtype="fp32", fsdp_param_dtype="bf16"))
             for ep in (1, 4)}
    assert not layout_problems(args, plans[4].layout.run_layout())  # the trainer runs it
    assert plans[4].memory_bytes["weights"] == plans[1].memory_bytes["weights"]
    # FSDP's buffers: one block gathered, its prefetched successor and its gradients (3 x 2
    # bytes); EP leaves out the 3/4 of the rank's 1/tp of the experts that other ranks hold.
    saved = plans[1].memory_bytes["comm_buffers"] - plans[4].memory_bytes["comm_buffers"]
    assert abs(saved - expert_params(args, 1) / 2 * 3 / 4 * 3 * 2) <= 8
    tokens_k = 4096 * args.n_experts_per_token
    expected = args.n_layers * 2 * 4 * 3 / 4 * tokens_k * args.dim * 2 / 2
    assert plans[4].comm_bytes_per_step["all_to_all"] == int(expected)
    # FSDP's all-gathers (twice per micro-batch under ZeRO-3, 2 micro-batches, bf16): the
    # rank's 1/tp of the experts over the 8 dp_shard ranks without EP; with EP its quarter of
    # them over the dp_shard / ep = 2 ranks that hold the same ones (TP's gathers are equal).
    experts = expert_params(args, args.n_layers) / 2
    fewer = 2 * 2 * 2 * experts * (7 / 8 - 1 / 2 / 4)
    got = plans[1].comm_bytes_per_step["all_gather"] - plans[4].comm_bytes_per_step["all_gather"]
    assert abs(got - fewer) <= 64


def test_search_proposes_ep_x_tp_the_trainer_accepts() -> None:
    from scaletrain.models.args import get_preset
    from scaletrain.parallel.feasibility import layout_problems
    from scaletrain.plan.hardware import get_device
    from scaletrain.plan.layout import Layout
    from scaletrain.plan.search.space import search
    from scaletrain.plan.timing.step_time import Cluster

    args = get_preset("qwen3-30b-a3b").replace(n_layers=8, n_experts=8)
    fitting, rest = search(args, Cluster(get_device("H100"), 16), 4096, 4096 * 64,
                           Layout(precision="bf16"), model="qwen3-30b-a3b")
    both = [c for c in fitting + rest if c.layout.dims.ep > 1 and c.layout.dims.tp > 1]
    assert both
    for c in both:
        d = c.layout.dims
        assert args.n_experts % (d.ep * d.tp) == 0 and d.pp == 1
        assert not layout_problems(args, c.layout.run_layout())
        assert f"--parallel.ep {d.ep}" in c.command and f"--parallel.tp {d.tp}" in c.command


def test_replicated_data_parallel_time_follows_how_the_trainer_reduces() -> None:
    """torch's DDP (ZeRO-0/1, no TP/PP, fp32 parameters) hides every gradient bucket but the
    last behind the last backward; the replicas' path (16-bit parameters, or TP/PP) sums the
    gradients after the backward, all of it exposed (`Parallelism.sync_gradients`)."""
    args = get_preset("llama3.2-1b")
    cluster = Cluster(get_device("H100"), 16)
    fabric = Fabric(cluster.device, 8)
    dims = ParallelDims(dp_replicate=16)

    def exposed(param_dtype: str) -> tuple[float, float, int]:
        lay = Layout(dims=dims, mbs=4, seq_len=4096, gbs=64 * 4, zero=0, precision="bf16",
                     param_dtype=param_dtype)
        plan = estimate(args, lay)
        _, times = step_time(plan, cluster, 4096 * lay.gbs)
        buckets = math.ceil(4.0 * plan.params / DDP_BUCKET_BYTES)
        one = fabric.time("all_reduce", 4.0 * plan.params / buckets, 16, per_node(1, 16, 8))
        return times["dp_comm_exposed"], one, buckets

    ddp, one, buckets = exposed("fp32")
    assert buckets > 1
    # the backward (4 micro-batches' worth of a 1B model) outlasts the all-reduce
    assert ddp == pytest.approx(one + CONTENTION * (buckets - 1) * one)
    replicas, one, buckets = exposed("bf16")
    assert replicas == pytest.approx(buckets * one) and replicas > ddp
