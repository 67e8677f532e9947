"""Across the seam: `scaletrain plan` with only a layout given plans the memory `scaletrain train
--dry-run` plans for the same layout with no other flag (issue 33: `plan` planned 16-bit
parameters with fp32 masters, DDP for `--dp N` and no sequence parallelism where `train` runs
autocast over fp32 parameters, ZeRO-3 and sequence-parallel TP by default).

The two sides share no argument handling: `plan` fills what is not given from the trainer's
default config (`commands/plan.py`), the dry run reads the config tyro parsed
(`plan/from_config.py`). No flag names the device either: `--kernels auto` (the default) plans
the device the dry run plans on this machine, as the trainer resolves `training.device` (on a
CPU: its kernels and the process's own memory); every setting is left to defaults, and precision
`auto` resolves on this machine on both sides. The `bf16` cases fix the autocast
dtype on both sides (the same flag), so the parameter dtype is checked even on a CPU without
bf16, where `auto` is fp32.
"""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import main as cli

# (plan's layout flags, train's layout flags, world size): the same layout spelled each way
LAYOUTS = {
    "1 rank": ([], [], 1),
    "2 ranks (ZeRO-3, auto)": (["--dp", "2"], [], 2),
    "DDP x 2": (["--dp", "2", "--zero", "0"], ["--parallel.dp_replicate", "2"], 2),
    "TP 2 x DP 2": (["--tp", "2", "--dp", "2"], ["--parallel.tp", "2"], 4),
    "PP 2 (GPipe)": (["--pp", "2", "--schedule", "GPipe"],
                     ["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe"], 2),
}
PRECISIONS = {"auto": ([], []), "bf16": (["--precision", "bf16"],
                                         ["--precision.dtype", "bf16"])}


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], ok: tuple[int, ...]) -> dict:
    rc = cli(argv)
    out = capsys.readouterr()
    assert rc in ok, (argv, out.err)
    return json.loads(out.out)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["debug", "llama3.2-1b", "debug-moe"])
def test_plan_defaults_equal_the_dry_run(model: str, layout: str, precision: str,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plan_flags, train_flags, world = LAYOUTS[layout]
    plan_prec, train_prec = PRECISIONS[precision]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dry = _json(capsys, ["train", "--dry-run", "--json", "--model.name", model, *train_flags,
                         *train_prec], ok=(0, 2, 3))
    plan = _json(capsys, ["plan", "--model", model, "--json", *plan_flags,
                          *plan_prec], ok=(0,))
    assert plan["params"] == dry["params"]
    for key in ("precision", "param_dtype", "zero", "data_parallel", "sequence_parallel",
                "optimizer", "grad_convention", "fsdp_param_dtype", "ga", "mbs", "seq_len",
                "schedule", "recompute"):
        assert plan["layout"][key] == dry["layout"][key], key
    assert plan["memory_bytes"] == dry["memory_bytes"]
    assert plan["trainer_problems"] == dry["trainer_problems"]


def test_the_default_is_not_the_zero_table_setup(capsys: pytest.CaptureFixture[str]) -> None:
    """The check above can fail: the ZeRO tables' 16-bit parameters are an explicit choice, and
    they plan other bytes than the default."""
    base = ["plan", "--model", "llama3.2-1b", "--dp", "2", "--zero", "1", "--precision",
            "bf16", "--json"]
    default = _json(capsys, base, ok=(0,))
    zero_table = _json(capsys, [*base, "--param-dtype", "bf16"], ok=(0,))
    assert default["layout"]["param_dtype"] == "fp32"
    assert zero_table["layout"]["param_dtype"] == "bf16"
    n = default["params_per_rank"]
    assert default["memory_bytes"]["weights"] == 4 * n
    assert zero_table["memory_bytes"]["weights"] == 2 * n
    assert zero_table["memory_bytes"]["master_weights"] == 4 * n // 2


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
             "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _hf_base_under_torchrun(path, world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real (tiny) HF base and SFT data in `path` (the dry run reads no weights, but checks
    their names and shapes), and `world` ranks as torchrun would set them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in HF_CONFIG.items()
                                         if k not in ("architectures", "model_type")})
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    (path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("world", [1, 2])
def test_plan_method_defaults_equal_the_finetune_dry_run(
        method: str, world: int, tmp_path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan --method M` plans what `finetune --finetune.method M` runs by default (its own
    preset; data parallelism is DDP there, not pretraining's ZeRO-3)."""
    _hf_base_under_torchrun(tmp_path, world, monkeypatch)
    dry = _json(capsys, ["finetune", "--dry-run", "--json", "--base", str(tmp_path),
                         "--finetune.data", str(tmp_path / "sft.jsonl"),
                         "--finetune.method", method], ok=(0, 3))
    plan = _json(capsys, ["plan", "--model", str(tmp_path), "--method", method, "--dp",
                          str(world), "--json"], ok=(0,))
    assert plan["layout"]["zero"] == dry["layout"]["zero"] == 0
    assert plan["finetune"]["trainable"] == dry["finetune"]["trainable"]
    assert plan["memory_bytes"] == dry["memory_bytes"]


@pytest.mark.parametrize(("method", "world"), [("lora", 1), ("full", 2)])
def test_plan_fused_loss_equals_the_finetune_dry_run(
        method: str, world: int, tmp_path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan --method M --fused-loss --loss-chunk N` plans what `finetune` runs with
    `training.fused_loss` (no logits kept, one chunk's buffers), and keeps less than the
    logits path."""
    _hf_base_under_torchrun(tmp_path, world, monkeypatch)
    base = ["finetune", "--dry-run", "--json", "--base", str(tmp_path), "--finetune.data",
            str(tmp_path / "sft.jsonl"), "--finetune.method", method]
    dry = _json(capsys, [*base, "--training.fused_loss", "true",
                         "--training.loss_chunk_tokens", "64"], ok=(0, 3))
    plan_argv = ["plan", "--model", str(tmp_path), "--method", method, "--kernels", "cpu",
                 "--dp", str(world), "--json"]
    plan = _json(capsys, [*plan_argv, "--fused-loss", "--loss-chunk", "64"], ok=(0,))
    assert plan["memory_bytes"] == dry["memory_bytes"]
    assert plan["activation_bytes"] == dry["activation_bytes"]
    plain = _json(capsys, plan_argv, ok=(0,))
    for key in ("activations", "logits_loss"):
        assert plan["memory_bytes"][key] < plain["memory_bytes"][key], key
    # a classification head has no vocabulary logits: refused by both, in one line
    assert cli([*plan_argv, "--fused-loss", "--num-labels", "3"]) == 2
    assert "--task classification" in capsys.readouterr().err


@pytest.mark.parametrize("param_dtype", ["default", "bf16"])
def test_search_commands_carry_the_parameter_dtype_they_plan(
        param_dtype: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every proposal's command spells out the parameter dtype (and optimizer) it was planned
    with, so its dry run plans the proposal's memory, for the default and for the ZeRO tables'
    16-bit parameters alike."""
    import shlex

    extra = [] if param_dtype == "default" else ["--param-dtype", "bf16"]
    proposals = _json(capsys, ["plan", "search", "--model", "debug", "--gpus", "2", "--gpu",
                               "cpu", "--gbs", "8", "--precision", "bf16", "--top", "3",
                               "--json", *extra], ok=(0,))
    assert proposals
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    want = "fp32" if param_dtype == "default" else "bf16"
    for c in proposals:
        argv = shlex.split(c["command"])
        flags = argv[argv.index("train") + 1:]
        assert flags[flags.index("--precision.param_dtype") + 1] == want
        assert "--optimizer.name" in flags
        dry = _json(capsys, ["train", *flags, "--dry-run", "--json"], ok=(0, 3))
        assert dry["layout"]["param_dtype"] == want
        assert c["memory_bytes_per_gpu"] == dry["memory_bytes"]["peak"], c["command"]


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("layout", ["1 rank", "DDP x 2", "ZeRO-3 x 2"])
def test_plan_method_bf16_params_equal_the_finetune_dry_run(
        method: str, layout: str, tmp_path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With `--param-dtype bf16` (`precision.param_dtype bf16`) both sides plan the frozen base
    in bf16 (2 bytes, no master) and the trainable parameters with fp32 masters, in every
    layout (`tests/finetune/distributed/test_finetune_bf16_frozen.py` measures the trainer's
    bytes)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in HF_CONFIG.items()
                                         if k not in ("architectures", "model_type")})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    world, zero = {"1 rank": (1, "0"), "DDP x 2": (2, "0"), "ZeRO-3 x 2": (2, "3")}[layout]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dry = _json(capsys, ["finetune", "--dry-run", "--json", "--base", str(tmp_path),
                         "--finetune.data", str(tmp_path / "sft.jsonl"),
                         "--finetune.method", method, "--precision.dtype", "bf16",
                         "--precision.param_dtype", "bf16", "--parallel.data_parallel",
                         "zero3" if zero == "3" else "ddp"], ok=(0, 3))
    plan = _json(capsys, ["plan", "--model", str(tmp_path), "--method", method, "--kernels",
                          "cpu", "--dp", str(world), "--zero", zero, "--precision", "bf16",
                          "--param-dtype", "bf16", "--json"], ok=(0,))
    assert plan["layout"]["param_dtype"] == dry["layout"]["param_dtype"] == "bf16"
    assert plan["memory_bytes"] == dry["memory_bytes"]
    mem, ft = plan["memory_bytes"], plan["finetune"]
    shard = 2 if zero == "3" else 1
    frozen = ft["total"] - ft["trainable"]
    # frozen 2 bytes; trainable: fp32 shards (FSDP) or bf16 weights + fp32 masters
    assert mem["weights"] == (2 * frozen + (0 if zero == "3" else 2 * ft["trainable"])) // shard
    assert mem["master_weights"] == 4 * ft["trainable"] // shard
