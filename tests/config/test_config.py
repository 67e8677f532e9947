from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.config import Config, ConfigError, load_config, read_toml, to_toml, validate
from tests.helpers.proc import scaled


def test_default_is_the_debug_preset() -> None:
    cfg = load_config([])
    assert cfg.model.name == "debug"
    assert cfg.global_batch_size == cfg.training.micro_batch_size * cfg.grad_accum_steps


def test_overrides_by_section_and_field() -> None:
    cfg = load_config(["--training.steps", "7", "--model.n_layers", "2",
                       "--checkpoint.resume", "true", "--optimizer.name", "sgd"])
    assert cfg.training.steps == 7
    assert cfg.model.to_model_args().n_layers == 2
    assert cfg.checkpoint.resume is True
    assert cfg.optimizer.name == "sgd"


def test_global_batch_derives_accumulation() -> None:
    cfg = load_config(["--training.micro_batch_size", "2", "--training.global_batch_size", "8",
                       "--training.grad_accum_steps", "None"])
    assert cfg.grad_accum_steps == 4


@pytest.mark.parametrize("preset", ["debug", "finetune", "llama3.2-1b"])
def test_a_batch_size_on_the_command_line_replaces_the_presets(preset: str,
                                                               tmp_path: Path) -> None:
    """The presets set micro_batch_size and grad_accum_steps; a global batch size given on the
    command line (alone) derives the accumulation instead of clashing with the preset's."""
    mbs = load_config(["--config", preset]).training.micro_batch_size
    cfg = load_config(["--config", preset, "--training.global_batch_size", str(4 * mbs)])
    assert (cfg.global_batch_size, cfg.grad_accum_steps) == (4 * mbs, 4)
    # ... and accumulation steps on the command line replace a file's global batch size
    toml = tmp_path / "gbs.toml"
    toml.write_text("[training]\nmicro_batch_size = 2\nglobal_batch_size = 16\n")
    cfg = load_config(["--config", str(toml), "--training.grad_accum_steps=3"])
    assert (cfg.global_batch_size, cfg.grad_accum_steps) == (6, 3)
    assert load_config(["--config", str(toml)]).grad_accum_steps == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer.lr", "-1"], "optimizer.lr must not be negative"),
        (["--training.micro_batch_size", "3", "--training.global_batch_size", "8",
          "--training.grad_accum_steps", "None"], "must be divisible by micro_batch_size"),
        (["--training.micro_batch_size", "2", "--training.global_batch_size", "8",
          "--training.grad_accum_steps", "2"], "set only two of them"),
        (["--model.n_heads", "8", "--model.n_kv_heads", "3"], "divisible by n_kv_heads"),
        (["--model.name", "lama3-8b"], "Did you mean 'llama3-8b'"),
        (["--training.steps", "0"], "training.steps must be positive"),
        (["--data.seq_len", "4096"], "exceeds model max_seq_len"),
        (["--optimizer.beta2", "1.5"], "optimizer.beta2 must be in [0, 1)"),
        (["--data.paths", "a", "b", "--data.weights", "1", "-1"],
         "data.weights must be finite and non-negative"),
        (["--data.paths", "a", "b", "--data.weights", "1", "nan"],
         "data.weights must be finite and non-negative"),
        (["--data.paths", "a", "b", "--data.weights", "0", "0"], "data.weights sum to 0"),
    ],
)
def test_bad_values_get_one_clear_message(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_config(argv)


def test_unknown_toml_key_suggests_the_nearest(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nstep = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'step'. Did you mean 'steps'"):
        read_toml(path)
    path.write_text("[trainig]\nsteps = 3\n")
    with pytest.raises(ConfigError, match="Did you mean 'training'"):
        read_toml(path)


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(["--training.steps", "11", "--precision.dtype", "fp32"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    again = read_toml(path)
    assert again == cfg
    assert validate(again) == []


def test_every_builtin_preset_loads() -> None:
    for path in (Path(__file__).parents[2] / "scaletrain" / "configs").glob("*.toml"):
        assert isinstance(read_toml(path), Config)
        assert read_toml(path.stem) == read_toml(path)  # by name, dots included (llama3.2-1b)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scaletrain", *argv], capture_output=True,
                          text=True, timeout=scaled(120))


def test_cli_errors_exit_2_without_traceback() -> None:
    for argv, needle in [
        (("train", "--optimizer.lr", "-0.1"), "optimizer.lr must not be negative"),
        (("train", "--training.stepz", "3"), "training.steps"),
        (("train", "--config", "nope"), "config file 'nope' not found"),
        (("trian",), "Did you mean 'train'"),
    ]:
        proc = _cli(*argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert needle in proc.stderr + proc.stdout, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_help_shows_field_docstrings() -> None:
    proc = _cli("train", "--help")
    assert proc.returncode == 0
    assert "Micro-batches accumulated per optimizer step" in proc.stdout


def test_megatron_selective_name_is_refused_with_the_meaning_of_each_mode() -> None:
    cfg = Config()
    cfg.activation_checkpoint.mode = "selective"
    errors = validate(cfg)
    assert len(errors) == 1 and "Megatron-LM's selective" in errors[0] and "partial" in errors[0]
    cfg.activation_checkpoint.mode = "partial"
    assert validate(cfg) == []


def test_a_folder_named_like_the_preset_does_not_hide_it(tmp_path, monkeypatch) -> None:
    """`mkdir debug && scaletrain train --dry-run` reads the preset, not the folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "debug").mkdir()
    assert read_toml("debug").model.name == "debug"
    (tmp_path / "mine.toml").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        read_toml("mine.toml")
