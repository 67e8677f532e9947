"""Fast paths: the chunked linear + cross-entropy equals the plain head + loss (loss and gradients,
fp32); precision.fp8 refused where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import Transformer
from scaletrain.train.chunked_loss import chunked_linear_cross_entropy
from scaletrain.train.loss import IGNORE_INDEX, cross_entropy_sum
from scaletrain.train.trainer import Trainer, fused_loss_problem
from tests.helpers.proc import scaled
from tests.helpers.trainer import tiny_config


def _plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
           cap: float | None) -> torch.Tensor:
    logits = h @ w.t()
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return cross_entropy_sum(logits, y)


@pytest.mark.parametrize("cap", [None, 30.0, 0.5])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_equals_plain_loss_and_gradients(cap: float | None, chunk: int) -> None:
    torch.manual_seed(0)
    h = torch.randn(3, 11, 16, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(50, 16).requires_grad_()
    y = torch.randint(0, 50, (3, 11))
    y[0, :4] = IGNORE_INDEX
    y[2, -1] = IGNORE_INDEX
    ref = _plain(h, w, y, cap)
    gh_ref, gw_ref = torch.autograd.grad(ref * 0.37, (h, w))
    out = chunked_linear_cross_entropy(h, w, y, chunk=chunk, softcap=cap)
    gh, gw = torch.autograd.grad(out * 0.37, (h, w))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-6, atol=1e-6)


def test_all_ignored_is_zero_with_zero_gradients() -> None:
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    y = torch.full((4,), IGNORE_INDEX)
    out = chunked_linear_cross_entropy(h, w, y, chunk=3)
    out.backward()
    assert out.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_tied_model_head_matches_model_logits() -> None:
    """Through a tied-embedding model with Gemma 2's final soft-cap: the same loss and the same
    gradient on every parameter (the tied weight receives embedding + head gradients)."""
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97,
                     multiple_of=16, max_seq_len=16, tie_embeddings=True, final_softcap=5.0)
    model = Transformer(args)
    x = torch.randint(0, 97, (2, 9))
    y = torch.randint(0, 97, (2, 9))
    y[1, :3] = IGNORE_INDEX
    ref = cross_entropy_sum(model(x), y)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    out = chunked_linear_cross_entropy(model.hidden_states(x), model.output.weight, y, chunk=5,
                                       softcap=args.final_softcap)
    grads = torch.autograd.grad(out, list(model.parameters()))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_close_to_plain() -> None:
    torch.manual_seed(0)
    h = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (20,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = cross_entropy_sum(torch.nn.functional.linear(h, w), y)
        out = chunked_linear_cross_entropy(h, w, y, chunk=6)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    g_ref = torch.autograd.grad(ref, (h, w))
    g = torch.autograd.grad(out, (h, w))
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def _capture_grads(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    seen: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step
    names = {id(p): n for n, p in trainer.model.named_parameters()}

    def recording_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({names[id(p)]: p.grad.clone() for p in trainer.model.parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step  # type: ignore[method-assign]
    return seen


def _plain_and_fused(tmp_path: Path, *extra: str) -> tuple[Trainer, Trainer]:
    """Two trainers on the same data and flags (micro-batch 2, fp32), the second with
    `training.fused_loss` in chunks of 5 tokens."""
    cache = tmp_path / "cache"
    common = ("--training.micro_batch_size", "2", "--precision.dtype", "fp32", *extra)
    plain = Trainer(tiny_config(tmp_path / "a", cache, *common))
    fused = Trainer(tiny_config(tmp_path / "b", cache, *common, "--training.fused_loss", "true",
                                "--training.loss_chunk_tokens", "5"))
    return plain, fused


def test_training_step_with_fused_loss_equals_plain(tmp_path: Path) -> None:
    """Two steps with grad accumulation 2 and the default clipping: the same losses, gradient
    norms and (clipped) gradients the optimizer sees with `training.fused_loss` as without."""
    plain, fused = _plain_and_fused(tmp_path, "--training.grad_accum_steps", "2")
    grads_p, grads_f = _capture_grads(plain), _capture_grads(fused)
    for _ in range(2):
        batches = plain.next_batches()
        y0 = batches[0][1].clone()
        y0[0, :3] = IGNORE_INDEX
        batches = [(batches[0][0], y0), *batches[1:]]
        loss_p, norm_p = plain.train_step(batches)
        loss_f, norm_f = fused.train_step(batches)
        assert loss_f == pytest.approx(loss_p, rel=1e-6)
        assert norm_f == pytest.approx(norm_p, rel=1e-5)
    assert len(grads_p) == len(grads_f) == 2
    for gp, gf in zip(grads_p, grads_f):
        for name in gp:
            torch.testing.assert_close(gf[name], gp[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_no_gradient_buffers_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad (evaluation) the loss is the same and no (vocab x dim) fp32 weight
    gradient nor hidden-state gradient is allocated, although the weight requires grad."""
    h = torch.randn(6, 8)
    w = torch.randn(30, 8, requires_grad=True)
    y = torch.randint(0, 30, (6,))
    ref = chunked_linear_cross_entropy(h, w, y, chunk=4).detach()
    sizes: list[tuple[int, ...]] = []
    zeros = torch.zeros

    def recording_zeros(*shape, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(tuple(shape[0]) if shape and isinstance(shape[0], torch.Size) else shape)
        return zeros(*shape, **kwargs)

    monkeypatch.setattr(torch, "zeros", recording_zeros)
    with torch.no_grad():
        out = chunked_linear_cross_entropy(h, w, y, chunk=4)
    assert out == ref
    assert (30, 8) not in sizes


def test_validation_with_fused_loss_equals_plain_without_logits(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """Validation follows the training step's loss path: with `training.fused_loss` the same
    validation loss as the plain path, and the model is never asked for whole logits."""
    plain, fused = _plain_and_fused(tmp_path, "--training.eval_sequences", "4")
    fused.model.load_state_dict(plain.model.state_dict())
    heads: list[bool] = []
    forward = Transformer.forward

    def recording_forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        heads.append(not kwargs.get("hidden", False))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", recording_forward)
    loss_f = fused.evaluate()
    assert heads and not any(heads)  # every forward returned hidden states
    assert loss_f == pytest.approx(plain.evaluate(), rel=1e-6)


def test_fused_loss_refused_where_it_cannot_run() -> None:
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=11, multiple_of=8,
                                  max_seq_len=8))
    assert fused_loss_problem(model, False) is None
    assert "language-model head" in fused_loss_problem(model, True)
    assert "language-model head" in fused_loss_problem(torch.nn.Linear(2, 2), False)


def test_fp8_refused_with_exit_2(tmp_path: Path) -> None:
    """precision.fp8 where it cannot run (here: fp16 autocast): a ConfigError naming the
    requirement; exit 2 from the CLI. Where it runs: tests/parallel/test_fp8.py."""
    from scaletrain.config import ConfigError
    from scaletrain.parallel.fp8 import fp8_problem

    assert fp8_problem("none", torch.device("cpu"), "bf16") is None
    fp16 = ("--precision.dtype", "fp16")
    with pytest.raises(ConfigError, match="precision.dtype bf16"):
        Trainer(tiny_config(tmp_path / "f", tmp_path / "c", *fp16, "--precision.fp8", "rowwise"))
    import subprocess
    import sys

    from tests.helpers.trainer import tiny_argv
    argv = tiny_argv(tmp_path / "g", tmp_path / "c", *fp16, "--precision.fp8", "tensorwise")
    run = subprocess.run([sys.executable, "-m", "scaletrain", "train", *argv],
                         capture_output=True, text=True, timeout=scaled(120))
    assert run.returncode == 2, run.stderr[-2000:]
    assert "precision.fp8" in run.stderr and "Traceback" not in run.stderr
