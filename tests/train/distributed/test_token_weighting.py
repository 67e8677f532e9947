"""Loss normalization with uneven valid-token counts, against plain PyTorch.

The batches have targets of -100 (a fine-tuning prompt, padding) in very different amounts per
row, micro-batch, data-parallel rank and context-parallel chunk, one rank's micro-batch having
none valid at all. docs/train.md promises the loss of a step is the sum of token losses over all
its micro-batches divided by their total count of valid tokens (token-weighted, over the global
batch), so every layout (DDP, ZeRO-3, TP, CP, PP) with gradient accumulation and the default
gradient clipping must give what one plain `F.cross_entropy(..., ignore_index=-100)` (mean)
over the whole global batch gives, with `clip_grad_norm_` and `torch.optim.AdamW`: the logged
loss and gradient norm of two steps and the clipped gradients of the first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist_worker import full_grads
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

STEPS, GA, ROWS, SEQ, VOCAB = 2, 2, 4, 32, 512  # ROWS: rows of one global micro-batch
MODEL = ["--model.n_layers", "2", "--model.tie_embeddings", "false", "--data.seq_len", str(SEQ),
         "--training.grad_accum_steps", str(GA), "--training.steps", "4",
         "--checkpoint.save_final", "false"]
# name, flags, data-parallel degree
LAYOUTS = [
    ("ddp", ["--parallel.data_parallel", "ddp"], 2),
    ("zero3", ["--parallel.data_parallel", "zero3"], 2),
    ("tp", ["--parallel.tp", "2"], 1),
    ("cp", ["--parallel.cp", "2"], 1),
    ("pp", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B"], 1),
]
TOL = 1e-6  # fp32, relative
GRAD_TOL = 2e-6  # max |g - g_ref| / max |g_ref| per tensor


def global_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """STEPS steps of GA global micro-batches of ROWS rows; valid-token counts per row differ
    from 0 to SEQ, masked at the start (a prompt) or at the end (padding)."""
    g = torch.Generator().manual_seed(1234)
    valid = [[(3, 32, 0, 10), (32, 30, 0, 0)], [(1, 7, 32, 25), (20, 0, 16, 2)]]
    steps = []
    for s in range(STEPS):
        micro = []
        for m in range(GA):
            x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
            y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
            for r, n in enumerate(valid[s][m]):
                if r % 2:  # padding at the end
                    y[r, n:] = -100
                else:  # a prompt at the start
                    y[r, : SEQ - n] = -100
            micro.append((x, y))
        steps.append(micro)
    return steps


def _argv(out: Path, cache: Path, flags: list[str], dp: int) -> list[str]:
    return [*MODEL, *flags, "--training.micro_batch_size", str(ROWS // dp)]


def _run(out: Path, cache: Path, flags: list[str], dp: int) -> dict[str, Any]:
    from scaletrain.train.trainer import Trainer

    trainer = Trainer(tiny_config(out, cache, *_argv(out, cache, flags, dp)))
    rank = trainer.dp_rank
    size = ROWS // dp
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capturing_step(*a: Any, **k: Any) -> Any:
        if not grads:
            grads.update(full_grads(trainer.model))
        return step(*a, **k)

    trainer.optimizer.step = capturing_step
    losses, norms = [], []
    for micro in global_batches():
        mine = [(x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size])
                for x, y in micro]
        loss, norm = trainer.train_step(mine)
        trainer.step += 1
        losses.append(loss)
        norms.append(norm)
    return {"losses": losses, "norms": norms, "grads": grads}


def _entry(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    results = {}
    for name, flags, dp in LAYOUTS:
        results[name] = _run(Path(out_dir) / name, Path(out_dir) / "cache", flags, dp)
        dist.barrier()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def reference(out: Path, cache: Path) -> dict[str, Any]:
    """Plain PyTorch on the whole global batch: the same initial weights (the single-process
    model of the same seed), mean cross-entropy over every valid token, `clip_grad_norm_`,
    AdamW with the trainer's hyperparameters (warmup learning rate, decay on matrices)."""
    from scaletrain.models.transformer import build_model

    cfg = tiny_config(out, cache, *_argv(out, cache, [], 1))
    model = build_model(cfg.model.to_model_args(), "cpu", seed=cfg.training.seed)
    o, sched = cfg.optimizer, cfg.lr_schedule
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2],
                              "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    losses, norms, grads = [], [], {}
    for s, micro in enumerate(global_batches()):
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.training.max_grad_norm)))
        losses.append(loss.item())
        if s == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for group in opt.param_groups:  # linear warmup over `warmup_steps` (tiny config: 2)
            group["lr"] = o.lr * (s + 1) / sched.warmup_steps
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "grads": grads}


@pytest.mark.distributed
def test_uneven_valid_tokens_weigh_every_token_equally(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ref = reference(tmp_path / "ref", cache)
    assert ref["norms"][0] > 1.0, "clipping must engage for the test to cover it"
    run_ranks(_entry, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    bad = []
    for name, _, _ in LAYOUTS:
        seen: set[str] = set()  # pipeline stages hold their own layers' gradients
        for r, res in enumerate(ranks):
            got = res[name]
            for key in ("losses", "norms"):
                rel = max(abs(a - b) / abs(b) for a, b in zip(got[key], ref[key], strict=True))
                if rel > TOL:
                    bad.append((name, r, key, rel, got[key], ref[key]))
            seen |= set(got["grads"])
            for key, g in got["grads"].items():
                rel = float((g - ref["grads"][key]).abs().max() / ref["grads"][key].abs().max())
                if rel > GRAD_TOL:
                    bad.append((name, r, key, rel))
        assert seen == set(ref["grads"]), (name, set(ref["grads"]) - seen)
    assert not bad, bad
