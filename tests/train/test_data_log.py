"""The data log line counts what a run consumes: global batches of micro-batch x accumulation x
data-parallel rows, and the optimizer steps the sample order holds."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from scaletrain.train.trainer import Trainer
from tests.helpers.trainer import tiny_config


def test_data_log_counts_global_batches_with_accumulation(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        t = Trainer(tiny_config(tmp_path / "o", tmp_path / "cache", "--training.steps", "5",
                                "--training.micro_batch_size", "4",
                                "--training.grad_accum_steps", "2"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(lines) == 1, lines
    m = re.search(r"data: (\d+) training samples .*\((\d+) optimizer steps of a global batch of "
                  r"(\d+) = 4 micro-batch x 2 accumulation x 1 data-parallel; (\d+) "
                  r"micro-batches per rank\)", lines[0])
    assert m, lines[0]
    samples, steps, rows, micro = (int(g) for g in m.groups())
    assert rows == 8  # 4 x 2 x 1, not the micro-batch of 4
    assert samples == len(t.train_stream.dataset) >= 5 * 8
    assert steps == samples // 8 and micro == samples // 4
