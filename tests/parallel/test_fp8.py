"""precision.fp8: where it is refused (device, dtype, torchao missing, layouts) and the metric
alongside MFU. Training and parity: tests/parallel/distributed/test_fp8_parity.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from scaletrain.models.args import ModelArgs
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.feasibility import RunLayout, layout_problems
from scaletrain.parallel.fp8 import apply_fp8, fp8_problem

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao not installed (pip install 'scaletrain[fp8]')")
CPU = torch.device("cpu")


@needs_torchao
def test_fp8_runs_on_cpu_and_sm89_and_is_refused_elsewhere(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    assert fp8_problem("none", torch.device("mps"), "fp16") is None
    for mode in ("tensorwise", "rowwise"):
        assert fp8_problem(mode, CPU, "bf16") is None
        assert fp8_problem(mode, CPU, "fp32") is None
        assert "precision.dtype bf16" in fp8_problem(mode, CPU, "fp16")
        assert "mps" in fp8_problem(mode, torch.device("mps"), "bf16")
    assert "one of" in fp8_problem("blockwise", CPU, "bf16")
    # CUDA: compute capability 8.9 (Ada) and newer run; an A100 (8.0) is refused.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    problem = fp8_problem("tensorwise", torch.device("cuda"), "bf16")
    assert "8.9" in problem and "A100" in problem and "8.0" in problem
    for cap in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_, c=cap: c)
        assert fp8_problem("rowwise", torch.device("cuda"), "bf16") is None
    # torchao missing: the install line.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    assert "pip install 'scaletrain[fp8]'" in fp8_problem("rowwise", CPU, "bf16")


def test_fp8_layout_refusals() -> None:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                     n_experts=4, n_experts_per_token=2, moe_ffn_dim=64)

    def problems(fp8: str, **kw: object) -> list[str]:
        dims = ParallelDims.resolve(2, **{k: kw.pop(k) for k in ("ep", "tp", "pp") if k in kw})
        return [p for p in layout_problems(args, RunLayout(dims=dims, mode=str(kw.pop("mode")),
                                                           seq_len=32, grad_accum=2, fp8=fp8,
                                                           **kw))
                if "fp8" in p]

    for mode in ("ddp", "zero1", "zero2", "zero3"):
        assert problems("tensorwise", mode=mode) == []
    assert problems("rowwise", mode="zero3", pp=2) == []
    assert "cpu_offload" in problems("tensorwise", mode="zero3", cpu_offload=True)[0]
    assert problems("none", mode="zero3", cpu_offload=True) == []
    assert "parallel.ep" in problems("rowwise", mode="zero3", ep=2)[0]


@needs_torchao
def test_apply_fp8_converts_blocks_not_head_or_router() -> None:
    from torchao.float8.float8_linear import Float8Linear

    from scaletrain.models.transformer import Transformer

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                     ffn_dim=128, n_experts=16, n_experts_per_token=2, moe_ffn_dim=64,
                     n_shared_experts=1)
    with torch.device("meta"):
        model = Transformer(args)
    names = {n for n, _ in model.named_parameters()}
    n = apply_fp8(model, "tensorwise", CPU, fsdp=True)
    fp8 = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert n == len(fp8) == 2 * (4 + 3)  # q, k, v, o and the shared expert's w1, w2, w3
    assert not any(k.endswith(("output", "gate")) for k in fp8)
    # Parameter names are unchanged: initialization and checkpoints see the same model.
    assert {name for name, _ in model.named_parameters()} == names


def test_step_metrics_report_the_fp8_peak_alongside(tmp_path: Path) -> None:
    from scaletrain.plan.hardware import peak_tflops
    from scaletrain.train.metrics import MemoryBaseline, step_metrics

    bf16, fp8 = peak_tflops("H100-SXM", "bf16") * 1e12, peak_tflops("H100-SXM", "fp8") * 1e12
    m = step_metrics(step=1, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=1000, step_time_s=1.0,
                     data_wait_s=0.0, world_size=1, flops_per_token=bf16 / 2000,
                     peak_flops=bf16, baseline=MemoryBaseline(CPU), peak_flops_fp8=fp8)
    assert m.mfu == pytest.approx(0.5) and m.mfu_fp8 == pytest.approx(0.5 * 989 / 1979)


def test_dry_run_plan_reports_the_fp8_layout_refusal(tmp_path: Path) -> None:
    """`train --dry-run` asks the same feasibility check: precision.fp8 reaches it."""
    from scaletrain.plan.from_config import layout_from_config
    from scaletrain.plan.layout import trainer_problems
    from tests.helpers.trainer import tiny_config

    cfg = tiny_config(tmp_path / "o", tmp_path / "c", "--precision.fp8", "tensorwise",
                      "--parallel.data_parallel", "zero3", "--parallel.cpu_offload", "true")
    lay = layout_from_config(cfg, CPU, 2)
    assert lay.fp8 == "tensorwise"
    assert any("precision.fp8" in p for p in trainer_problems(cfg.model.to_model_args(), lay))


def test_lora_fine_tuning_refuses_fp8(tmp_path: Path) -> None:
    """LoRA wraps the base linears with adapters: fp8 is refused there, not ignored (full and
    freeze fine-tuning run it: tests/finetune/test_finetune_train.py)."""
    from scaletrain.config import ConfigError, load_config
    from scaletrain.finetune.trainer import FinetuneTrainer

    cfg = load_config(["--output", str(tmp_path), "--finetune.base", str(tmp_path / "base"),
                       "--finetune.data", str(tmp_path / "d.jsonl"), "--precision.fp8",
                       "rowwise", "--finetune.method", "lora"], prog="scaletrain finetune")
    with pytest.raises(ConfigError, match="use fp8 with --method full or freeze"):
        FinetuneTrainer(cfg)


@needs_torchao
def test_trainer_mfu_peaks_with_fp8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MFU against the bf16 peak (whatever the autocast dtype), the fp8 peak alongside; both
    absent from a run without fp8 keeps its dtype's peak and no fp8 one."""
    from scaletrain.train import trainer as trainer_mod
    from tests.helpers.trainer import tiny_config

    monkeypatch.setattr(trainer_mod, "device_name", lambda _: "H100-SXM")
    t = trainer_mod.Trainer(tiny_config(tmp_path / "a", tmp_path / "c", "--precision.fp8",
                                        "tensorwise"))  # fp32 autocast in the tiny config
    assert (t.peak_flops, t.peak_flops_fp8) == (989e12, 1979e12)
    plain = trainer_mod.Trainer(tiny_config(tmp_path / "b", tmp_path / "c"))
    assert (plain.peak_flops, plain.peak_flops_fp8) == (67e12, None)
