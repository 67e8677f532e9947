"""16-bit parameters accumulate their gradients in fp32 (Megatron's main_grad): the step's
gradient is the fp32 sum of the micro-batches' bf16 gradients, not their bf16 sum."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scaletrain.train import precision
from scaletrain.train.loss import count_valid, cross_entropy_sum
from scaletrain.train.trainer import Trainer
from tests.helpers.trainer import tiny_config

BF16 = ("--precision.dtype", "bf16", "--precision.param_dtype", "bf16")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


def _micro_batch_grads(t: Trainer, batches: list[Any]) -> list[list[torch.Tensor]]:
    """Each micro-batch's bf16 gradients, computed apart from the step (autograd.grad does not
    accumulate into .grad, so the optimizer's hooks stay out of it)."""
    params = t.optimizer.params
    n_valid = torch.tensor(float(sum(count_valid(y) for _, y in batches))).clamp(min=1)
    out = []
    for x, y in batches:
        with precision.autocast(t.device, t.dtype):
            logits = t.model(x)
        loss = cross_entropy_sum(logits, y) / n_valid
        out.append([g.detach() for g in torch.autograd.grad(loss, params)])
    return out


def test_accumulation_sums_bf16_gradients_in_fp32(tmp_path: Path, cache: Path) -> None:
    t = Trainer(tiny_config(tmp_path / "r", cache, *BF16, "--training.grad_accum_steps", "4",
                            "--training.micro_batch_size", "2",
                            "--training.max_grad_norm", "0"))
    assert all(p.dtype == torch.bfloat16 for p in t.optimizer.params)
    batches = t.next_batches()
    per_micro = _micro_batch_grads(t, batches)
    fp32_sum = [sum((g[i].float() for g in per_micro[1:]), per_micro[0][i].float())
                for i in range(len(t.optimizer.params))]
    bf16_sum = [sum((g[i] for g in per_micro[1:]), per_micro[0][i])
                for i in range(len(t.optimizer.params))]
    assert all(g.dtype == torch.bfloat16 for g in bf16_sum)

    seen: list[torch.Tensor] = []
    inner_step = t.optimizer.inner.step

    def capture(*a: Any, **k: Any) -> Any:
        seen.extend(m.grad.clone() for m in t.optimizer.masters)
        return inner_step(*a, **k)

    t.optimizer.inner.step = capture
    t.step_fn(batches)
    assert len(seen) == len(fp32_sum)
    for got, want in zip(seen, fp32_sum, strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)  # the same sums, in the same order: bitwise
    # bf16 summation loses bits here: most entries differ from the fp32 sum, by far more than
    # fp32 rounding (bf16 keeps 8 significant bits).
    differ = sum(int((b.float() != f).sum()) for b, f in zip(bf16_sum, fp32_sum, strict=True))
    total = sum(f.numel() for f in fp32_sum)
    rel = max(float(((b.float() - f).abs() / f.abs().clamp(min=1e-12)).max())
              for b, f in zip(bf16_sum, fp32_sum, strict=True))
    assert differ > total // 10, (differ, total)
    assert rel > 1e-3
    # The 16-bit gradients were freed once added into the fp32 buffers, and the step cleared
    # the buffers.
    assert all(p.grad is None for p in t.optimizer.params)
    assert all(m.grad is None for m in t.optimizer.masters)


def test_bf16_parameters_train_like_fp32_parameters(tmp_path: Path, cache: Path) -> None:
    """A short run with bf16 parameters (fp32 accumulation, clipping on) stays within bf16
    noise of the same run with fp32 parameters under bf16 autocast."""
    argv = ("--training.steps", "6", "--training.grad_accum_steps", "4",
            "--training.micro_batch_size", "2", "--optimizer.lr", "3e-3")
    ref = Trainer(tiny_config(tmp_path / "a", cache, "--precision.dtype", "bf16", *argv)).train()
    run = Trainer(tiny_config(tmp_path / "b", cache, *BF16, *argv)).train()
    assert run.losses[-1] < run.losses[0]
    assert run.losses == pytest.approx(ref.losses, abs=3e-2)


def test_plan_counts_the_fp32_gradient_buffers(tmp_path: Path) -> None:
    """`train --dry-run` plans what runs: 4 B of fp32 gradient per parameter on the device with
    bf16 parameters (fp32 sums in host memory with optimizer.offload: 2 B in flight)."""
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.from_config import layout_from_config

    for extra, conv, grad_bytes in (((), "megatron", 4), (("--optimizer.offload", "true"),
                                                          "bf16", 2)):
        cfg = tiny_config(tmp_path, tmp_path / "cache", *BF16, *extra)
        lay = layout_from_config(cfg, torch.device("cpu"), 1)
        assert lay.grad_convention == conv
        plan = estimate(cfg.model.to_model_args(), lay)
        assert plan.memory_bytes["gradients"] == pytest.approx(grad_bytes * plan.params, rel=1e-3)
