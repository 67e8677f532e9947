"""Activation memory under tensor parallelism (2 gloo processes): what a Llama block saves per
rank, against Megatron-LM's formula and against the planner, with and without sequence
parallelism; the sequence-parallel re-gather bitwise equal to DTensor's path; the 16-bit
RMSNorm and the gated activation on DTensors in every float dtype.

Megatron-LM's count (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, table 2), per layer and micro-batch, 16-bit activations:
tensor parallel s b h (10 + 24/t + 5 a s / (h t)), tensor + sequence parallel s b h (34/t +
5 a s / (h t)). Adapted to the Llama block as `plan/memory/korthikanti.py: llama_layer_bytes` does
(flash attention: no a s / h term; no dropout masks; grouped-query K/V of g heads of size d; a
gated MLP of width f), in bytes per token:
    tensor parallel:              8 h + (4 h + 4 g d + 6 f) / t
    tensor + sequence parallel:   (12 h + 4 g d + 6 f) / t
The formula leaves out the fp32 per-row statistics every implementation keeps (each norm's
1/rms per token, the attention's log-sum-exp per token and head); the bound adds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from scaletrain.models.args import ModelArgs
from scaletrain.plan.memory.activations import ActivationSpec, plain_layer
from tests.helpers.proc import run_ranks

TP = 2
MBS, SEQ = 2, 32
SHAPES = {
    "gqa": ModelArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, ffn_dim=352,
                     max_seq_len=256),
    "mha": ModelArgs(dim=96, n_layers=2, n_heads=4, vocab_size=256, ffn_dim=256,
                     max_seq_len=256),
}
PRECISIONS = {"bf16": ("bf16", "bf16"), "autocast": ("bf16", "fp32"), "fp32": ("fp32", "fp32")}
# (sequence parallel, re-gather): TP alone, SP as the trainer runs it, SP on DTensor's path
MODES = {"tp": (False, True), "tp-sp": (True, True), "tp-sp-dtensor": (True, False)}


def megatron_bytes(args: ModelArgs, tokens: int, t: int, sp: bool) -> float:
    """Per-layer bytes of Megatron-LM's formula for these dims (see the module docstring)."""
    h, f, gd = args.dim, args.hidden_dim, args.kv_heads * args.head_dim
    if sp:
        return tokens * (12 * h + 4 * gd + 6 * f) / t
    return tokens * (8 * h + (4 * h + 4 * gd + 6 * f) / t)


def _saved_bytes(mesh: Any) -> dict[tuple[str, str, str], int]:
    from scaletrain.train.saved_bytes import per_layer_saved_bytes

    return {(shape, prec, mode): per_layer_saved_bytes(
                args, MBS, SEQ, *PRECISIONS[prec], tp_mesh=mesh, sequence_parallel=sp,
                regather=rg)
            for shape, args in SHAPES.items() for prec in PRECISIONS
            for mode, (sp, rg) in MODES.items()}


def _train_step(mesh: Any, regather: bool, param_dtype: torch.dtype, autocast: bool,
                args: ModelArgs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    from scaletrain.models.transformer import build_model
    from scaletrain.parallel.tp import apply_tp

    model = build_model(args, seed=0).to(param_dtype)
    apply_tp(model, mesh, sequence_parallel=True, loss_parallel=False, regather=regather)
    tokens = torch.randint(0, args.vocab_size, (MBS, SEQ + 1),
                           generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                      tokens[:, 1:].flatten()).backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in model.named_parameters()}
    return logits.detach(), grads


def _regather_equals_dtensor(mesh: Any) -> dict[str, list[str]]:
    """Names of the outputs/gradients that differ (bitwise) between the two SP paths."""
    out = {}
    qkv_bias = SHAPES["gqa"].replace(qkv_bias=True)
    for name, dtype, autocast, args in (("fp32", torch.float32, False, SHAPES["gqa"]),
                                        ("bf16", torch.bfloat16, False, SHAPES["mha"]),
                                        ("autocast-bias", torch.float32, True, qkv_bias)):
        ref_logits, ref = _train_step(mesh, False, dtype, autocast, args)
        logits, got = _train_step(mesh, True, dtype, autocast, args)
        bad = [] if torch.equal(logits, ref_logits) else ["logits"]
        out[name] = bad + [k for k in ref if not torch.equal(ref[k], got[k])]
    return out


def _dtensor_layers(mesh: Any) -> dict[str, float]:
    """RMSNorm on a sequence-sharded DTensor and the gated activation on hidden-sharded
    DTensors, against the same layers on the whole tensors in one process: max errors, and
    the bytes each saves on this rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from scaletrain.models.layers import _ACTS, RMSNorm, _GatedAct
    from scaletrain.train.saved_bytes import _local

    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tag = str(dtype).removeprefix("torch.")
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 8, 32, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
        g = torch.randn(2, 8, 32, generator=gen).to(dtype)
        ref_norm = RMSNorm(32, 1e-5).to(dtype)
        ref_norm.weight.data.copy_(w)
        xr = x.clone().requires_grad_()
        ref_norm(xr).backward(g)
        norm = RMSNorm(32, 1e-5).to(dtype)
        norm.weight = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()]))
        xd = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            s = _local(t).untyped_storage()
            saved[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = norm(xd)
        y.backward(distribute_tensor(g, mesh, [Shard(1)]))
        ref_y = ref_norm(x.clone())
        out[f"norm-{tag}-out"] = float((y.full_tensor() - ref_y).abs().max())
        out[f"norm-{tag}-dx"] = float((xd.grad.full_tensor() - xr.grad).abs().max())
        # relative: each rank rounds its partial sum to the weight's dtype before the sum
        out[f"norm-{tag}-dw"] = float((norm.weight.grad.full_tensor() - ref_norm.weight.grad)
                                      .abs().max() / ref_norm.weight.grad.abs().max())
        w_bytes = w.numel() * w.element_size()
        out[f"norm-{tag}-saved"] = sum(saved.values()) - w_bytes
        out[f"norm-{tag}-is-dtensor"] = float(isinstance(y, DTensor))

        a = torch.randn(2, 8, 64, generator=gen).to(dtype)
        b = torch.randn(2, 8, 64, generator=gen).to(dtype)
        ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
        (_ACTS["silu"](ar) * br).backward(torch.ones_like(a))
        ad = distribute_tensor(a, mesh, [Shard(2)]).requires_grad_()
        bd = distribute_tensor(b, mesh, [Shard(2)]).requires_grad_()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = _GatedAct.apply(ad, bd, "silu")
        h.backward(torch.ones_like(h))
        out[f"act-{tag}-out"] = float((h.full_tensor() - _ACTS["silu"](a) * b).abs().max())
        out[f"act-{tag}-da"] = float((ad.grad.full_tensor() - ar.grad).abs().max())
        out[f"act-{tag}-db"] = float((bd.grad.full_tensor() - br.grad).abs().max())
        out[f"act-{tag}-saved"] = sum(saved.values())
    return out


def _projection_alone(mesh: Any) -> float:
    """A `ColwiseFromShard` projection called outside its module (no gathered input): the
    DTensor path, a whole-sequence input, this rank's columns of the output."""
    from scaletrain.models.transformer import build_model
    from scaletrain.parallel.tp import apply_tp

    args = SHAPES["gqa"]
    model = build_model(args, seed=0)
    ref = model.layers["0"].attention.wq.weight.detach().clone()
    apply_tp(model, mesh, sequence_parallel=True, loss_parallel=False)
    x = torch.randn(MBS, SEQ, args.dim, generator=torch.Generator().manual_seed(2))
    got = model.layers["0"].attention.wq(x)
    rows = ref.shape[0] // TP
    want = x @ ref[dist.get_rank() * rows:(dist.get_rank() + 1) * rows].T
    return float((got - want).abs().max())


def _entry(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    result = {"saved": _saved_bytes(mesh), "bitwise": _regather_equals_dtensor(mesh),
              "layers": _dtensor_layers(mesh), "alone": _projection_alone(mesh)}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("tp-activations")
    run_ranks(_entry, TP, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(TP)]


@pytest.mark.distributed
@pytest.mark.parametrize("shape", SHAPES)
def test_tp_block_keeps_at_most_megatrons_bytes(results: list[dict], shape: str) -> None:
    args, tokens = SHAPES[shape], MBS * SEQ
    for rank in results:
        for mode, (sp, _) in MODES.items():
            measured = rank["saved"][(shape, "bf16", mode)]
            rows = tokens / TP if sp else tokens  # the norms' rows on this rank
            stats = 2 * 4 * rows + 4 * tokens * args.n_heads / TP
            bound = megatron_bytes(args, tokens, TP, sp) + stats
            if mode == "tp-sp-dtensor":  # DTensor's path keeps the gathered projection inputs
                assert measured > bound, (mode, measured, bound)
            else:
                assert measured <= bound, (mode, measured, bound)
        sp, plain = rank["saved"][(shape, "bf16", "tp-sp")], rank["saved"][(shape, "bf16", "tp")]
        assert sp < rank["saved"][(shape, "bf16", "tp-sp-dtensor")] < plain


@pytest.mark.distributed
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_planner_equals_tp_saved_bytes(results: list[dict], shape: str, precision: str) -> None:
    dtype, param_dtype = PRECISIONS[precision]
    for mode, (sp, rg) in MODES.items():
        spec = ActivationSpec(mbs=MBS, seq_len=SEQ, compute_dtype=dtype,
                              residual_dtype=param_dtype, tp=TP, sequence_parallel=sp,
                              sp_regather=rg, kernels="cpu")
        planned = sum(plain_layer(SHAPES[shape], spec).values())
        for rank in results:
            assert rank["saved"][(shape, precision, mode)] == planned, mode


@pytest.mark.distributed
def test_sequence_parallel_regather_is_bitwise_dtensors_path(results: list[dict]) -> None:
    for rank in results:
        assert rank["bitwise"] == {"fp32": [], "bf16": [], "autocast-bias": []}


@pytest.mark.distributed
def test_norm_and_gated_activation_on_dtensors(results: list[dict]) -> None:
    tol = {"float32": 1e-6, "bfloat16": 0.0, "float16": 0.0}
    for rank in results:
        got = rank["layers"]
        for dtype, t in tol.items():
            c = 4 if dtype == "float32" else 2
            assert got[f"norm-{dtype}-is-dtensor"] == 1.0
            for k in ("out", "dx"):
                assert got[f"norm-{dtype}-{k}"] <= t, (dtype, k, got[f"norm-{dtype}-{k}"])
            # the weight gradient: two partial sums, each rounded to the dtype, then added
            eps = {"float32": 1e-6, "bfloat16": 2**-7, "float16": 2**-10}[dtype]
            assert got[f"norm-{dtype}-dw"] <= eps, (dtype, got[f"norm-{dtype}-dw"])
            for k in ("out", "da", "db"):
                assert got[f"act-{dtype}-{k}"] <= t, (dtype, k)
            rows, h = 2 * 8 // TP, 32
            if c == 2:  # `_RMSNormFn`: the 16-bit shard and the fp32 1/rms per row
                assert got[f"norm-{dtype}-saved"] == c * rows * h + 4 * rows
            # the gated activation keeps its two inputs' shards
            assert got[f"act-{dtype}-saved"] == 2 * c * 2 * 8 * 64 // TP


@pytest.mark.distributed
def test_projection_called_alone_takes_the_dtensor_path(results: list[dict]) -> None:
    for rank in results:
        assert rank["alone"] <= 1e-5
