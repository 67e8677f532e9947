"""bench/train_cpu.py runs end to end on tiny dimensions and reports both sides (no timings
are asserted: only that the numbers exist and both sides trained the same model)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.bench import load_bench

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _restore_log_level() -> Iterator[None]:
    """The benchmark quiets the `scaletrain` logger; keep that from leaking into other tests."""
    logger = logging.getLogger("scaletrain")
    level = logger.level
    yield
    logger.setLevel(level)


def test_train_cpu_bench_reports_both_sides(tmp_path: Path) -> None:
    bench = load_bench("train_cpu")
    out = tmp_path / "train_cpu.json"
    bench.main([
        "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "128",
        "--vocab", "512", "--seq-len", "32", "--batch", "2", "--steps", "1", "--warmup", "1",
        "--skip-compile", "--cache-dir", str(tmp_path / "cache"),
        "--max-bytes", "300000", "--json", str(out),
    ])
    data = json.loads(out.read_text())
    assert data["environment"]["torch"] and data["environment"]["threads"] >= 1
    result = data["variants"]["fp32-eager"]
    for side in ("ours", "baseline"):
        assert result[side]["tokens_per_s"] > 0
        assert len(result[side]["step_times_s"]) == 1
    assert result["ratio"] == pytest.approx(
        result["ours"]["tokens_per_s"] / result["baseline"]["tokens_per_s"])
    # Same weights, batch and loss convention: the first losses agree (fp32).
    first = result["first_step"]
    assert math.isclose(first["ours"]["loss"], first["baseline"]["loss"], rel_tol=1e-4)
    assert math.isclose(first["ours"]["grad_norm"], first["baseline"]["grad_norm"], rel_tol=1e-3)
    assert {"fp32-compiled", "bf16-compiled"} <= set(data["skipped"])
    assert set(data["variants"]) | set(data["skipped"]) == set(bench.VARIANTS)
    for result in data["variants"].values():  # bf16-eager too, where the CPU has AVX-512 bf16
        assert result["ours"]["tokens_per_s"] > 0 and result["baseline"]["tokens_per_s"] > 0


def test_train_gpu_bench_skips_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the skip path does not apply")
    bench = load_bench("train_gpu")
    out = tmp_path / "train_gpu.json"
    assert bench.main(["--json", str(out)]) is None
    assert "no CUDA device: skipped" in capsys.readouterr().out
    assert not out.exists()


def test_finetune_cpu_bench_reports_every_method(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    bench = load_bench("finetune_cpu")
    out = tmp_path / "finetune_cpu.json"
    bench.main(["--models", "tiny", "--methods", "full,qlora-r8", "--steps", "2",
                "--batch", "2", "--seq-len", "128", "--precision", "fp32",
                "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"full", "qlora-r8"}
    full, qlora = runs["full"], runs["qlora-r8"]
    assert full["trainable_params"] == full["total_params"]
    assert 0 < qlora["trainable_params"] < full["trainable_params"]
    est = {k: sum(r["memory_estimate_bytes"].values()) for k, r in runs.items()}
    assert est["qlora-r8"] < est["full"]
    for r in runs.values():
        assert r["tokens_per_s"] > 0 and r["peak_rss_gib"] >= r["rss_after_build_gib"] > 0
        assert r["steps"] == 2 and math.isfinite(r["final_loss"])


def test_families_cpu_bench_trains_the_same_model_on_both_sides(tmp_path: Path) -> None:
    bench = load_bench("families_cpu")
    out = tmp_path / "families_cpu.json"
    bench.main(["--families", "gemma2", "--out", str(out),
                "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn-dim",
                "128", "--vocab", "512", "--seq-len", "32", "--batch", "2", "--steps", "1",
                "--warmup", "1", "--cache-dir", str(tmp_path / "cache"), "--max-bytes", "300000"])
    result = json.loads(out.read_text())["families"]["gemma2"]["fp32-eager"]
    first = result["first_step"]  # same weights, batch, loss: Gemma 2 on both sides
    assert math.isclose(first["ours"]["loss"], first["baseline"]["loss"], rel_tol=1e-4)
    assert math.isclose(first["ours"]["grad_norm"], first["baseline"]["grad_norm"], rel_tol=1e-3)
    assert result["ours"]["tokens_per_s"] > 0 and result["baseline"]["tokens_per_s"] > 0
