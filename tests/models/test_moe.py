"""Mixture of Experts block: routing, grouped experts, balancing terms, exact counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from scaletrain.models.args import (
    PRESETS,
    ModelArgs,
    count_active_params,
    count_params,
    get_preset,
)
from scaletrain.models.moe import (
    MoE,
    aux_loss_weighting,
    balancing_loss,
    moe_layers,
    sequence_balancing_loss,
    update_expert_bias,
)
from scaletrain.models.transformer import build_model
from tests.helpers.dist_worker import run_trainer

TINY = ModelArgs(family="mixtral", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                 ffn_dim=48, max_seq_len=64, n_experts=4, n_experts_per_token=2)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("extra", [{}, {"router_score": "sigmoid", "n_shared_experts": 1},
                                   {"router_norm_topk": False, "n_experts_per_token": 3}])
def test_grouped_experts_equal_per_expert_loop(extra: dict) -> None:
    args = TINY.replace(**extra)
    x = torch.randint(0, 64, (3, 16))
    out = {}
    for compute in ("grouped", "loop"):
        model = build_model(args.replace(expert_compute=compute), seed=1)
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        out[compute] = (logits.detach(), _grads(model))
    torch.testing.assert_close(out["grouped"][0], out["loop"][0], atol=1e-6, rtol=1e-6)
    assert out["grouped"][1].keys() == out["loop"][1].keys()
    for name, g in out["grouped"][1].items():
        torch.testing.assert_close(g, out["loop"][1][name], atol=1e-6, rtol=1e-6, msg=name)
    # Every routed-expert weight and the router got a gradient.
    assert any("experts.w1" in n for n in out["grouped"][1])
    assert any("router.gate" in n for n in out["grouped"][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_moe_block_equals_eager(dtype: torch.dtype) -> None:
    """torch.compile of a MoE block: in fp32 the traced grouped GEMM's shape check (bf16 only)
    used to stop the compilation; the block now takes the per-expert path there."""
    args = TINY.replace(n_layers=1)
    x = torch.randint(0, 64, (2, 16))
    out = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(args, seed=1).to(dtype)
        if compiled:
            model.layers["0"].compile()
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
        out.append((logits.detach().float(), _grads(model)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[1][0], out[0][0], atol=tol, rtol=tol)
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][name].float(), g.float(), atol=tol, rtol=tol,
                                   msg=name)


def test_moe_equals_dense_mixture_by_hand() -> None:
    """The block is sum_k w_k * expert_k(x) over each token's top-k experts."""
    torch.manual_seed(0)
    moe = MoE(TINY)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, TINY.dim)
    out = moe(x)
    flat = x.reshape(-1, TINY.dim)
    probs = torch.softmax(flat @ moe.router.gate.weight.t(), -1)
    top = probs.topk(2, -1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    ex = moe.experts
    ref = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            e = int(top.indices[t, j])
            h = F.silu(flat[t] @ ex.w1[e].t()) * (flat[t] @ ex.w3[e].t())
            ref[t] += weights[t, j] * (h @ ex.w2[e].t())
    torch.testing.assert_close(out.reshape(-1, TINY.dim), ref, atol=1e-5, rtol=1e-5)


def test_counts_match_the_built_model_and_published_sizes() -> None:
    for name in ("debug-moe", "mixtral-8x7b", "qwen3-30b-a3b"):
        args = get_preset(name)
        with torch.device("meta"):
            from scaletrain.models.transformer import Transformer
            model = Transformer(args)
        assert count_params(args).total == sum(p.numel() for p in model.parameters()), name
    # Published totals: Mixtral-8x7B 46.7B (12.9B active), Qwen3-30B-A3B 30.5B (3.3B active),
    # Qwen3-235B-A22B 235B (22B active), Mixtral-8x22B 141B (39B active).
    expected = {"mixtral-8x7b": (46.7, 12.9), "qwen3-30b-a3b": (30.5, 3.3),
                "qwen3-235b-a22b": (235.1, 22.2), "mixtral-8x22b": (140.6, 39.2)}
    for name, (total, active) in expected.items():
        args = PRESETS[name]
        assert abs(count_params(args).total / 1e9 - total) < 0.06, name
        assert abs(count_active_params(args) / 1e9 - active) < 0.06, name
    dense = get_preset("debug")
    assert count_active_params(dense) == count_params(dense).total


def test_sequence_aux_loss_is_the_mean_of_per_sequence_losses_by_hand() -> None:
    """Scope `sequence`: E * sum_i f_i * P_i of each row on its own, averaged over the rows;
    scope `micro_batch`: the same formula over all the rows' tokens at once."""
    torch.manual_seed(0)
    moe = MoE(TINY.replace(n_experts_per_token=2))
    torch.nn.init.normal_(moe.router.gate.weight, std=1.0)
    x = torch.randn(3, 7, TINY.dim)
    routing = moe.router(x.reshape(-1, TINY.dim))
    probs = routing.probs.detach().view(3, 7, 4)
    chosen = routing.experts.view(3, 7, 2)
    by_hand = []
    for b in range(3):
        loss = 0.0
        for i in range(4):
            f = float((chosen[b] == i).sum()) / 7
            loss += f * float(probs[b, :, i].mean())
        by_hand.append(4 * loss)
    got = sequence_balancing_loss(routing, 3)
    assert abs(float(got) - sum(by_hand) / 3) < 1e-6
    f_all = torch.stack([(chosen == i).sum() for i in range(4)]).float() / 21
    pooled = 4 * float((f_all * probs.reshape(-1, 4).mean(0)).sum())
    assert abs(float(balancing_loss(routing)) - pooled) < 1e-6
    assert abs(pooled - float(got)) > 1e-3  # the two scopes are different statistics


@pytest.mark.parametrize("scope", ["sequence", "micro_batch"])
def test_aux_loss_gradient_is_coef_times_token_weighted_mean(scope: str) -> None:
    """Through the injected gradient, the router gets d(CE + coef * aux)/dW (aux of the
    layer's scope: the mean over the sequences, or the micro-batch's); inside the step's
    weighting, a forward of T tokens out of a step of N counts T/N of its aux loss."""
    coef = 0.5
    args = TINY.replace(moe_aux_loss_coef=coef, moe_aux_loss_scope=scope)
    x = torch.randint(0, 64, (3, 16))

    def aux_of(mod: MoE, inp: torch.Tensor) -> torch.Tensor:
        routing = mod.router(inp.reshape(-1, args.dim))
        return (sequence_balancing_loss(routing, inp.shape[0]) if scope == "sequence"
                else balancing_loss(routing))

    model = build_model(args, seed=3)
    model.train()
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    injected = _grads(model)

    ref = build_model(args.replace(moe_aux_loss_coef=0.0), seed=3)
    ref.train()
    auxes = []
    for _, m in moe_layers(ref):
        m.register_forward_hook(lambda mod, inp, out: auxes.append(aux_of(mod, inp[0])))
    ce = F.cross_entropy(ref(x).flatten(0, 1), x.flatten())
    (ce + coef * sum(auxes)).backward()
    for name, g in _grads(ref).items():
        torch.testing.assert_close(injected[name], g, atol=1e-6, rtol=1e-6, msg=name)

    weighted = build_model(args, seed=3)
    weighted.train()
    with aux_loss_weighting(step_tokens=4 * x.numel()):
        F.cross_entropy(weighted(x).flatten(0, 1), x.flatten()).backward()
    ref.zero_grad()
    auxes.clear()
    ce = F.cross_entropy(ref(x).flatten(0, 1), x.flatten())
    (ce + coef / 4 * sum(auxes)).backward()
    for name, g in _grads(ref).items():
        torch.testing.assert_close(_grads(weighted)[name], g, atol=1e-6, rtol=1e-6, msg=name)


def test_aux_loss_scope_is_validated() -> None:
    with pytest.raises(ValueError, match="moe_aux_loss_scope must be one of sequence"):
        TINY.replace(moe_aux_loss_scope="global")
    assert TINY.moe_aux_loss_scope == "sequence"


MOE_FLAGS = ["--model.n_experts", "4", "--model.n_experts_per_token", "2",
             "--model.moe_ffn_dim", "64", "--model.moe_aux_loss_coef", "0.01",
             "--training.max_grad_norm", "1.0"]


def test_sequence_scope_objective_does_not_depend_on_the_accumulation_split(
        tmp_path: pytest.TempPathFactory) -> None:
    """One process, one global batch of 8 sequences per step as 8 x 1, 4 x 2 and 2 x 4
    micro-batches: with scope `sequence` the losses and gradient norms are equal (fp32, 1e-6);
    with `micro_batch` the objective changes with the split (what the scope fixes)."""
    cache = tmp_path / "cache"
    runs: dict[tuple[str, int], dict] = {}
    for scope in ("sequence", "micro_batch"):
        for mbs in (8, 4, 2):
            runs[scope, mbs] = run_trainer(
                [str(tmp_path / f"{scope}-{mbs}"), str(cache), *MOE_FLAGS,
                 "--model.moe_aux_loss_scope", scope, "--training.micro_batch_size", str(mbs),
                 "--training.grad_accum_steps", str(8 // mbs)], 2, capture=False)

    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))

    for mbs in (4, 2):
        seq, ref = runs["sequence", mbs], runs["sequence", 8]
        assert rel(seq["losses"], ref["losses"]) < 1e-6, mbs
        assert rel(seq["norms"], ref["norms"]) < 1e-6, mbs
        mb, mb_ref = runs["micro_batch", mbs], runs["micro_batch", 8]
        assert rel(mb["norms"], mb_ref["norms"]) > 1e-5, mbs


def _skewed_router(moe: MoE) -> None:
    """A router that sends every token of `_tokens()` to expert 0 (feature 0 is 3 in all)."""
    with torch.no_grad():
        moe.router.gate.weight.normal_(std=0.1)
        moe.router.gate.weight[0, 0] += 1.0


def _tokens(n: int) -> torch.Tensor:
    x = torch.randn(n, TINY.dim)
    x[:, 0] = 3.0
    return x


def _load_spread(moe: MoE, x: torch.Tensor) -> float:
    with torch.no_grad():
        counts = torch.bincount(moe.router(x).experts.flatten(), minlength=moe.n_experts)
    return float(counts.max() / counts.float().mean())


def test_balancing_loss_spreads_the_load() -> None:
    torch.manual_seed(0)
    moe = MoE(TINY)
    _skewed_router(moe)
    x = _tokens(256)
    before = _load_spread(moe, x)
    opt = torch.optim.SGD(moe.router.parameters(), lr=0.5)
    for _ in range(50):
        opt.zero_grad()
        balancing_loss(moe.router(x)).backward()
        opt.step()
    after = _load_spread(moe, x)
    assert before == 2.0 and after < 1.2, (before, after)  # 2.0: all to one; 1.0: even


def test_bias_update_spreads_the_load_without_touching_weights() -> None:
    torch.manual_seed(0)
    moe = MoE(TINY.replace(moe_bias_update_rate=0.02))
    _skewed_router(moe)
    moe.reset_state()
    x = _tokens(256)
    before = _load_spread(moe, x)
    weight = moe.router.gate.weight.detach().clone()
    weights_before = moe.router(x).weights
    for _ in range(60):
        moe(x[None])
        update_expert_bias(moe)
    after = _load_spread(moe, x)
    assert before == 2.0 and after < 1.4, (before, after)
    assert torch.equal(moe.router.gate.weight, weight)
    assert moe.step_load.sum() == 0  # read and reset by the update
    # The gate weights of a token's chosen experts still come from the unbiased scores.
    routing = moe.router(x)
    probs = torch.softmax(x @ weight.t(), -1).gather(-1, routing.experts)
    torch.testing.assert_close(routing.weights, probs / probs.sum(-1, keepdim=True))
    assert not torch.equal(routing.weights, weights_before)


def test_capacity_factor_drops_overflow_tokens() -> None:
    torch.manual_seed(0)
    args = TINY.replace(moe_capacity_factor=1.0)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    _skewed_router(moe)
    seen: list[torch.Tensor] = []
    moe.experts.register_forward_hook(lambda mod, inp, out: seen.append(inp[1]))
    x = _tokens(64)[None]
    out = moe(x)
    capacity = math.ceil(64 * 2 / 4)
    assert int(seen[0].max()) <= capacity and int(seen[0].sum()) < 64 * 2
    assert torch.isfinite(out).all()
    free = MoE(args.replace(moe_capacity_factor=None))
    free.load_state_dict(moe.state_dict())
    assert not torch.allclose(free(x), out)


def test_bf16_autocast_and_bad_dimensions() -> None:
    model = build_model(TINY, seed=0)
    x = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    with pytest.raises(ValueError, match="n_experts_per_token"):
        TINY.replace(n_experts_per_token=5)
    with pytest.raises(ValueError, match="needs n_experts"):
        TINY.replace(n_experts=0)
