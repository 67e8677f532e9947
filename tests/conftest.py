"""Shared test set-up: offline, deterministic, small."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scaletrain.models.args import ModelArgs  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def tiny_args() -> ModelArgs:
    """A Llama with every feature on (GQA, tied head) that runs in milliseconds."""
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=64)


# restructure_tests: distributed marker by folder
_TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests under a `distributed/` folder (tests/<room>/distributed/) spawn processes: each gets
    the `distributed` marker, so `pytest -m distributed` and `-m "not distributed"` select them
    apart wherever their room is. Explicit marks stay as they are."""
    for item in items:
        try:
            parts = Path(item.path).resolve().relative_to(_TESTS).parts
        except ValueError:  # not under tests/
            continue
        if "distributed" in parts[:-1] and item.get_closest_marker("distributed") is None:
            item.add_marker(pytest.mark.distributed)
