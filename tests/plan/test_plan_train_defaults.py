"""`scaletrain plan --model NAME` with no other flag plans what `scaletrain train --model.name
NAME` runs: the same model (parameter count of the model the trainer's config resolves to,
built on the meta device), sequence length, micro-batch and autocast precision, all read from
the trainer's default config (issue 35: it planned 7.3M parameters in bf16 where train ran
11.5M in fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.cli import main as cli
from scaletrain.config import load_config
from scaletrain.data.sources import resolve_model_args
from scaletrain.models.args import PRESETS
from scaletrain.models.transformer import Transformer
from scaletrain.runtime import resolve_device, resolve_dtype


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc = cli(["plan", *argv, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_defaults_are_the_trainers(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(["--model.name", name])  # what `scaletrain train --model.name NAME` runs
    with torch.device("meta"):
        built = Transformer(resolve_model_args(cfg))
    plan = _plan(capsys, "--model", name)
    assert plan["params"] == sum(p.numel() for p in built.parameters())
    assert plan["layout"]["seq_len"] == cfg.data.seq_len
    assert plan["layout"]["mbs"] == cfg.training.micro_batch_size
    assert plan["layout"]["precision"] == resolve_dtype(cfg.precision,
                                                        resolve_device(cfg.training.device))


def test_plan_of_debug_equals_the_dry_run_of_the_default_train(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc = cli(["train", "--dry-run", "--json"])
    dry = json.loads(capsys.readouterr().out)
    assert rc in (0, 3)
    plan = _plan(capsys, "--model", "debug")
    assert plan["params"] == dry["params"]
    for key in ("seq_len", "mbs", "precision"):
        assert plan["layout"][key] == dry["layout"][key], key


def test_precision_auto_follows_the_named_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(capsys, "--model", "debug", "--gpu", "H100")["layout"]["precision"] == "bf16"
    assert _plan(capsys, "--model", "debug", "--gpu", "V100")["layout"]["precision"] == "fp32"
    assert _plan(capsys, "--model", "debug", "--precision", "fp16")["layout"]["precision"] \
        == "fp16"

