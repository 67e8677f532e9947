"""The sections of the config tree (`[model]`, `[data]`, `[training]`, ...): typed dataclasses
whose field docstrings are the `--help` text. `scaletrain.config` assembles them into `Config`
and loads, overrides and validates it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from scaletrain.models.args import ModelArgs


@dataclass
class ModelConfig:
    name: str = "debug"
    """Model preset (see `scaletrain models`), or a Hugging Face config.json (or its folder)
    whose dimensions to use."""
    dim: int | None = None
    """Override the preset's hidden size."""
    n_layers: int | None = None
    """Override the preset's number of transformer blocks."""
    n_heads: int | None = None
    """Override the preset's number of attention heads."""
    n_kv_heads: int | None = None
    """Override the preset's number of key/value heads (grouped-query attention)."""
    ffn_dim: int | None = None
    """Override the preset's MLP hidden size."""
    vocab_size: int | None = None
    """The model's vocabulary size. Default: the preset's, widened to the tokenizer's when that
    is larger (`data.tokenizer`, the one saved beside the first of `data.paths`, or
    `data.vocab_size` when the run trains its own); when given, it must hold the tokenizer's."""
    max_seq_len: int | None = None
    """Override the preset's maximum sequence length."""
    tie_embeddings: bool | None = None
    """Override whether the output head shares the embedding matrix."""
    rope_theta: float | None = None
    """Override the RoPE base frequency."""
    n_experts: int | None = None
    """Mixture of Experts: routed experts per block (0 = dense MLP)."""
    n_experts_per_token: int | None = None
    """Mixture of Experts: experts each token is routed to (top-k)."""
    moe_ffn_dim: int | None = None
    """Mixture of Experts: hidden size of one expert."""
    n_shared_experts: int | None = None
    """Mixture of Experts: experts every token goes through (one MLP of n x moe_ffn_dim)."""
    moe_aux_loss_coef: float | None = None
    """Mixture of Experts: weight of the load-balancing auxiliary loss (0 = off)."""
    moe_aux_loss_scope: Literal["sequence", "micro_batch"] | None = None
    """Mixture of Experts: what the auxiliary loss balances. `sequence` (default): each
    sequence on its own, averaged over the step's sequences (DeepSeek-V3, Megatron
    `seq_aux_loss`): the same objective for every layout of a global batch. `micro_batch`:
    the load of one micro-batch of all data-parallel ranks (Switch/Mixtral, transformers'
    `aux_loss`): it changes with how the global batch splits into micro-batch x accumulation x
    data-parallel ranks."""
    moe_bias_update_rate: float | None = None
    """Mixture of Experts: auxiliary-loss-free balancing bias step (DeepSeek-V3; 0 = off)."""
    moe_capacity_factor: float | None = None
    """Mixture of Experts: drop tokens beyond factor x the even share of an expert."""
    expert_compute: Literal["grouped", "loop"] | None = None
    """Mixture of Experts: one grouped GEMM for all experts, or one matmul per expert."""
    dropout: float | None = None
    """Residual dropout probability in training (embeddings, attention and MLP outputs before
    the residual add, as GPT-2); default: the preset's, 0 for every built-in one."""

    def to_model_args(self) -> ModelArgs:
        """The preset with the non-None overrides applied."""
        from scaletrain.models.source import load_model_args

        base = load_model_args(self.name)
        overrides = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "name" and getattr(self, f.name) is not None
        }
        return base.replace(**overrides)


@dataclass
class DataConfig:
    dataset: Literal["stdlib", "text_dir"] = "stdlib"
    """`stdlib`: the Python standard library's .py files on this machine; `text_dir`: the
    text files under `data.path`."""
    path: str | None = None
    """Directory of text files for `dataset = "text_dir"`."""
    stdlib_tests: bool = True
    """With `dataset = "stdlib"`: include the standard library's test suites (60% of its bytes;
    some distributions ship them separately, so turn this off for a corpus equal across them)."""
    file_glob: str = "**/*.py"
    """Which files under the corpus directory to read."""
    curate: bool = True
    """Put the built-in corpus (`stdlib`, `text_dir`) through the default code curation
    pipeline (size limits, source-file rules, exact + MinHash dedup, PII) before tokenizing;
    the result is cached with the corpus. Not applied to `data.paths` (curate those with
    `scaletrain data curate`)."""
    cache_dir: str | None = None
    """Where the tokenizer and token arrays are cached (default ~/.cache/scaletrain)."""
    vocab_size: int = 8192
    """Vocabulary size of the byte-level BPE tokenizer trained on the corpus."""
    tokenizer: str | None = None
    """An existing tokenizer.json (or HF tokenizer directory) instead of training one."""
    seq_len: int = 256
    """Tokens per training sequence."""
    val_fraction: float = 0.02
    """Share of the corpus held out for validation."""
    max_bytes: int | None = None
    """Read at most this many bytes of the corpus (for quick runs)."""
    num_workers: int = 0
    """DataLoader worker processes (0 = load in the training process)."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead (only with num_workers > 0)."""
    pin_memory: bool | None = None
    """Page-lock host batches for faster copies to the GPU (None = on when training on CUDA)."""
    persistent_workers: bool = True
    """Keep workers alive between epochs (only with num_workers > 0)."""
    paths: tuple[str, ...] = ()
    """Indexed datasets to train on (PREFIX of PREFIX.bin/.idx, e.g. from `scaletrain data
    tokenize`) instead of the built-in corpus; several are blended by `data.weights`."""
    weights: tuple[float, ...] = ()
    """Blend weight of each `data.paths` entry (empty = equal weights)."""
    blend_by: Literal["samples", "tokens"] = "samples"
    """`samples`: weights are shares of samples; `tokens`: each weight multiplies its
    dataset's token count (1.0 everywhere = mixed in proportion to size)."""
    split: str = "98,2,0"
    """Train/validation/test shares of each `data.paths` dataset's documents."""

    def __post_init__(self) -> None:
        self.paths = tuple(str(p) for p in self.paths)  # TOML gives lists
        self.weights = tuple(float(w) for w in self.weights)


@dataclass
class TrainingConfig:
    steps: int = 300
    """Number of optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass on one device."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all devices (None = micro_batch_size x grad_accum_steps
    x data-parallel degree)."""
    grad_accum_steps: int | None = None
    """Micro-batches accumulated per optimizer step (None = derived from global_batch_size)."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm to this value (None or 0 = no clipping)."""
    seed: int = 0
    """Seed for model initialization, data order and sampling."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower; for bitwise-reproducible runs)."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`."""
    eval_interval: int = 0
    """Evaluate validation loss every N steps (0 = only at the end)."""
    eval_sequences: int = 64
    """Validation sequences per evaluation (the first N of the split, shared out over the
    data-parallel ranks; 0 = the whole split). The same N gives the same value for every layout
    and micro-batch size."""
    on_nan: Literal["stop", "skip"] = "stop"
    """What to do when the loss is NaN/inf: stop the run, or skip the optimizer step."""
    sample_tokens: int = 48
    """New tokens generated as a sample at the end of training (0 = none)."""
    fused_loss: bool = False
    """Compute the output head and cross-entropy chunk by chunk over tokens, never holding the
    full (tokens x vocabulary) logits (same loss and gradients). Runs in every layout; under
    tensor parallelism it is vocabulary-parallel (each TP rank computes only its vocabulary
    slice), under pipeline parallelism on the last stage; fine-tuning runs it for SFT.
    Validation takes the same path."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the fused loss. Each chunk's fp32 logits (and their gradient) are
    transient: 1,024 tokens x a 128K vocabulary is 0.5 GiB each, a quarter of a 4,096-token
    micro-batch's, at the same FLOPs."""
    skip_memory_check: bool = False
    """Start even when the plan's peak memory per rank is far above what the device has (more
    than 1.5x the GPU's memory, or 2x the host's available RAM on CPU); by default such a run
    stops before set-up with exit code 3 and the cheapest change that fits."""
    cpu_mmap_threshold_mb: float = 4.0
    """CPU runs on glibc: tensors of this many MiB or more are mmapped and given back to the
    system when freed, smaller ones come from the C heap (`mallopt(M_MMAP_THRESHOLD)`, set
    before the data and model are built). With `cpu_malloc_trim` it keeps the peak memory what
    the plan states (docs/plan.md); 0 leaves glibc's threshold as it comes (it then rises to
    32 MiB and the heap keeps freed tensors resident: 7-38 % above the plan).
    `MALLOC_MMAP_THRESHOLD_` in the environment takes precedence."""
    cpu_malloc_trim: bool = True
    """CPU runs on glibc: give the C heap's free pages back to the system before the memory
    baseline and after every forward pass (`malloc_trim(0)`), so freed temporaries do not stay
    resident under the peak. Costs CPU time (pages faulted in again): false turns it off."""


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "sgd", "adafactor", "adamw8bit"] = "adamw"
    """Optimizer (adamw8bit needs the `quant` extra: bitsandbytes)."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms, biases and embeddings' positions)."""
    beta1: float = 0.9
    """Adam beta1 (also the SGD momentum)."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """Kernel choice for AdamW/SGD: `auto` takes fused where the device supports it."""
    offload: bool = False
    """Keep fp32 master weights and optimizer state in CPU memory and step there."""


@dataclass
class LRScheduleConfig:
    warmup_steps: int = 30
    """Linear warmup from 0 to the peak learning rate."""
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Shape after warmup; `wsd` holds the peak then decays linearly at the end."""
    decay_fraction: float = 0.2
    """For `wsd`: share of the steps spent decaying."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""


@dataclass
class PrecisionConfig:
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Autocast dtype of forward/backward. `auto`: bf16 on CUDA with bf16 support and on CPUs with
    AVX-512 bf16 instructions, else fp32."""
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the model's parameters; bf16 keeps fp32 master weights in the optimizer."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 matmuls through torchao's float8 linears (scaling per tensor or per row): CUDA with
    compute capability >= 8.9, torchao installed, bf16 autocast, one process; refused elsewhere."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "partial", "selective"] = "none"
    """`full`: recompute every block in backward; `partial`: every `every`-th block (or its
    attention part, `scope`). `selective` is refused as ambiguous: Megatron-LM's selective
    recomputation (core attention only) is what SDPA/flash attention already does (`none`
    here)."""
    every: int = 2
    """Partial: checkpoint every n-th block."""
    scope: Literal["block", "attention"] = "block"
    """Partial: recompute the whole block, or only its attention part."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """torch.compile each transformer block (and the loss)."""
    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """torch.compile mode."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save a checkpoint every N steps (0: by `interval_minutes` only)."""
    interval_minutes: float = 30.0
    """Also save when this many minutes of training have passed since the last save or the
    start (0: off); rank 0's clock decides, every rank saves at the same step."""
    keep_last: int = 2
    """How many recent checkpoints to keep."""
    resume: bool | Literal["auto"] = "auto"
    """`auto`: continue from the newest complete, verified checkpoint under
    `<output>/checkpoints` and start fresh when there is none; `true`: continue, and fail when
    there is none; `false`: start fresh."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    verify: bool = True
    """Check every checkpoint file against the content hashes of its manifest before loading
    (resume, fine-tuning base); turn off only for huge checkpoints on trusted storage."""
    async_save: bool = False
    """Write checkpoints in the background: training stalls only while the state is copied to
    host memory (which then holds a second copy of it until the write ends)."""
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals that stop the run at the next step boundary with a checkpoint (exit 75, a
    preemption: run the same command again to continue). Empty: the default actions."""
    allow_schedule_change: bool = False
    """On resume, accept a learning-rate schedule (training.steps, optimizer.lr, lr_schedule.*)
    whose rate differs from the checkpoint's at a step both schedules have (a remaining step,
    or a trained one: extending a decaying schedule)."""
    allow_batch_change: bool = False
    """On resume, accept another global batch size: the run continues from the number of
    samples consumed (as Megatron-LM does)."""
    allow_update_change: bool = False
    """On resume, accept settings that change the optimizer step (optimizer.name, weight_decay,
    beta1, beta2, eps, training.max_grad_norm, precision.dtype, param_dtype, fp8)."""

    def __post_init__(self) -> None:
        self.signals = tuple(self.signals)  # TOML gives a list


METRICS_LOGGERS = ("tensorboard", "wandb", "mlflow")


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Print a metrics line every N steps (metrics.jsonl gets every step)."""
    tensorboard: bool = True
    """Write TensorBoard event files under `<output>/tb` (needs the `tb` extra); false takes
    `tensorboard` out of `loggers`."""
    progress_bar: bool = True
    """Show a progress bar on the terminal."""
    loggers: tuple[str, ...] = ("tensorboard",)
    """Experiment trackers that get every step's metrics, the plan and (with profiling) the
    verdict: any of `tensorboard`, `wandb` (offline with WANDB_MODE=offline; files under
    `<output>/wandb`), `mlflow` (a local store `<output>/mlruns` unless
    `mlflow_tracking_uri`/MLFLOW_TRACKING_URI says otherwise). W&B and MLflow need the
    `integrations` extra. See docs/integrations.md."""
    wandb_project: str = "scaletrain"
    """W&B project of the run (the run is named after `output`)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (a server, `sqlite:///file.db`, `file:/dir`); default the
    MLFLOW_TRACKING_URI variable, else `<output>/mlruns`."""
    mlflow_experiment: str = "scaletrain"
    """MLflow experiment the run goes to."""

    def __post_init__(self) -> None:
        self.loggers = tuple(self.loggers)  # TOML gives a list

    @property
    def active_loggers(self) -> tuple[str, ...]:
        """`loggers` less `tensorboard` when `tensorboard` is false."""
        return tuple(n for n in self.loggers if n != "tensorboard" or self.tensorboard)


@dataclass
class ProfilingConfig:
    enabled: bool = False
    """Run torch.profiler over some steps (traces under `<output>/profile`; see docs/profile.md)."""
    wait: int = 1
    """Profiler schedule: steps skipped before each profiling cycle."""
    warmup: int = 1
    """Profiler schedule: steps traced but discarded (tracing overhead settles)."""
    active: int = 3
    """Profiler schedule: steps recorded per cycle (GPU analyses leave out the last one)."""
    repeat: int = 1
    """Profiler schedule: number of cycles (0 = until training ends)."""
    record_shapes: bool = True
    """Record operator input shapes."""
    profile_memory: bool = True
    """Record allocations (peak memory and its phase in `scaletrain diagnose`)."""
    with_stack: bool = False
    """Record Python stacks (bigger traces)."""
    memory_timeline: bool = False
    """Export the memory timeline by category (implies with_stack; slow on long runs)."""
    oom_snapshot: bool = True
    """On CUDA: dump the allocator snapshot when a step runs out of memory (with allocation
    stacks while profiling), beside the plan's estimate; open it at pytorch.org/memory_viz."""
    nsys: bool = False
    """On CUDA: call cudaProfilerStart/Stop around the active steps, for
    `nsys profile --capture-range=cudaProfilerApi`."""
    output_dir: str | None = None
    """Where profiling output goes (default `<output>/profile`)."""


@dataclass
class ParallelConfig:
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP; the replicate dimension of HSDP)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP/ZeRO); -1 = whatever the world size leaves."""
    cp: int = 1
    """Context-parallel degree (the sequence split across ranks for attention)."""
    tp: int = 1
    """Tensor-parallel degree (keep it inside a node)."""
    ep: int = 1
    """Expert-parallel degree (Mixture-of-Experts models): each MoE layer's experts are split
    over `ep` ranks borrowed from `dp_shard` (which it must divide); tokens reach their experts
    by all-to-all. The global batch does not change."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B or a zero-bubble schedule."""
    pp_microbatches: int | None = None
    """Micro-batches the pipeline schedule runs at a time (None = all the step's
    gradient-accumulation steps in one run). A divisor k of the accumulation steps m runs the
    schedule m / k times per step: torch keeps one receive buffer per micro-batch of a run
    (and, under FSDP, the stage gathered with unsharded gradients until the run's last
    backward), so k bounds that memory, at a bubble of (p - 1) / k instead of (p - 1) / m and
    one FSDP gradient reduction per run."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules use more than 1)."""
    data_parallel: Literal["auto", "ddp", "zero1", "zero2", "zero3"] = "auto"
    """How data-parallel ranks hold the model. `ddp`: replicas, gradients all-reduced;
    `zero1`: replicas + optimizer state partitioned (also with TP/PP); `zero2`/`zero3`: FSDP2
    over dp_shard (HSDP when dp_replicate > 1), parameters kept gathered after forward (zero2)
    or resharded (zero3).
    `auto`: zero3 when sharding, else ddp."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size (MB): bigger buckets, fewer all-reduces, later overlap."""
    fsdp_param_dtype: Literal["fp32", "bf16"] = "fp32"
    """FSDP mixed precision: dtype of gathered parameters in forward/backward (master weights
    and optimizer state stay fp32)."""
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """FSDP mixed precision: dtype of gradient reduction."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in host memory."""
    sequence_parallel: bool = True
    """Tensor parallel: shard norms and the residual stream along the sequence."""
    loss_parallel: bool = True
    """Tensor parallel: cross-entropy on vocabulary-sharded logits (no full-logits gather)."""
    cp_load_balance: bool = True
    """Context parallel: head-tail chunk assignment so causal attention work is even."""
    timeout_s: float = 600.0
    """Collective timeout (seconds) during start-up and checkpoint saves: if a rank stops
    answering, the others fail after this."""
    step_timeout_s: float = 300.0
    """Collective timeout (seconds) once the first step has run: a rank that stops answering is
    named after this, and every rank's Python stack is written to `<output>/stacks/`."""


@dataclass
class FinetuneConfig:
    base: str | None = None
    """Model to adapt: a Hugging Face directory, a native checkpoint or a training run."""
    method: Literal["full", "freeze", "lora", "qlora"] = "lora"
    """`full`: every weight; `freeze`: some weights frozen (see freeze_*); `lora`: low-rank
    adapters on a frozen base; `qlora`: the same on a 4-bit NF4 base (bitsandbytes)."""
    task: Literal["sft", "classification"] = "sft"
    """`sft`: prompt/response or chat JSON lines, loss on responses; `classification`: text +
    label JSON lines, a head on the last non-padding token."""
    data: str | None = None
    """JSON-lines file of training examples (a held-out split is taken for validation)."""
    val_data: str | None = None
    """Optional JSON-lines validation file (default: data.val_fraction of `data`)."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is B A x * alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch input."""
    lora_targets: str = "q,k,v,o,gate,up,down"
    """Comma-separated modules that get adapters: q, k, v, o, gate, up, down (or HF names)."""
    train_biases: bool = False
    """Not supported (refused): LoRA adapters are written for PEFT with bias 'none'; train
    biases with method full or freeze."""
    train_norms: bool = False
    """LoRA/QLoRA: also train the normalization weights."""
    freeze_embeddings: bool = True
    """`freeze`: freeze the token (and position) embeddings."""
    freeze_first: int = 0
    """`freeze`: freeze the first N transformer blocks."""
    train_last: int | None = None
    """`freeze`: freeze everything except the last K blocks, the final norm and the head."""
    quant_compute_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """QLoRA: dtype the 4-bit weights are dequantized to for matmuls (auto: bf16 where the
    device is fast at it, else fp32)."""
    labels: str | None = None
    """Classification: comma-separated label names (default: the sorted labels of the data)."""
    packing: bool = True
    """SFT: pack several short examples into one sequence (attention stays inside each)."""
    allow_base_mismatch: bool = False
    """LoRA/QLoRA resume: continue even if the base checkpoint's content hash differs from the
    one recorded in finetune.json (the adapter was trained on other weights)."""
