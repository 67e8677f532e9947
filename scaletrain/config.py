"""The one config tree: typed dataclasses, TOML presets, `--section.field value` overrides.

Each field's docstring is its `--help` text. `load_config` reads a TOML preset, applies the
command-line overrides (parsed by tyro) and validates the result; every problem is reported
as a `ConfigError` whose message names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.config_sections import (  # noqa: F401 - re-exported: the public config API
    METRICS_LOGGERS,
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    FinetuneConfig,
    LRScheduleConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ProfilingConfig,
    TrainingConfig,
)
from scaletrain.models.args import PRESETS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A config value or file that cannot be used; the message says what to change."""


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
    # A bare name is a preset, dots included ("llama3.2-1b" has no ".toml" suffix), also when
    # the working directory holds a folder of that name (`mkdir debug && scaletrain train`).
    if not p.is_file() and p.suffix != ".toml" and len(p.parts) == 1 and preset.exists():
        p = preset
    if p.is_dir():
        raise ConfigError(f"config '{path}' is a directory, not a TOML file; give the path of "
                          "a .toml file or a preset name")
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


SELECTIVE_IS_AMBIGUOUS = (
    "activation_checkpoint.mode selective is ambiguous: Megatron-LM's selective recomputation "
    "(the core attention only) is what SDPA/flash attention already does, so it is `none` here; "
    "scaletrain's block-level mode is `partial` (every `activation_checkpoint.every`-th block, "
    "or its attention part with `activation_checkpoint.scope attention`)")


def validate(cfg: Config) -> list[str]:
    """Every problem in `cfg`, each one sentence naming the field and the fix."""
    errors: list[str] = []
    from scaletrain.models.source import is_hf_config_path

    if cfg.model.name not in PRESETS and not is_hf_config_path(cfg.model.name):
        near = difflib.get_close_matches(cfg.model.name, PRESETS, n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        errors.append(f"model.name: unknown preset '{cfg.model.name}'.{hint} (or give the "
                      "path of a Hugging Face config.json or model folder)")
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
    if cfg.activation_checkpoint.mode == "selective":
        errors.append(SELECTIVE_IS_AMBIGUOUS)
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_schedule
    positive = {
        "training.steps": t.steps, "training.micro_batch_size": t.micro_batch_size,
        "data.seq_len": cfg.data.seq_len,
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
        "checkpoint.interval_minutes": cfg.checkpoint.interval_minutes,
        "training.sample_tokens": t.sample_tokens, "training.eval_sequences": t.eval_sequences,
    }
    for name, value in non_negative.items():
        if value < 0:
            errors.append(f"{name} must not be negative (got {value})")
    if o.lr == 0:
        errors.append("optimizer.lr must be greater than 0")
    for name, value in (("parallel.timeout_s", cfg.parallel.timeout_s),
                        ("parallel.step_timeout_s", cfg.parallel.step_timeout_s)):
        if not value > 0:
            errors.append(f"{name} must be positive (got {value})")
    errors.extend(signal_problems(cfg.checkpoint.signals))
    for name in cfg.metrics.loggers:
        if name not in METRICS_LOGGERS:
            errors.append(f"metrics.loggers: unknown logger '{name}' (choose from "
                          f"{', '.join(METRICS_LOGGERS)})")
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
    if any(not math.isfinite(w) or w < 0 for w in cfg.data.weights):
        errors.append(f"data.weights must be finite and non-negative (got "
                      f"{list(cfg.data.weights)})")
    elif cfg.data.weights and sum(cfg.data.weights) <= 0:
        errors.append("data.weights sum to 0; give at least one dataset a positive weight")
    if not errors:
        try:
            resolve_batch(t, dp=1)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def signal_problems(names: tuple[str, ...]) -> list[str]:
    """What is wrong with `checkpoint.signals` (names such as SIGTERM that a handler can catch)."""
    import signal

    out = []
    for name in names:
        sig = getattr(signal, str(name), None)
        if not isinstance(sig, signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            out.append(f"checkpoint.signals: '{name}' is not a signal a process can catch "
                       "(use names such as SIGTERM, SIGUSR1)")
    return out


def check(cfg: Config) -> Config:
    """Raise one ConfigError listing every problem; return cfg when valid."""
    errors = validate(cfg)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return cfg


_DESCRIPTIONS = {
    "scaletrain train": "Train a model. `--config NAME_OR_TOML` picks a preset (default: debug); "
    "`--dry-run [--json]` plans exactly what train would run (memory, FLOPs, communication; "
    "--json as `plan --json`) and builds nothing: exit 0 if it fits, 3 if not, 2 for a config "
    "error.",
    "scaletrain profile": "Profile a few training steps, then diagnose them. `--config "
    "NAME_OR_TOML` picks a preset (default: debug).",
    "scaletrain finetune": "Fine-tune a model (`--base`, `--method`, `--task`, `--data`; see "
    "docs/finetune.md). `--config NAME_OR_TOML` picks a preset (default: finetune).",
}


def flag_given(argv: list[str], flag: str) -> bool:
    """Whether `argv` sets `flag` (as `--flag value` or `--flag=value`)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _yield_batch_fields(base: Config, argv: list[str]) -> None:
    """A global batch size given on the command line replaces the preset's accumulation steps
    and accumulation steps replace the preset's global batch size (unless both are given):
    GBS = MBS x GA x DP takes two of the three, and the presets already set two."""
    gbs = flag_given(argv, "--training.global_batch_size")
    ga = flag_given(argv, "--training.grad_accum_steps")
    if gbs and not ga:
        base.training.grad_accum_steps = None
    elif ga and not gbs:
        base.training.global_batch_size = None


DEFAULT_PRESET = "debug"
"""The preset `load_config` starts from when no `--config` is given."""


def default_config(model: str | None = None) -> Config:
    """What `scaletrain train` runs with no flags (`--model.name MODEL` alone, when given): the
    default preset over the dataclass defaults, unvalidated. `scaletrain plan` takes its
    defaults (model, sequence length, micro-batch, precision) from here."""
    cfg = read_toml(DEFAULT_PRESET)
    if model is not None:
        cfg.model = dataclasses.replace(cfg.model, name=model)
    return cfg


def load_config(argv: list[str] | None = None, prog: str = "scaletrain train") -> Config:
    """TOML preset (`--config NAME_OR_PATH`, default `debug`) + command-line overrides, validated.

    Bad flags exit with code 2 (tyro/argparse); bad values raise ConfigError.
    """
    import tyro

    argv = list(argv or [])
    config_path = DEFAULT_PRESET
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
    _yield_batch_fields(base, argv)
    cfg = tyro.cli(
        Config, args=argv, default=base, prog=prog,
        description=_DESCRIPTIONS.get(prog, "`--config NAME_OR_TOML` picks a preset (default: "
                                            "debug)."),
        config=(tyro.conf.FlagConversionOff,),
    )
    return check(cfg)
