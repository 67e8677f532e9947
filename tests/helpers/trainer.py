"""Small configs for trainer tests: a slice of the standard library, a 512-token vocabulary."""

from __future__ import annotations

from pathlib import Path

from scaletrain.config import Config, load_config

TINY_MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
              "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "512"]


def tiny_argv(output: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "--output", str(output), *TINY_MODEL,
        "--data.cache_dir", str(cache), "--data.vocab_size", "512", "--data.seq_len", "32",
        "--data.max_bytes", "400000", "--data.val_fraction", "0.1",
        "--data.curate", "false",  # curation of the corpus is tested in test_data_corpus
        "--training.steps", "4", "--training.micro_batch_size", "4",
        "--training.grad_accum_steps", "1", "--training.eval_interval", "0",
        "--training.eval_sequences", "8", "--training.sample_tokens", "0",
        "--precision.dtype", "fp32", "--lr_schedule.warmup_steps", "2",
        "--checkpoint.interval", "0", "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false", "--metrics.log_interval", "1",
        *extra,
    ]


def tiny_config(output: Path, cache: Path, *extra: str) -> Config:
    return load_config(tiny_argv(output, cache, *extra))
