"""The training RNG: each rank's state saved under its own checkpoint key and restored exactly;
a resume in another layout reseeds deterministically; residual dropout (`model.dropout`)."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.feasibility import RunLayout, layout_problems
from scaletrain.train import rng
from scaletrain.train.trainer import Trainer
from tests.helpers.trainer import tiny_config

DROPOUT = ("--model.dropout", "0.1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


def _draws() -> tuple[list[float], list[float], list[float]]:
    return (torch.rand(5).tolist(), np.random.rand(5).tolist(),
            [random.random(), random.gauss(0, 1), random.gauss(0, 1)])


def test_rng_state_round_trip_as_tensors() -> None:
    random.gauss(0, 1)  # Python keeps the second value of a pair: gauss_next is set
    np.random.standard_normal()  # numpy's cached gaussian likewise
    state = rng.rng_state()
    assert all(isinstance(v, torch.Tensor) for v in state.values())  # every rank writes its own
    first = _draws()
    rng.set_rng_state(state)
    assert _draws() == first
    rng.set_rng_state({k: v.clone() for k, v in state.items()})
    assert _draws() == first


def test_streams_differ_by_data_parallel_position_only() -> None:
    # (dp_rank, cp_rank, cp, pp_rank, dp): tensor-parallel ranks are not an input.
    streams = {rng.rng_stream(d, c, 2, p, 2) for d in range(2) for c in range(2)
               for p in range(2)}
    assert len(streams) == 8 and rng.rng_stream(0, 0, 1, 0, 1) == 0
    rng.seed_training_rng(3, 0)
    a = torch.rand(4)
    rng.seed_training_rng(3, 1)
    assert not torch.equal(a, torch.rand(4))
    rng.seed_training_rng(3, 0)
    assert torch.equal(a, torch.rand(4))


def test_dropout_is_residual_and_training_only() -> None:
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, dropout=0.5)
    model = build_model(args, seed=0)
    plain = build_model(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64), seed=0)
    assert model.state_dict().keys() == plain.state_dict().keys()
    x = torch.randint(0, 64, (2, 8))
    model.load_state_dict(plain.state_dict())
    model.eval()
    assert torch.equal(model(x), plain(x))  # evaluation: no dropout
    model.train()
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(1)
    assert torch.equal(a, model(x)) and not torch.equal(a, plain(x))
    assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) == 1 + 2 * 2
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    with pytest.raises(ValueError, match="dropout must be in"):
        ModelArgs(dropout=1.0)


def test_dropout_with_tensor_parallelism_is_refused() -> None:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, dropout=0.1)
    lay = RunLayout(dims=ParallelDims.resolve(2, tp=2), mode="zero3", seq_len=32, grad_accum=1)
    problems = layout_problems(args, lay)
    assert any("model.dropout" in p and "--parallel.tp 1" in p for p in problems), problems
    assert not layout_problems(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128), lay)


def _checkpointed_run(out: Path, cache: Path, *extra: str) -> list[float]:
    argv = ("--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_last",
            "5", *DROPOUT, *extra)
    full = Trainer(tiny_config(out, cache, *argv)).train().losses
    shutil.rmtree(out / "checkpoints" / "step-0000004")
    return full


def test_dropout_run_resumes_exactly(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "run"
    full = _checkpointed_run(out, cache)
    no_dropout = Trainer(tiny_config(tmp_path / "nd", cache, "--training.steps", "4")).train()
    assert full != no_dropout.losses  # dropout really draws masks
    resumed = Trainer(tiny_config(out, cache, "--training.steps", "4", *DROPOUT,
                                  "--checkpoint.resume", "true"))
    assert resumed.step == 2
    assert resumed.train().losses == full[2:]  # bitwise: the masks continue where they were


def test_dropout_recomputed_under_activation_checkpointing(tmp_path: Path, cache: Path) -> None:
    argv = ("--training.steps", "3", *DROPOUT)
    plain = Trainer(tiny_config(tmp_path / "a", cache, *argv)).train().losses
    ac = Trainer(tiny_config(tmp_path / "b", cache, *argv,
                             "--activation_checkpoint.mode", "full")).train().losses
    assert ac == pytest.approx(plain, abs=1e-6)  # recomputation replays forward's masks


@pytest.mark.parametrize("change", ["layout", "world"])
def test_resume_in_another_layout_warns_and_reseeds(tmp_path: Path, cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture,
                                                    change: str) -> None:
    out = tmp_path / "run"
    _checkpointed_run(out, cache)
    if change == "layout":  # this rank's entry is there, saved in another layout
        real = rng.layout_tensor
        monkeypatch.setattr(rng, "layout_tensor",
                            lambda world, shape, stream: real(world + 1, shape, stream))
    else:  # a rank the saving run did not have (a larger world): no entry at all
        monkeypatch.setattr(rng, "rank_key", lambda rank: "rank7")
    argv = ("--training.steps", "4", *DROPOUT, "--checkpoint.resume", "true")
    draws = []
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="scaletrain"):
            Trainer(tiny_config(out, cache, *argv))
        draws.append(torch.rand(3))
    assert "holds no RNG state of this rank in this layout" in caplog.text
    assert torch.equal(draws[0], draws[1])  # deterministic fallback
    rng.seed_training_rng(0, 0, 2)  # (training.seed, stream, resumed step)
    assert torch.equal(draws[0], torch.rand(3))
