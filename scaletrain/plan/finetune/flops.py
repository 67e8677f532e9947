"""FLOPs per token of a fine-tuning step: the matmuls that run, not pre-training's 6N.

Each matmul of `y = x W^T` costs 2 x in x out per token forward, the same again for the input
gradient `dx = dy W` **only where x needs a gradient** (something trainable lies upstream),
and the same again for the weight gradient `dW = dy^T x` **only where W trains**. So a frozen
base runs forward + input gradients (4N) and no weight gradients; a LoRA adapter
`s B (A x)` adds its own forward (2r(in + out)), the gradient through B (2r out), both weight
gradients (2r in + 2r out) and, where x needs one, the input gradient through A (2r in).
Attention scores and values: forward 2 x 2 x keys x head_dim x heads per token (the causal
mask not discounted, PaLM's convention, as `plan/flops.py`); backward one such matmul for each
of dP (when q or k needs a gradient), dV, dQ and dK that autograd computes.

Walking the blocks in order decides what needs a gradient: nothing in front of the first
trainable parameter (frozen embeddings, frozen first blocks), everything after it. The LM
head runs over every token (its input gradient counts when the final hidden state needs
one); a classification head runs once per sequence (`num_labels`), and the LM head not at
all. Full fine-tuning of a language model comes to 6N + attention with N the matmul weights
(`flops_per_token`, pre-training's, also counts the norm weights in N: ~1e-5 more).

One formula for the fine-tuning metrics (TFLOP/s, MFU), `finetune --dry-run` and
`plan --method`; `tests/plan/finetune/test_finetune_flops.py` holds it equal to
`torch.utils.flop_counter` over a real step. MoE blocks are outside the walk: they count forward +
input gradients of the active parameters, plus weight gradients of the trainable share.
"""

from __future__ import annotations

from scaletrain.models.args import ModelArgs, count_params
from scaletrain.plan.finetune.activations import BlockTraining, method_blocks
from scaletrain.plan.finetune.estimate import _linear_shapes
from scaletrain.plan.flops import attention_forward_flops, flops_per_token, matmul_params

ATTENTION = ("q", "k", "v")


def _linear(shape: tuple[int, int], x_grad: bool, trains: bool, adapted: bool,
            rank: int) -> float:
    """FLOPs per token of one (possibly adapted) linear (module docstring)."""
    i, o = shape
    f = 2 * i * o
    flops = f + (f if x_grad else 0) + (f if trains else 0)
    if adapted:
        flops += 2 * rank * (i + o) + 2 * rank * o + 2 * rank * (i + o)
        flops += 2 * rank * i if x_grad else 0
    return flops


def _block(args: ModelArgs, span: int, bt: BlockTraining, stream: bool,
           rank: int) -> tuple[float, bool]:
    """(FLOPs per token of one dense block, whether its output needs a gradient) given
    whether its input (`stream`) needs one."""
    shapes = _linear_shapes(args)
    flops = 0.0
    needs: dict[str, bool] = {}

    def run(name: str, x_grad: bool) -> None:
        nonlocal flops
        trains, adapted = name in bt.linears, name in bt.adapted
        flops += _linear(shapes[name], x_grad, trains, adapted, rank)
        needs[name] = x_grad or trains or adapted

    normed = stream or bt.norms
    for name in ATTENTION:
        run(name, normed)
    unit = 2 * args.n_heads * args.head_dim * span  # one of attention's matmuls, per token
    q, k, v = (needs[n] for n in ATTENTION)
    flops += 2 * unit + unit * ((q or k) + v + q + k)
    run("o", q or k or v)
    stream = stream or needs["o"]
    normed = stream or bt.norms
    mlp_in = [n for n in ("gate", "up") if n in shapes]
    for name in mlp_in:
        run(name, normed)
    run("down", any(needs[n] for n in mlp_in))
    return flops, stream or needs["down"]


def finetune_flops_per_token(args: ModelArgs, seq_len: int, method: str, *, rank: int = 8,
                             targets: tuple[str, ...] | None = None,
                             train_last: int | None = None, freeze_first: int = 0,
                             freeze_embeddings: bool = True, train_norms: bool = False,
                             num_labels: int | None = None) -> float:
    """Model FLOPs per trained token of `method` (module docstring); recomputation is not
    counted (MFU)."""
    if method == "pretrain":
        return flops_per_token(args, seq_len)
    kw = method_blocks(args, method, train_last=train_last, freeze_first=freeze_first,
                       targets=tuple(targets) if targets else tuple(_linear_shapes(args)),
                       train_norms=train_norms, freeze_embeddings=freeze_embeddings,
                       num_labels=num_labels)
    if args.is_moe or args.arch != "llama":
        return _approximate(args, seq_len, method, kw, rank, num_labels)
    stream = kw["embeddings"]
    flops = 0.0
    for i, bt in enumerate(kw["blocks"]):
        f, stream = _block(args, args.attention_span(i, seq_len), bt, stream, rank)
        flops += f
    hidden_grad = stream or kw["final_norm"]
    if num_labels is None:  # the LM head over every token
        head = args.vocab_size * args.dim
        flops += 2 * head * (1 + hidden_grad + kw["lm_head"])
    else:  # the score head over one pooled token per sequence; it always trains
        flops += 2 * num_labels * args.dim * (2 + hidden_grad) / seq_len
    return flops


def _approximate(args: ModelArgs, seq_len: int, method: str, kw: dict, rank: int,
                 num_labels: int | None) -> float:
    """Models outside the block walk: forward and input gradients of every active matmul
    and attention, weight gradients of the trainable share (LoRA: of the adapters)."""
    from scaletrain.plan.finetune.estimate import estimate

    n = matmul_params(args)
    attention = attention_forward_flops(args, seq_len)
    trainable = estimate(args, method, rank=rank, num_labels=num_labels).trainable
    adapters = trainable if method in ("lora", "qlora") else 0
    share = min(trainable / max(count_params(args).total, 1), 1.0)
    return 4 * n + 3 * attention + 6 * adapters + 2 * n * (share if not adapters else 0)


__all__ = ["finetune_flops_per_token"]
