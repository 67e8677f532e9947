"""The one config tree: typed dataclasses, TOML presets, `--section.field value` overrides.

Each field's docstring is its `--help` text. `load_config` reads a TOML preset, applies the
command-line overrides (parsed by tyro) and validates the result; every problem is reported
as a `ConfigError` whose message names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scaletrain.models.args import PRESETS, ModelArgs, get_preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A config value or file that cannot be used; the message says what to change."""


@dataclass
class ModelConfig:
    name: str = "debug"
    """Model preset (see `scaletrain models`)."""
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
    """Override the preset's vocabulary size (must hold the tokenizer's vocabulary)."""
    max_seq_len: int | None = None
    """Override the preset's maximum sequence length."""
    tie_embeddings: bool | None = None
    """Override whether the output head shares the embedding matrix."""
    rope_theta: float | None = None
    """Override the RoPE base frequency."""

    def to_model_args(self) -> ModelArgs:
        """The preset with the non-None overrides applied."""
        base = get_preset(self.name)
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
    eval_batches: int = 8
    """Micro-batches of validation data per evaluation."""
    on_nan: Literal["stop", "skip"] = "stop"
    """What to do when the loss is NaN/inf: stop the run, or skip the optimizer step."""
    sample_tokens: int = 48
    """New tokens generated as a sample at the end of training (0 = none)."""


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


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective"] = "none"
    """`full`: recompute every block in backward; `selective`: see `every` and `scope`."""
    every: int = 2
    """Selective: checkpoint every n-th block."""
    scope: Literal["block", "attention"] = "block"
    """Selective: recompute the whole block, or only its attention part."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """torch.compile each transformer block (and the loss)."""
    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """torch.compile mode."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    keep_last: int = 2
    """How many recent checkpoints to keep."""
    resume: bool = False
    """Continue from the latest checkpoint under `<output>/checkpoints`."""
    save_final: bool = True
    """Save a checkpoint after the last step."""


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Print a metrics line every N steps (metrics.jsonl gets every step)."""
    tensorboard: bool = True
    """Write TensorBoard event files under `<output>/tb` (needs the `tb` extra)."""
    progress_bar: bool = True
    """Show a progress bar on the terminal."""


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
    pp_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B or a zero-bubble schedule."""
    pp_microbatches: int | None = None
    """Pipeline micro-batches per step (None = the gradient-accumulation steps)."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules use more than 1)."""
    data_parallel: Literal["auto", "ddp", "zero1", "zero2", "zero3"] = "auto"
    """How data-parallel ranks hold the model. `ddp`: replicas, gradients all-reduced;
    `zero1`: DDP + optimizer state sharded; `zero2`/`zero3`: FSDP2 over dp_shard (HSDP when
    dp_replicate > 1), parameters kept gathered after forward (zero2) or resharded (zero3).
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
    """Collective timeout (seconds): if a rank stops answering, the others fail after this."""


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
    """LoRA/QLoRA: also train the base model's biases (GPT-2 style models have them)."""
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


@dataclass
class Config:
    output: str = "runs/default"
    """Run directory: metrics, checkpoints, TensorBoard logs, the resolved config."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    compile: CompileConfig = field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    @property
    def grad_accum_steps(self) -> int:
        """Accumulation steps after validation (global / (micro x data-parallel))."""
        return resolve_batch(self.training, dp=1)[1]

    @property
    def global_batch_size(self) -> int:
        return resolve_batch(self.training, dp=1)[0]


# --- TOML --------------------------------------------------------------------------------------
def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested dicts; unknown keys get the nearest valid name."""
    return _build(Config, data, source)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean '{near[0]}'?" if near else f" Valid keys: {', '.join(fields)}."
            raise ConfigError(f"{where}: unknown key '{key}'.{hint}")
        default = fields[key].default_factory  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{key}' must be a table ([{key}])")
            kwargs[key] = _build(default, value, f"{where}.{key}")  # type: ignore[arg-type]
        else:
            kwargs[key] = value
    return cls(**kwargs)


def read_toml(path: str | Path) -> Config:
    """Read a preset name (`debug` -> configs/debug.toml) or a TOML file path."""
    p = Path(path)
    preset = CONFIG_DIR / f"{path}.toml"
    # A bare name is a preset, dots included ("llama3.2-1b" has no ".toml" suffix).
    if not p.exists() and p.suffix != ".toml" and len(p.parts) == 1 and preset.exists():
        p = preset
    if not p.exists():
        presets = ", ".join(sorted(x.stem for x in CONFIG_DIR.glob("*.toml")))
        raise ConfigError(f"config file '{path}' not found (built-in presets: {presets})")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    return config_from_dict(data, source=str(p))


def to_toml(cfg: Config) -> str:
    """Serialize a Config (None values are left out, as TOML has no null)."""
    lines: list[str] = []
    top = {k: v for k, v in dataclasses.asdict(cfg).items() if not isinstance(v, dict)}
    for k, v in top.items():
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in dataclasses.asdict(cfg).items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            lines.extend(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items() if vv is not None)
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


# --- validation --------------------------------------------------------------------------------
def resolve_batch(t: TrainingConfig, dp: int) -> tuple[int, int]:
    """(global batch, accumulation steps) from the batch fields; GBS = MBS x GA x DP."""
    per_step = t.micro_batch_size * dp
    if t.global_batch_size is None:
        ga = t.grad_accum_steps or 1
        return per_step * ga, ga
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"micro_batch_size x data-parallel degree ({t.micro_batch_size} x {dp} = {per_step})"
        )
    ga = t.global_batch_size // per_step
    if t.grad_accum_steps is not None and t.grad_accum_steps != ga:
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must equal micro_batch_size x "
            f"grad_accum_steps x data-parallel degree ({t.micro_batch_size} x "
            f"{t.grad_accum_steps} x {dp} = {per_step * t.grad_accum_steps}); set only two of them"
        )
    return t.global_batch_size, ga


def validate(cfg: Config) -> list[str]:
    """Every problem in `cfg`, each one sentence naming the field and the fix."""
    errors: list[str] = []
    if cfg.model.name not in PRESETS:
        near = difflib.get_close_matches(cfg.model.name, PRESETS, n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        errors.append(f"model.name: unknown preset '{cfg.model.name}'.{hint}")
    else:
        try:
            args = cfg.model.to_model_args()
        except ValueError as e:
            errors.append(f"model: {e}")
        else:
            if cfg.data.seq_len > args.max_seq_len:
                errors.append(
                    f"data.seq_len ({cfg.data.seq_len}) exceeds model max_seq_len "
                    f"({args.max_seq_len}); lower it or set --model.max_seq_len"
                )
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_schedule
    positive = {
        "training.steps": t.steps, "training.micro_batch_size": t.micro_batch_size,
        "training.eval_batches": t.eval_batches, "data.seq_len": cfg.data.seq_len,
        "data.vocab_size": cfg.data.vocab_size, "data.prefetch_factor": cfg.data.prefetch_factor,
        "metrics.log_interval": cfg.metrics.log_interval,
        "activation_checkpoint.every": cfg.activation_checkpoint.every,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
    }
    for name, value in positive.items():
        if value <= 0:
            errors.append(f"{name} must be positive (got {value})")
    non_negative = {
        "optimizer.lr": o.lr, "optimizer.weight_decay": o.weight_decay, "optimizer.eps": o.eps,
        "lr_schedule.warmup_steps": s.warmup_steps, "training.eval_interval": t.eval_interval,
        "checkpoint.interval": cfg.checkpoint.interval, "data.num_workers": cfg.data.num_workers,
        "training.sample_tokens": t.sample_tokens,
    }
    for name, value in non_negative.items():
        if value < 0:
            errors.append(f"{name} must not be negative (got {value})")
    if o.lr == 0:
        errors.append("optimizer.lr must be greater than 0")
    if t.grad_accum_steps is not None and t.grad_accum_steps <= 0:
        errors.append(f"training.grad_accum_steps must be positive (got {t.grad_accum_steps})")
    if t.global_batch_size is not None and t.global_batch_size <= 0:
        errors.append(f"training.global_batch_size must be positive (got {t.global_batch_size})")
    if t.max_grad_norm is not None and t.max_grad_norm < 0:
        errors.append(f"training.max_grad_norm must not be negative (got {t.max_grad_norm})")
    for name, beta in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        if not 0 <= beta < 1:
            errors.append(f"{name} must be in [0, 1) (got {beta})")
    if not 0 <= s.min_lr_ratio <= 1:
        errors.append(f"lr_schedule.min_lr_ratio must be in [0, 1] (got {s.min_lr_ratio})")
    if not 0 < s.decay_fraction <= 1:
        errors.append(f"lr_schedule.decay_fraction must be in (0, 1] (got {s.decay_fraction})")
    if not 0 < cfg.data.val_fraction < 1:
        errors.append(f"data.val_fraction must be in (0, 1) (got {cfg.data.val_fraction})")
    p = cfg.profiling
    for name, value in (("profiling.wait", p.wait), ("profiling.warmup", p.warmup),
                        ("profiling.repeat", p.repeat)):
        if value < 0:
            errors.append(f"{name} must not be negative (got {value})")
    if p.active <= 0:
        errors.append(f"profiling.active must be positive (got {p.active})")
    if cfg.data.dataset == "text_dir" and not cfg.data.path:
        errors.append('data.path is required with data.dataset = "text_dir"')
    if cfg.data.weights and len(cfg.data.weights) != len(cfg.data.paths):
        errors.append(f"data.weights has {len(cfg.data.weights)} entries for "
                      f"{len(cfg.data.paths)} data.paths; give one weight per path")
    if not errors:
        try:
            resolve_batch(t, dp=1)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def check(cfg: Config) -> Config:
    """Raise one ConfigError listing every problem; return cfg when valid."""
    errors = validate(cfg)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return cfg


_DESCRIPTIONS = {
    "scaletrain train": "Train a model. `--config NAME_OR_TOML` picks a preset (default: debug); "
    "`--dry-run` prints the plan (memory, FLOPs) and whether it fits, and builds nothing.",
    "scaletrain profile": "Profile a few training steps, then diagnose them. `--config "
    "NAME_OR_TOML` picks a preset (default: debug).",
    "scaletrain finetune": "Fine-tune a model (`--base`, `--method`, `--task`, `--data`; see "
    "docs/finetune.md). `--config NAME_OR_TOML` picks a preset (default: finetune).",
}


def load_config(argv: list[str] | None = None, prog: str = "scaletrain train") -> Config:
    """TOML preset (`--config NAME_OR_PATH`, default `debug`) + command-line overrides, validated.

    Bad flags exit with code 2 (tyro/argparse); bad values raise ConfigError.
    """
    import tyro

    argv = list(argv or [])
    config_path = "debug"
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            config_path = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
            del argv[i]
            break
    # Accept `--checkpoint.resume true` as well as tyro's `True`.
    argv = [{"true": "True", "false": "False"}.get(a.lower(), a) for a in argv]
    base = read_toml(config_path)
    cfg = tyro.cli(
        Config, args=argv, default=base, prog=prog,
        description=_DESCRIPTIONS.get(prog, "`--config NAME_OR_TOML` picks a preset (default: "
                                            "debug)."),
        config=(tyro.conf.FlagConversionOff,),
    )
    return check(cfg)
