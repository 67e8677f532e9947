"""Activation bytes of a fine-tuning run: what autograd keeps when parts of the model are frozen.

Autograd keeps a tensor only for a gradient it will compute (measured with
`train/saved_bytes.py`'s `finetune` hook; tests/plan/finetune/test_plan_finetune_activations.py
holds this module to the measured bytes):

- a block (or the embedding) in front of the first trainable parameter keeps nothing. The
  first block that trains but whose input needs no gradient (frozen embeddings) keeps of its
  first norm only what the norm weight's gradient needs (CPU composite fp32 RMSNorm: x * rstd;
  the other kernels keep input and rstd anyway); a frozen norm whose input needs a gradient
  keeps x and rstd but not x * rstd (CPU composite);
- a linear keeps its input only when its weight trains or it carries a LoRA adapter (the frozen
  weight alone gives the input gradient); under autocast over an fp32 residual each such linear
  keeps its own cast of the input. A frozen linear whose input needs a gradient keeps the
  16-bit copy of its weight made on that call (`kept_weight_casts`);
- attention keeps q, k, v, its output and the log-sum-exp when any of q, k, v needs a gradient;
  the gated MLP keeps w1 x and w3 x when either needs one, and the down projection's input when
  it trains;
- a fused LoRA linear (`finetune/lora_fused.py`) keeps its input in the compute dtype and the
  rank-r `x A^T` (c T r), no weight copy. With dropout the adapter is composed
  (`LoRALinear.forward`): the base keeps no input; each adapter keeps its dropout's output in
  the compute dtype, the mask when x needs a gradient (x's dtype on CPU, a bool on CUDA), and
  `x A^T`; the copies of A (when x needs a gradient), B and the base weight are kept;
- the classification head (`SequenceClassifier`) runs the final norm over every token but no
  LM head: it keeps the last-token gather's indices, the score's (batch, dim) input and a
  (batch, labels) fp32 log-softmax with int64 targets;
- the language-model head and loss keep the head's input and the fp32 log-softmax of every
  token; with `training.fused_loss` (`train/chunked_loss.py`) they keep instead the gradient
  of the final-norm output (its dtype) and, when the head trains, of the head weight (fp32);
  no autocast copy of the head weight is kept either;
- recomputation: a checkpointed block (or attention) keeps its input only when something in it
  needs a gradient, and no weight copies.

Covered: Llama-style dense blocks without Qwen3 q/k norms, Gemma 2 post-norms or soft caps,
on one device, DDP or FSDP (which shard weights, not activations); no tensor, sequence or
context parallelism. Other models keep the pretraining estimate (`supported` says which).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.models.args import ModelArgs
from scaletrain.plan.memory.activations import (
    DTYPE_BYTES,
    ActivationBytes,
    ActivationSpec,
    _attention_core,
    _norm,
    is_checkpointed,
)

ALL = frozenset(("q", "k", "v", "o", "gate", "up", "down"))


@dataclass(frozen=True)
class BlockTraining:
    """What of one block trains: `linears` whose weights train, LoRA `adapted` linears,
    `norms` (the two block norms), `dropout`: the adapters run composed with dropout
    (`LoRALinear.forward`) instead of fused."""

    linears: frozenset[str] = frozenset()
    adapted: frozenset[str] = frozenset()
    norms: bool = False
    dropout: bool = False

    @property
    def trains(self) -> frozenset[str]:
        """Linears whose output needs a gradient whatever their input."""
        return self.linears | self.adapted

    @property
    def keeps_input(self) -> frozenset[str]:
        """Linears that keep their input as it comes (a composed adapter keeps its dropout's
        output instead)."""
        return self.linears | (frozenset() if self.dropout else self.adapted)


FULL_BLOCK = BlockTraining(ALL, frozenset(), True)


def supported(args: ModelArgs, spec: ActivationSpec) -> bool:
    """Whether `finetune_activation_bytes` models this model and layout exactly."""
    return (args.arch == "llama" and not args.is_moe and not args.qk_norm
            and not args.post_norms and args.attn_softcap is None
            and args.final_softcap is None and spec.tp == spec.cp == 1)


def _norm_part(args: ModelArgs, spec: ActivationSpec, input_grad: bool, weight: bool) -> int:
    """An RMSNorm whose input and/or weight need gradients. The CPU composite over an fp32
    residual keeps x and rstd for the input's gradient and x * rstd for the weight's; the
    other kernels keep what they keep for both."""
    if not (input_grad or weight):
        return 0
    if spec.kernels == "cpu" and DTYPE_BYTES[spec.residual_dtype] == 4:
        x_rstd = 4 * spec.tokens * args.dim
        return _norm(args, spec) - (0 if weight else x_rstd) if input_grad else x_rstd
    return _norm(args, spec)


def _inputs(args: ModelArgs, spec: ActivationSpec, consumers: int) -> int:
    """A norm output read by `consumers` linears that keep it: once (c == r) or one cast each."""
    c, r = DTYPE_BYTES[spec.compute_dtype], DTYPE_BYTES[spec.residual_dtype]
    if consumers == 0:
        return 0
    return (1 if c == r else consumers) * c * spec.tokens * args.dim


def block_scope(spec: ActivationSpec) -> bool:
    """Whether recomputation wraps whole blocks (else the attention of a block)."""
    return spec.recompute == "full" or spec.scope == "block"


def _grads(b: BlockTraining, input_grad: bool) -> dict[str, bool]:
    """Which tensors of a block need a gradient: the input of each linear (by target name),
    the attention's q/k/v (`qkv`) and the block's output (`out`)."""
    keep = b.trains
    attn_in = input_grad or b.norms
    qkv = attn_in or bool(keep & {"q", "k", "v"})
    mid = qkv or "o" in keep
    mlp_in = mid or b.norms
    gated = mlp_in or bool(keep & {"gate", "up"})
    return {"q": attn_in, "k": attn_in, "v": attn_in, "o": qkv, "gate": mlp_in, "up": mlp_in,
            "down": gated, "qkv": qkv, "mid": mid, "out": gated or "down" in keep}


def block_bytes(args: ModelArgs, spec: ActivationSpec, b: BlockTraining, input_grad: bool,
                rank: int = 0) -> tuple[dict[str, int], bool]:
    """Bytes one block keeps by component, and whether its output needs a gradient."""
    c, t = DTYPE_BYTES[spec.compute_dtype], spec.tokens
    keep, g = b.keeps_input, _grads(b, input_grad)
    attention = _inputs(args, spec, len(keep & {"q", "k", "v"}))
    if g["qkv"]:
        attention += _attention_core(args, spec)
    elif "o" in keep:  # the attention output, kept by wo alone
        attention += c * t * args.n_heads * args.head_dim
    f = args.hidden_dim
    mlp = _inputs(args, spec, len(keep & {"gate", "up"})) \
        + (2 * c * t * f if g["down"] else 0) + (c * t * f if "down" in keep else 0)
    norms = _norm_part(args, spec, input_grad, b.norms) + _norm_part(args, spec, g["mid"],
                                                                     b.norms)
    adapters = {name: c * t * rank for name in b.adapted}  # x A^T (the input of B)
    if b.dropout:  # its output (or its cast) for A, and the mask when x needs a gradient
        from scaletrain.plan.finetune.estimate import _linear_shapes

        for name, (width, _) in _linear_shapes(args).items():
            if name in b.adapted:
                x_bytes = c if name in ("o", "down") else DTYPE_BYTES[spec.residual_dtype]
                mask = x_bytes if spec.kernels == "cpu" else 1  # CUDA: a bool mask
                adapters[name] += (c + (mask if g[name] else 0)) * t * width
    attention += sum(v for k, v in adapters.items() if k in ("q", "k", "v", "o"))
    mlp += sum(v for k, v in adapters.items() if k in ("gate", "up", "down"))
    return {"norms": norms, "attention": attention, "mlp": mlp}, g["out"]


def kept_weight_casts(args: ModelArgs, spec: ActivationSpec, blocks: list[BlockTraining], *,
                      embeddings: bool, final_norm: bool, lm_head: bool,
                      num_labels: int | None = None, rank: int = 0) -> int:
    """Bytes of the autocast copies of weights kept for backward (autocast over fp32
    parameters only): a trained linear's weight once, a frozen linear's on each call whose
    input needs a gradient; a LoRA base none (the fused layer casts it again in backward)."""
    from scaletrain.plan.finetune.estimate import _linear_shapes

    c = DTYPE_BYTES[spec.compute_dtype]
    if c >= DTYPE_BYTES[spec.residual_dtype]:
        return 0
    shapes, grad, n = _linear_shapes(args), embeddings, 0
    for index, b in enumerate(blocks):
        g = _grads(b, grad)
        # a checkpointed region keeps no casts (it casts again when recomputed)
        inside = set(shapes) if block_scope(spec) else {"q", "k", "v", "o"}
        recomputed = inside if is_checkpointed(index, spec) else set()
        fused = frozenset() if b.dropout else b.adapted
        for name, (i, o) in shapes.items():
            if name in recomputed:
                continue
            n += i * o if name in b.linears or (name not in fused and g[name]) else 0
            if name in b.adapted and b.dropout:  # B always, A when x needs a gradient
                n += rank * o + (rank * i if g[name] else 0)
        grad = g["out"]
    if num_labels is not None:
        n += num_labels * args.dim
    elif (lm_head or grad or final_norm) and not spec.fused_loss:  # (the fused loss casts
        n += args.vocab_size * args.dim  # the head chunk by chunk and keeps no copy)
    return c * n


def finetune_activation_bytes(args: ModelArgs, spec: ActivationSpec, blocks: list[BlockTraining],
                              *, embeddings: bool, final_norm: bool, lm_head: bool,
                              num_labels: int | None = None, rank: int = 0) -> ActivationBytes:
    """Activations of one micro-batch when block i trains `blocks[i]`; `embeddings`,
    `final_norm`, `lm_head`: whether those train; `num_labels`: a classification head instead
    of the LM head and loss."""
    c, r = DTYPE_BYTES[spec.compute_dtype], DTYPE_BYTES[spec.residual_dtype]
    t, h = spec.tokens, args.dim
    layers = {"norms": 0, "attention": 0, "mlp": 0}
    grad = embeddings
    rope = recompute = 0
    rope_autograd = False
    for i, b in enumerate(blocks):
        parts, out_grad = block_bytes(args, spec, b, grad, rank)
        if out_grad:
            rope = 2 * spec.seq_len * args.head_dim * r
        wrapped = is_checkpointed(i, spec)
        rope_autograd |= out_grad and not wrapped
        # A checkpointed region keeps its input if anything in it needs a gradient.
        if wrapped and block_scope(spec) and sum(parts.values()):
            recompute = max(recompute, sum(parts.values()))
            parts = {"norms": 0, "attention": r * t * h, "mlp": 0}
        elif wrapped and parts["attention"]:
            recompute = max(recompute, parts["attention"])
            parts["attention"] = r * t * h
        for k, v in parts.items():
            layers[k] += v
        grad = out_grad
    head = _norm_part(args, spec, grad, final_norm)
    hidden_grad = grad or final_norm
    if num_labels is not None:  # gather indices, the score's input, its log-softmax
        b_ = spec.mbs
        head += 16 * b_ + c * b_ * h
        loss = 4 * b_ * num_labels + 8 * b_ + 4
    elif spec.fused_loss:  # the gradients forward computed: d loss / d h (h's dtype) and,
        # when the head trains, d loss / d W (fp32); no logits, log-softmax or targets
        head += r * t * h if hidden_grad else 0
        loss = 4 * args.vocab_size * h if lm_head else 0
    else:
        head += _inputs(args, spec, 1) if lm_head else 0
        loss = 4 * t * args.vocab_size + 8 * t + 4 if hidden_grad or lm_head else 0
    return ActivationBytes(layers=layers, embedding=8 * t if embeddings else 0,
                           rope_tables=rope, head=head, loss=loss, recompute=recompute,
                           rope_tables_autograd=rope_autograd)


def method_blocks(args: ModelArgs, method: str, *, train_last: int | None = None,
                  freeze_first: int = 0, targets: tuple[str, ...] = tuple(ALL),
                  train_norms: bool = False, freeze_embeddings: bool = True,
                  num_labels: int | None = None, lora_dropout: float = 0.0) -> dict:
    """`finetune_activation_bytes`'s keyword arguments for a method and its options."""
    n = args.n_layers
    if method == "full":  # (a classification run has no LM head: `lm_head` is then unused)
        return {"blocks": [FULL_BLOCK] * n, "embeddings": True, "final_norm": True,
                "lm_head": True}
    if method == "freeze":
        k = n - train_last if train_last is not None else freeze_first
        embeddings = not freeze_embeddings and train_last is None
        return {"blocks": [BlockTraining()] * k + [FULL_BLOCK] * (n - k),
                "embeddings": embeddings, "final_norm": True,
                "lm_head": embeddings or not args.tie_embeddings}  # a tied head freezes
    adapted = frozenset(targets) & ALL
    block = BlockTraining(frozenset(), adapted, train_norms, lora_dropout > 0)
    return {"blocks": [block] * n,
            "embeddings": False, "final_norm": train_norms, "lm_head": False}
