"""Planner arithmetic: parameters, bytes per parameter, ZeRO, Korthikanti, bubbles, CLI."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import main as cli
from scaletrain.models.args import PRESETS, count_params, get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import bubble_fraction, estimate
from scaletrain.plan.hardware import DEVICES, get_device, match_device, peak_tflops
from scaletrain.plan.layout import Layout
from scaletrain.plan.memory import korthikanti
from scaletrain.plan.memory.pipeline import in_flight
from scaletrain.plan.memory.states import (
    model_state_bytes,
    sharded_state,
    stage_params,
    state_bytes,
)

PUBLISHED = {"llama3.2-1b": 1_235_814_400, "llama3-8b": 8_030_261_248,
             "llama3-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800,
             "llama2-7b": 6_738_415_616, "gpt2": 124_439_808}


@pytest.mark.parametrize("name", PUBLISHED)
def test_plan_params_are_the_exact_preset_counts(name: str) -> None:
    args = get_preset(name)
    plan = estimate(args, Layout(seq_len=128))
    assert plan.params == PUBLISHED[name] == count_params(args).total
    assert plan.params_per_rank == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("pp,tp", [(2, 1), (4, 2), (1, 8)])
def test_stages_partition_the_model(name: str, pp: int, tp: int) -> None:
    args = get_preset(name)
    if args.n_heads % tp or args.kv_heads % tp or args.n_layers < pp:
        pytest.skip("layout does not divide this model")
    stages = [stage_params(args, pp, tp, s) for s in range(pp)]
    assert sum(s.layers for s in stages) == args.n_layers
    if tp == 1:
        duplicated = args.vocab_size * args.dim if args.tie_embeddings and pp > 1 else 0
        assert sum(s.total for s in stages) == count_params(args).total + duplicated


@pytest.mark.parametrize("billions,fp32_gb,mixed_gb", [
    (1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)])
def test_ultra_scale_playbook_table(billions: int, fp32_gb: int, mixed_gb: int) -> None:
    n = billions * 1e9
    assert model_state_bytes(n, "fp32", "fp32") / 1e9 == pytest.approx(fp32_gb)
    assert model_state_bytes(n, "bf16", "bf16") / 1e9 == pytest.approx(mixed_gb)
    assert model_state_bytes(n, "bf16", "bf16", grad_convention="megatron") / 1e9 == \
        pytest.approx(18 * billions)


def test_zero_stages_divide_optimizer_then_gradients_then_weights() -> None:
    per = state_bytes("bf16", "bf16")
    p, n = 1000, 8
    z = [sharded_state(per, p, stage, n) for stage in range(4)]
    assert z[0] == {"weights": 2000, "gradients": 6000, "master_weights": 4000,
                    "optimizer": 8000}
    assert z[1] == {**z[0], "master_weights": 500, "optimizer": 1000}
    assert z[2] == {**z[1], "gradients": 750}
    assert z[3] == {**z[2], "weights": 250}
    # the ZeRO paper's setup: 16-bit parameters with fp32 masters (the trainer's default is fp32)
    plan = estimate(get_preset("llama3-8b"), Layout(
        dims=ParallelDims(dp_shard=8), seq_len=2048, zero=3, gbs=8, param_dtype="bf16"))
    assert plan.memory_bytes["optimizer"] == pytest.approx(8 * PUBLISHED["llama3-8b"] / 8, 1)
    assert plan.memory_bytes["master_weights"] == pytest.approx(4 * PUBLISHED["llama3-8b"] / 8, 1)
    with pytest.raises(ValueError, match="ZeRO stage"):
        sharded_state(per, p, 4, n)


def test_korthikanti_formulas_on_gpt3_shapes() -> None:
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B, micro-batch 1, TP 8
    plain = korthikanti.layer_bytes(s, b, h, a)
    assert plain == s * b * h * (34 + 5 * a * s / h)
    tp = korthikanti.layer_bytes(s, b, h, a, t)
    assert tp == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = korthikanti.layer_bytes(s, b, h, a, t, sequence_parallel=True)
    assert sp == pytest.approx(plain / t)
    assert korthikanti.layer_bytes(s, b, h, a, t, True, "selective") == \
        pytest.approx(34 * s * b * h / t)
    assert korthikanti.layer_bytes(s, b, h, a, recompute="full") == 2 * s * b * h
    # 1F1B: the first stage holds L layers whatever p; interleaving adds (p-1)/(p m)
    assert korthikanti.first_stage_bytes(96, sp, pp=8) == 96 * sp
    assert korthikanti.first_stage_bytes(96, sp, pp=8, interleave=4) == \
        pytest.approx(96 * sp * (1 + 7 / 32))


def test_bubble_and_in_flight_formulas() -> None:
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, vpp=2) == pytest.approx(3 / 16)
    assert in_flight(4, 0, 16, 1, "1F1B") == 4 and in_flight(4, 3, 16, 1, "1F1B") == 1
    assert in_flight(4, 0, 2, 1, "1F1B") == 2
    assert in_flight(4, 0, 16, 1, "GPipe") == 16
    # Megatron's interleaved warm-up equals Korthikanti's factor p (1 + (p-1)/(p v)).
    p, v = 8, 4
    assert in_flight(p, 0, 64, v, "Interleaved1F1B") == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_recompute_trades_activations_for_flops() -> None:
    args = get_preset("llama3-8b")
    base = Layout(seq_len=4096, mbs=1)
    none, full = estimate(args, base), estimate(args, base.replace(recompute="full"))
    assert full.memory_bytes["activations"] < none.memory_bytes["activations"] / 5
    assert none.hardware_flops_per_token == none.flops_per_token
    assert full.hardware_flops_per_token / full.flops_per_token == pytest.approx(4 / 3, rel=0.03)


def test_tensor_and_context_parallel_shrink_activations_and_communicate() -> None:
    args = get_preset("llama3-70b")
    one = estimate(args, Layout(seq_len=8192, gbs=8))
    tp = estimate(args, Layout(dims=ParallelDims(tp=8), seq_len=8192, gbs=8))
    cp = estimate(args, Layout(dims=ParallelDims(tp=8, cp=2, dp_shard=1), seq_len=8192, gbs=8))
    assert tp.memory_bytes["activations"] < one.memory_bytes["activations"] / 4
    assert cp.memory_bytes["activations"] < tp.memory_bytes["activations"]
    assert tp.comm_bytes_by_dim["tp"] > 0 and one.comm_bytes_per_step["all_reduce"] == 0
    assert cp.comm_bytes_by_dim["cp"] > 0


def test_device_table_and_peak_lookup() -> None:
    for name in ("A100-40GB", "A100-80GB", "H100", "H200", "B200"):
        dev = get_device(name)
        assert dev in DEVICES.values()
        assert dev.memory_gib > 0 and dev.peak_tflops["bf16"] > 0
        assert dev.intra_node_gbs > dev.inter_node_gbs > 0
    assert match_device("NVIDIA A100-SXM4-40GB") is get_device("A100-40GB")
    assert match_device("NVIDIA A100-SXM4-80GB") is get_device("A100-80GB")
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA L40S", "bf16") == 362.0
    assert peak_tflops("cpu", "fp32") is None
    with pytest.raises(ValueError, match="unknown GPU 'H900'. Did you mean 'H200'"):
        get_device("H900")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--model", "llama3-8b", "--seq-len", "4096", "--mbs", "1",
                      "--dp", "8", "--zero", "1", "--gbs", "64", "--gpu", "H100", "--json")
    assert rc == 0
    data = json.loads(out)
    for key in ("params", "params_per_rank", "flops_per_token", "memory_bytes",
                "bubble_fraction", "comm_bytes_per_step"):
        assert key in data
    mem = data["memory_bytes"]
    assert set(mem) >= {"weights", "gradients", "master_weights", "optimizer", "activations",
                        "total"}
    assert mem["total"] == sum(v for k, v in mem.items() if k not in ("total", "peak"))
    assert max(mem["weights"] + mem["optimizer"] + mem["gradients"], mem["activations"]) \
        < mem["peak"] <= mem["total"]  # equal under accumulation: gradients live in forward
    assert data["device"]["name"] == "H100-SXM"


@pytest.mark.parametrize("argv,message", [
    (["--tp", "3"], "n_heads (32) must be divisible by parallel.tp (3)"),
    (["--gpu", "H900"], "unknown GPU 'H900'"),
    (["--gbs", "7", "--dp", "2"], "must be divisible by micro-batch x data parallel"),
    (["--set", "model.colour=red"], "expected model.FIELD=VALUE"),
])
def test_cli_bad_inputs(capsys: pytest.CaptureFixture[str], argv: list[str],
                        message: str) -> None:
    rc, _, err = _run(capsys, "plan", "--model", "llama3-8b", "--seq-len", "4096", "--mbs",
                      "1", *argv)
    assert rc == 2 and message in err


def test_cli_method_covers_fine_tuning(capsys: pytest.CaptureFixture[str]) -> None:
    from scaletrain.plan.finetune.estimate import estimate as ft_estimate

    base = ["plan", "--model", "llama3.2-1b", "--seq-len", "1024", "--mbs", "1", "--json",
            "--precision", "bf16", "--param-dtype", "bf16"]
    # without --gpu, auto is this machine's (fp32 on most CPUs); bf16 parameters (the trainer's
    # default is fp32) so the frozen weights and the residual stream are 2 bytes

    def mem(*extra: str) -> dict:
        rc, out, err = _run(capsys, *base, *extra)
        assert rc == 0, err
        return json.loads(out)

    pre, full = mem(), mem("--method", "full")
    assert full["memory_bytes"] == pre["memory_bytes"]  # full fine-tuning = pretraining states
    lora, qlora = mem("--method", "lora", "--lora-rank", "16"), mem("--method", "qlora")
    want = ft_estimate(get_preset("llama3.2-1b"), "lora", rank=16)
    assert lora["finetune"]["trainable"] == want.trainable
    assert lora["memory_bytes"]["weights"] == want.total * 2  # bf16 weights
    assert lora["memory_bytes"]["optimizer"] == want.trainable * 8  # two fp32 AdamW moments
    # LoRA keeps what pretraining keeps except the token ids (frozen embedding), the frozen
    # first norm's input and rstd (nothing needs its gradient), the frozen head's input, and
    # adds x A^T (rank 16) for each of the 7 adapted linears of the 16 blocks (bf16: c = 2).
    t, h = 1024, 2048
    assert lora["memory_bytes"]["activations"] == pre["memory_bytes"]["activations"] - 8 * t \
        - (2 * t * h + 4 * t) - 2 * t * h + 16 * 7 * 2 * t * 16
    assert lora["memory_bytes"]["logits_loss"] == pre["memory_bytes"]["logits_loss"]
    classify = mem("--method", "lora", "--lora-rank", "16", "--num-labels", "3")
    assert classify["memory_bytes"]["logits_loss"] == (2 + 8) * 1 * 3  # (batch, labels)
    assert classify["activation_bytes"]["loss"] == 4 * 3 + 8 + 4
    assert qlora["memory_bytes"]["weights"] < lora["memory_bytes"]["weights"] / 2
    frozen = mem("--method", "freeze", "--train-last", "2")
    assert lora["memory_bytes"]["total"] < frozen["memory_bytes"]["total"] \
        < full["memory_bytes"]["total"]
    # Data-parallel fine-tuning is DDP by default (as the trainer runs it; pretraining's default
    # is ZeRO-3): replicated states, and only the trainable gradients all-reduced ...
    ddp_pre = mem("--dp", "2", "--zero", "0")
    ddp_lora = mem("--method", "lora", "--lora-rank", "16", "--dp", "2")
    assert (ddp_lora["layout"]["zero"], mem("--dp", "2")["layout"]["zero"]) == (0, 3)
    assert ddp_lora["memory_bytes"]["optimizer"] == lora["memory_bytes"]["optimizer"]
    share = want.trainable / pre["params"]
    assert ddp_lora["comm_bytes_per_step"]["all_reduce"] == \
        int(ddp_pre["comm_bytes_per_step"]["all_reduce"] * share) > 0
    # ... or FSDP (ZeRO-2/3): every weight sharded, frozen ones too, and the trainable states;
    # every weight gathered, only the trainable gradients reduce-scattered.
    fsdp_pre = mem("--dp", "2", "--zero", "3")
    fsdp_lora = mem("--method", "lora", "--lora-rank", "16", "--dp", "2", "--zero", "3")
    # (bf16 parameters: the frozen shards are bf16, the trainable ones fp32 masters)
    assert fsdp_lora["memory_bytes"]["weights"] == (want.total - want.trainable) * 2 // 2
    assert fsdp_lora["memory_bytes"]["master_weights"] == want.trainable * 4 // 2
    assert fsdp_lora["memory_bytes"]["optimizer"] == lora["memory_bytes"]["optimizer"] // 2
    comm, pre_comm = fsdp_lora["comm_bytes_per_step"], fsdp_pre["comm_bytes_per_step"]
    assert comm["all_gather"] == pre_comm["all_gather"] > 0
    assert comm["reduce_scatter"] == int(pre_comm["reduce_scatter"] * share) > 0
    # ... and tensor parallel: weights and LoRA adapters split with their base.
    tp_lora = mem("--method", "lora", "--lora-rank", "16", "--tp", "2")
    assert lora["memory_bytes"]["weights"] / 2 < tp_lora["memory_bytes"]["weights"] \
        < 0.51 * lora["memory_bytes"]["weights"]
    assert lora["memory_bytes"]["optimizer"] / 2 < tp_lora["memory_bytes"]["optimizer"] \
        < lora["memory_bytes"]["optimizer"]
    for bad, message in ((("--method", "lora", "--cp", "2"), "pipeline, context and expert"),
                         (("--method", "lora", "--dp", "2", "--zero", "1"), "DDP or FSDP"),
                         (("--method", "qlora", "--dp", "2", "--tp", "2"),
                          "qlora shards its 4-bit base with FSDP"),
                         (("--method", "lora", "--tp", "2", "--num-labels", "3"),
                          "classification under tensor parallelism")):
        rc, _, err = _run(capsys, *base, *bad)
        assert rc == 2 and message in err


def test_cli_negative_size_and_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli(["plan", "--model", "llama3-8b", "--seq-len", "-4", "--mbs", "1"])
    assert e.value.code == 2
    assert "must be a positive integer (got -4)" in capsys.readouterr().err
    rc, _, err = _run(capsys, "plan", "--model", "llama9", "--seq-len", "8", "--mbs", "1")
    assert rc == 2 and "unknown model preset 'llama9'" in err


def test_train_dry_run_prints_the_plan_and_builds_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out_dir = tmp_path / "run"
    rc = cli(["train", "--dry-run", "--output", str(out_dir), "--training.device", "cpu",
              "--activation_checkpoint.mode", "full"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "parameters: 7,342,336 total" in out and "recompute=full" in out
    assert "fits" in out and "activations" in out
    assert not out_dir.exists()


def test_profiler_oom_summary_finds_the_config_estimate() -> None:
    from scaletrain.config import load_config
    from scaletrain.profiling.capture import plan_estimate

    cfg = load_config(["--training.device", "cpu"])
    est = plan_estimate(cfg)
    assert est is not None and est["params"] == 7_342_336
    assert est["memory_bytes"]["total"] > est["memory_bytes"]["activations"] > 0
