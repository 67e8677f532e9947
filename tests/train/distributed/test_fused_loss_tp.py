"""The vocabulary-parallel chunked loss (tp 2, gloo) against the plain head + cross-entropy of
one process: loss and gradients (hidden states, head weight, every model parameter, and the
parameters after an optimizer step) to 1e-6 in fp32, with and without sequence parallelism,
tied and untied embeddings, ignored targets, a soft-cap and a vocabulary that tp does not
divide."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests.helpers.proc import run_ranks

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cap: float | None) -> torch.Tensor:
    from scaletrain.train.loss import cross_entropy_sum

    logits = h @ w.t()
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return cross_entropy_sum(logits, y)


def _function_cases(mesh: object) -> None:
    """The loss function alone: h as Shard(1) (sequence parallel), Replicate, or plain."""
    from scaletrain.train.chunked_loss_tp import vocab_parallel_linear_cross_entropy
    from scaletrain.train.loss import IGNORE_INDEX

    for vocab, cap, chunk, layout in [(50, None, 7, "shard"), (51, 3.0, 5, "shard"),
                                      (51, None, 64, "plain"), (50, 0.5, 1, "replicate")]:
        torch.manual_seed(vocab)
        h = torch.randn(3, 8, 16, requires_grad=True)
        w = torch.randn(vocab, 16, requires_grad=True)
        y = torch.randint(0, vocab, (3, 8))
        y[0, :3] = IGNORE_INDEX
        y[1, 5] = vocab - 1  # the last row lives on the last rank
        y[2, 0] = 0
        ref = _plain(h, w, y, cap)
        gh_ref, gw_ref = torch.autograd.grad(ref * 0.37, (h, w))
        wd = distribute_tensor(w.detach(), mesh, [Shard(0)]).requires_grad_()
        if layout == "plain":
            hd = h.detach().clone().requires_grad_()
        else:
            hd = distribute_tensor(h.detach(), mesh,
                                   [Shard(1) if layout == "shard" else Replicate()])
            hd.requires_grad_()
        out = vocab_parallel_linear_cross_entropy(hd, wd, y, chunk=chunk, softcap=cap)
        (out * 0.37).backward()
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(_full(hd.grad), gh_ref, **TOL)
        torch.testing.assert_close(wd.grad.full_tensor(), gw_ref, **TOL)


def _model_cases(mesh: object) -> None:
    """Through a tensor-parallel model (`apply_tp`): every parameter's gradient and its value
    after an AdamW step equal the single-process model's with the plain loss."""
    from scaletrain.models.args import ModelArgs
    from scaletrain.models.transformer import Transformer
    from scaletrain.parallel.tp import apply_tp
    from scaletrain.train.chunked_loss_tp import vocab_parallel_linear_cross_entropy
    from scaletrain.train.loss import IGNORE_INDEX, cross_entropy_sum

    for sp, tied, cap in [(True, False, None), (False, False, 4.0), (True, True, 4.0),
                          (False, True, None)]:
        args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97,
                         multiple_of=16, max_seq_len=16, tie_embeddings=tied, final_softcap=cap)
        torch.manual_seed(0)
        ref_model = Transformer(args)
        model = Transformer(args)
        model.load_state_dict(ref_model.state_dict())
        apply_tp(model, mesh, sequence_parallel=sp, loss_parallel=False)
        x = torch.randint(0, 97, (2, 8))
        y = torch.randint(0, 97, (2, 8))
        y[1, :3] = IGNORE_INDEX
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref_model, model)]
        ref = cross_entropy_sum(ref_model(x), y)
        ref.backward()
        out = vocab_parallel_linear_cross_entropy(model(x, hidden=True), model.output.weight, y,
                                                  chunk=5, softcap=cap)
        out.backward()
        torch.testing.assert_close(out, ref, **TOL)
        ref_params = dict(ref_model.named_parameters())
        names = set()
        for name, p in model.named_parameters():
            names.add(name)
            torch.testing.assert_close(_full(p.grad), ref_params[name].grad, rtol=1e-5,
                                       atol=1e-6, msg=lambda m, n=name, s=sp: f"{n} sp={s}: {m}")
        assert names == set(ref_params)
        for opt in opts:
            opt.step()
        for name, p in model.named_parameters():
            torch.testing.assert_close(_full(p.detach()), ref_params[name].detach(), **TOL,
                                       msg=lambda m, n=name: f"{n} after step: {m}")


def _entry(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        _function_cases(mesh)
        _model_cases(mesh)
    except Exception:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.mark.distributed
def test_vocab_parallel_fused_loss_equals_plain(tmp_path: Path) -> None:
    try:
        run_ranks(_entry, 2, str(tmp_path))
    finally:
        for err in sorted(tmp_path.glob("error*.txt")):
            print(err.read_text())
