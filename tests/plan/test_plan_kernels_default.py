"""`plan --kernels auto` (the default): cuda with --gpu, else the device `scaletrain train` would
run on this machine, resolved by the trainer's own resolver (`runtime.resolve_device`)."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.cli import main as cli
from scaletrain.commands._plan_args import resolve_kernels, train_defaults
from scaletrain.plan.hardware import get_device


def test_auto_is_cuda_with_a_gpu_and_the_trainers_device_without() -> None:
    cfg = train_defaults("debug")
    assert resolve_kernels("auto", cfg, get_device("H100")) == "cuda"
    assert resolve_kernels("cpu", cfg, get_device("H100")) == "cpu"
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_kernels("auto", cfg, None) == here


def test_auto_follows_the_trainers_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --gpu, what `training.device auto` resolves to decides: CUDA present -> cuda,
    absent -> cpu; an explicit `training.device cpu` plans CPU kernels even with CUDA."""
    cfg = train_defaults("debug")
    for present in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda p=present: p)
        assert resolve_kernels("auto", cfg, None) == ("cuda" if present else "cpu")
    cfg.training.device = "cpu"
    assert resolve_kernels("auto", cfg, None) == "cpu"


def _plan(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert cli(["plan", "--model", "debug", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine's default")
def test_no_flag_plans_this_cpu_and_a_gpu_plans_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    mem = _plan(capsys)["memory_bytes"]
    assert mem == _plan(capsys, "--kernels", "cpu")["memory_bytes"]
    assert mem["host_runtime"] > 0  # a CPU run: the process's own memory is counted
    on_gpu = _plan(capsys, "--gpu", "H100")["memory_bytes"]
    assert on_gpu.get("host_runtime", 0) == 0
    assert on_gpu["activations"] == _plan(capsys, "--gpu", "H100", "--kernels",
                                          "cuda")["memory_bytes"]["activations"]
