"""Activation bytes that scaletrain's own Transformer keeps for backward, per component.

Derived from `models/transformer.py` (and checked against `saved_tensors_hooks` counts in the
tests), one micro-batch, one rank. Notation: T tokens of the micro-batch on this rank
(b * s / cp), h = dim, f = ffn width, a / g query / key-value heads, d head_dim, V vocabulary,
c bytes of the compute dtype (autocast dtype, or the parameter dtype without autocast), r bytes of
the residual stream (the parameter dtype: fp32 parameters under autocast keep an fp32 residual).

Llama block (flash SDPA: no s x s scores; true for the CPU flash kernel and CUDA flash/cuDNN):
- RMSNorm (x2): `x.float()` (4Th), the rstd (4T) and, on CPU where rms_norm is composite,
  x * rstd (4Th); the fused CUDA kernel keeps only x and rstd. A 16-bit residual stream
  (bf16 parameters) goes through `_RMSNormFn`: the input in its own dtype (r Th) and the rstd
  (4T), on every device (also the sequence-parallel norms, whose inputs are DTensors).
- its output feeds the projections: one saved tensor (c T h) when c == r; under autocast with
  an fp32 residual each projection saves its own c-byte cast (3 for q/k/v, 2 for w1/w3, 1 for
  the head).
- attention: q and k after RoPE (c T a d, c T g d), v (c T g d), the output (c T a d, shared with
  the wo input) and the log-sum-exp (4 b a s, fp32).
- SwiGLU/GeGLU: w1 x and w3 x (`_GatedAct` recomputes the activation in backward) and the
  product, the down projection's input (3 c T f; the eager composite kept 4).
- once per model: the token ids (8 B each), the RoPE tables (2 s d r, shared by all layers), the
  final norm and head input, and the loss's fp32 log-softmax (4 T V) with int64 targets.

Family extras (`ModelArgs`): Gemma 2's post-norms are two more RMSNorms; Qwen3's q/k norms keep
their fp32 input and rstd over (T, heads, d); soft-capped attention (Gemma 2) is computed
explicitly and keeps the tanh of the s x s scores and the fp32 and cast probabilities, K/V
repeated to every query head and the mask, instead of the log-sum-exp; capped output logits
keep their tanh output. A sliding window runs in SDPA with a mask and keeps what the flash
kernel keeps.

Mixture-of-Experts block: see `_moe` (the routed (token, expert) pairs replace the tokens).

GPT-2 block: LayerNorm keeps its input plus fp32 mean and rstd (r Th + 8T), GELU keeps its input,
w2 its output (2 c T f), learned positions keep the position ids.

Tensor parallel (degree t) divides heads, ffn width and vocabulary; sequence parallel also
divides the norm and residual tensors by t, and the q/k/v and w1/w3 projections keep only the
sequence shard of their input (one c-byte copy per module, gathered again in backward:
`parallel/sp_regather.py`); with `sp_regather=False` (DTensor's path) they keep the gathered
input. The head still keeps its gathered input (once per model). Context parallel divides T
by cp; with the all-gather-KV scheme each rank keeps the gathered keys and values of the whole
sequence.

Recomputation (`parallel/activation_checkpoint.py`): a checkpointed block keeps only its input
(r T h); a checkpointed attention keeps its input (the norm output, r T h) and the rest of the
block as usual. `partial` checkpoints every `every`-th block (or its attention). While a
checkpointed region is recomputed in backward its activations exist once more (`recompute`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scaletrain.config_sections import TrainingConfig
from scaletrain.models.args import ModelArgs

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
Kernels = Literal["cpu", "cuda"]
RecomputeMode = Literal["none", "partial", "full"]


@dataclass(frozen=True)
class ActivationSpec:
    """What the activation estimate depends on besides the model dimensions."""

    mbs: int
    seq_len: int
    compute_dtype: str = "fp32"
    residual_dtype: str = "fp32"
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    recompute: RecomputeMode = "none"
    every: int = 2
    scope: Literal["block", "attention"] = "block"
    kernels: Kernels = "cuda"
    sp_regather: bool = True
    """Sequence parallel: the column-wise projections save their input's sequence shard and
    all-gather it again in backward (`parallel/sp_regather.py`, the trainer's path); False:
    DTensor's path, which saves the gathered input."""
    fused_loss: bool = False
    """`training.fused_loss`: the head and cross-entropy chunk by chunk (`train/chunked_loss`)."""
    loss_chunk: int = TrainingConfig.loss_chunk_tokens
    """Tokens per chunk of the fused loss (`training.loss_chunk_tokens`)."""

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one context-parallel rank."""
        return self.mbs * self.seq_len // self.cp

    @property
    def norm_tokens(self) -> int:
        """Tokens of the norm/residual tensors (divided by t under sequence parallel)."""
        return self.tokens // self.tp if self.sequence_parallel and self.tp > 1 else self.tokens


def _norm(args: ModelArgs, spec: ActivationSpec, input_bytes: int | None = None) -> int:
    """One norm over the residual stream (or, with `input_bytes`, over a projection's
    output, as Gemma 2's post-norms)."""
    tn, h = spec.norm_tokens, args.dim
    r = DTYPE_BYTES[spec.residual_dtype] if input_bytes is None else input_bytes
    if args.arch == "gpt2":  # native layer_norm: the input as it comes, fp32 mean and rstd
        return r * tn * h + 8 * tn
    if r < 4:  # `_RMSNormFn` (also on sequence-parallel DTensors): the 16-bit input and
        return r * tn * h + 4 * tn  # the fp32 1/rms
    extra = 4 * tn * h if spec.kernels == "cpu" else 0
    return 4 * tn * h + 4 * tn + extra


def _norm_output(args: ModelArgs, spec: ActivationSpec, consumers: int,
                 regathered: bool = False) -> int:
    """What the projections reading a norm's output save of it: the output itself (c == r) or
    each projection's cast of it (autocast over an fp32 residual); with `regathered` (the
    attention and MLP inputs under sequence parallelism) one c-byte copy of the sequence shard
    for all of them."""
    c, r = DTYPE_BYTES[spec.compute_dtype], DTYPE_BYTES[spec.residual_dtype]
    if regathered and spec.tp > 1 and spec.sequence_parallel and spec.sp_regather:
        return c * spec.norm_tokens * args.dim
    copies = 1 if c == r else consumers
    return copies * c * spec.tokens * args.dim


def _attention_core(args: ModelArgs, spec: ActivationSpec) -> int:
    c, t, d = DTYPE_BYTES[spec.compute_dtype], spec.tp, args.head_dim
    a, g = args.n_heads // t, args.kv_heads // t
    kv_tokens = spec.mbs * spec.seq_len if spec.cp > 1 else spec.tokens
    q_and_out = 2 * c * spec.tokens * a * d
    k_and_v = 2 * c * kv_tokens * g * d
    lse = 4 * spec.mbs * a * (spec.seq_len // spec.cp)
    if args.attn_softcap is not None:  # explicit attention: s x s scores instead of the lse,
        # K/V repeated to every query head, the boolean mask
        s_q, s_k = spec.seq_len // spec.cp, kv_tokens // spec.mbs
        per_score = c + 4 + (0 if c == 4 else c)  # tanh output, fp32 softmax, its cast
        lse = per_score * spec.mbs * a * s_q * s_k + s_q * s_k
        k_and_v = 2 * c * kv_tokens * a * d
    qk_norms = 0
    if args.qk_norm:
        if c < 4:  # `_RMSNormFn`: the 16-bit q/k and the fp32 1/rms per head
            qk_norms = (c * spec.tokens * d + 4 * spec.tokens) * (a + g)
        else:
            per = 2 if spec.kernels == "cpu" else 1  # fp32 input (+ x * rstd on CPU), rstd
            qk_norms = (4 * per * spec.tokens * d + 4 * spec.tokens) * (a + g)
    return q_and_out + k_and_v + lse + qk_norms


def _mlp(args: ModelArgs, spec: ActivationSpec) -> int:
    """GELU MLP: the GELU input and the down projection's input; gated MLP: its two inputs
    (w1 x and w3 x, `_GatedAct` recomputes the activation) and the down projection's input."""
    c, f = DTYPE_BYTES[spec.compute_dtype], args.hidden_dim // spec.tp
    n = 2 if args.arch == "gpt2" else 3
    return n * c * spec.tokens * f


def _moe(args: ModelArgs, spec: ActivationSpec) -> int:
    """A Mixture-of-Experts MLP (`models/moe.py`), Tk = T x k routed (token, expert) pairs:
    the fp32 router input and probabilities (4Th + 4TE), the top-k ids, weights and their sum
    (8Tk + 4Tk + 4T), the sort and unsort indices (16Tk), the sorted tokens (c Tk h), the
    expert offsets (4E), each expert's SwiGLU (4 c Tk f), the unsorted outputs and gate values
    of the weighted sum (c Tk h + c Tk); shared experts as a dense SwiGLU of their width."""
    c, r = DTYPE_BYTES[spec.compute_dtype], DTYPE_BYTES[spec.residual_dtype]
    t, h, e, k = spec.tokens, args.dim, args.n_experts, args.n_experts_per_token
    tk = t * k
    router = 4 * t * h + 4 * t * e + 12 * tk + 4 * t
    # Tensor parallel: each rank runs the pairs of its 1/t of the experts (the sorted tokens
    # and the combined outputs stay whole).
    routed = 16 * tk + 2 * c * tk * h + 4 * e + 4 * c * tk * args.expert_hidden_dim // spec.tp \
        + c * tk
    shared = 0
    if args.n_shared_experts:
        shared_in = 0 if c == r == 4 else (c * t * h if c == r else 2 * c * t * h)
        shared = shared_in + 4 * c * t * args.shared_expert_hidden_dim // spec.tp
    return router + routed + shared


def plain_layer(args: ModelArgs, spec: ActivationSpec) -> dict[str, int]:
    """Bytes one block without recomputation keeps, by component."""
    n_mlp_in = 1 if args.arch == "gpt2" else 2
    mlp = (_moe(args, spec) if args.is_moe
           else _norm_output(args, spec, n_mlp_in, regathered=True) + _mlp(args, spec))
    return {
        "norms": 2 * _norm(args, spec) + (2 * _norm(args, spec, DTYPE_BYTES[spec.compute_dtype])
                                          if args.post_norms else 0),
        "attention": _norm_output(args, spec, 3, regathered=True) + _attention_core(args, spec),
        "mlp": mlp,
    }


def checkpointed_layer(args: ModelArgs, spec: ActivationSpec, scope: str) -> dict[str, int]:
    """Bytes a block keeps when it (scope `block`) or its attention is checkpointed."""
    r = DTYPE_BYTES[spec.residual_dtype]
    if scope == "block":
        return {"norms": 0, "attention": r * spec.norm_tokens * args.dim, "mlp": 0}
    plain = plain_layer(args, spec)
    return {"norms": plain["norms"], "attention": r * spec.norm_tokens * args.dim,
            "mlp": plain["mlp"]}


def is_checkpointed(index: int, spec: ActivationSpec) -> bool:
    """Mirrors `apply_ac`: which block indices are wrapped."""
    if spec.recompute == "none":
        return False
    if spec.recompute == "full":
        return True
    return index % spec.every == spec.every - 1


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro-batch on one rank, by component."""

    layers: dict[str, int]
    embedding: int
    rope_tables: int
    head: int
    loss: int
    recompute: int
    rope_tables_autograd: bool
    """Whether autograd saves the RoPE tables (a checkpoint keeps them outside its hooks)."""

    @property
    def saved(self) -> int:
        """Bytes kept from forward to backward (what saved_tensors_hooks count, plus the RoPE
        tables when a checkpoint holds them)."""
        return (sum(self.layers.values()) + self.embedding + self.rope_tables + self.head
                + self.loss)

    @property
    def autograd_saved(self) -> int:
        """Only what autograd's saved-tensor hooks see (for the measurement)."""
        return self.saved - (0 if self.rope_tables_autograd else self.rope_tables)


def activation_bytes(args: ModelArgs, spec: ActivationSpec, layer_indices: range | None = None,
                     first_stage: bool = True, last_stage: bool = True) -> ActivationBytes:
    """Activations of the blocks `layer_indices` (default: all) for one micro-batch.

    `first_stage` adds the embedding's saved ids, `last_stage` the final norm, head input and
    loss (pipeline stages hold only their own part).
    """
    indices = range(args.n_layers) if layer_indices is None else layer_indices
    r = DTYPE_BYTES[spec.residual_dtype]
    layers = {"norms": 0, "attention": 0, "mlp": 0}
    plain = plain_layer(args, spec)
    ckpt = checkpointed_layer(args, spec, "block" if spec.recompute == "full" else spec.scope)
    rope_seen = False
    for i in indices:
        wrapped = is_checkpointed(i, spec)
        rope_seen |= not wrapped
        for k, v in (ckpt if wrapped else plain).items():
            layers[k] += v
    t_ids = spec.tokens
    embedding = 8 * t_ids if first_stage else 0
    if first_stage and args.arch == "gpt2":
        embedding += 8 * (spec.seq_len // spec.cp)
    rope = 0
    if args.arch == "llama" and len(indices):
        rope = 2 * (spec.seq_len // spec.cp) * args.head_dim * r
    head = loss = 0
    if last_stage and spec.fused_loss:
        # Forward already computes the gradients backward needs and keeps them: d loss / d h
        # (h's dtype, the whole sequence on every TP rank) and d loss / d W of the local vocab
        # rows (fp32); no logits, log-softmax or targets are kept.
        head = _norm(args, spec) + DTYPE_BYTES[spec.residual_dtype] * t_ids * args.dim
        loss = 4 * (args.vocab_size // spec.tp) * args.dim
    elif last_stage:
        head = _norm(args, spec) + _norm_output(args, spec, 1)
        loss = 4 * t_ids * args.vocab_size // spec.tp + 8 * t_ids + 4
        if args.final_softcap is not None:  # tanh keeps its output: the capped logits
            head += DTYPE_BYTES[spec.compute_dtype] * t_ids * args.vocab_size // spec.tp
    recompute = 0
    if spec.recompute != "none" and len(indices):
        # The largest checkpointed region is rebuilt during its backward.
        region = sum(plain.values()) if spec.recompute == "full" or spec.scope == "block" \
            else plain["attention"]
        recompute = region
    return ActivationBytes(layers=layers, embedding=embedding, rope_tables=rope, head=head,
                           loss=loss, recompute=recompute,
                           rope_tables_autograd=rope_seen and args.arch == "llama")


def held_logits_bytes(args: ModelArgs, spec: ActivationSpec) -> int:
    """The logits a pipeline's last stage keeps per micro-batch between its forward and its
    backward: torch's stage holds its output (`PipelineStage.fwd_cache`) until then, so where
    several micro-batches wait for their backward (GPipe; the last chunk of the interleaved
    schedules) each keeps its (tokens x vocabulary) logits in the compute dtype. One process
    holds one micro-batch's, which `logits_buffer_bytes` counts. None with the fused loss: the
    stage's output is then the hidden states, counted in the head's activations."""
    if spec.fused_loss:
        return 0
    return DTYPE_BYTES[spec.compute_dtype] * spec.tokens * (args.vocab_size // spec.tp)


def logits_buffer_bytes(args: ModelArgs, spec: ActivationSpec) -> int:
    """Transient loss memory beyond the saved log-softmax: the logits themselves (c bytes, alive
    through backward) and two fp32 gradient buffers of logits size in the loss backward. Under
    tensor parallelism the loss is vocabulary-parallel (DTensor's `loss_parallel`, the
    trainer's default), whose backward holds three: the scattered one-hot, exp(log-softmax)
    and their sum (`torch.distributed.tensor.parallel.loss`). The fused loss holds one chunk
    at a time: its fp32 logits, the fp32 softmax-minus-one-hot and that gradient's copy in the
    compute dtype."""
    c = DTYPE_BYTES[spec.compute_dtype]
    vocab = args.vocab_size // spec.tp
    if spec.fused_loss:
        return (8 + (c if c < 4 else 0)) * min(spec.loss_chunk, spec.tokens) * vocab
    grads = 12 if spec.tp > 1 else 8
    return (c + grads) * spec.tokens * vocab


def deferred_weight_grad_bytes(args: ModelArgs, spec: ActivationSpec, layers: int,
                               head: bool) -> int:
    """What a zero-bubble schedule's input-gradient pass keeps for its deferred weight-gradient
    pass, per micro-batch of a chunk of `layers` blocks, beyond the activations (which the
    retained graph also keeps): torch's `stage_backward_input` records the gradient at the
    output of every autograd node that takes a weight (each Linear's output; each norm's
    weight multiply) until W runs. Dense block: q, k, v (c T (a + 2g) d), the attention
    output (c T h), w1 and w3 (2 c T f), w2 (c T h) or GPT-2's two MLP matrices, the norms
    (r Tn h each; Gemma 2's post-norms, on projection outputs, c Tn h); MoE: the router's
    fp32 logits and each routed pair's expert outputs; the head's logits gradient (c T V) on
    the last chunk."""
    c, r = DTYPE_BYTES[spec.compute_dtype], DTYPE_BYTES[spec.residual_dtype]
    t, tn, h, tp = spec.tokens, spec.norm_tokens, args.dim, spec.tp
    a, g = args.n_heads // tp, args.kv_heads // tp
    attention = c * t * (a + 2 * g) * args.head_dim + c * t * h
    if args.is_moe:
        tk = t * args.n_experts_per_token
        mlp = 4 * t * args.n_experts + c * tk * (2 * args.expert_hidden_dim // tp + h)
        if args.n_shared_experts:
            mlp += c * t * (2 * args.shared_expert_hidden_dim // tp + h)
    else:
        gates = 1 if args.arch == "gpt2" else 2
        mlp = c * t * gates * (args.hidden_dim // tp) + c * t * h
    norms = 2 * r * tn * h + (2 * c * tn * h if args.post_norms else 0)  # post-norms: on c
    if args.qk_norm:
        norms += c * t * (a + g) * args.head_dim
    out = layers * (attention + mlp + norms)
    if head:
        out += r * tn * h + (0 if spec.fused_loss else c * t * args.vocab_size // tp)
    return out
