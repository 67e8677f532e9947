"""The step-time model against published measured runs (`plan/calibration/published_runs.toml`).

Predicted / measured TFLOP/s per GPU stays inside the stated band for every row, and within each
group (one model, GPU count and batch, several layouts) the measured order of the layouts is the
predicted order: the search ranks layouts as the published measurements do.
"""

from __future__ import annotations

import pytest

from scaletrain.plan.calibration import BAND, load_runs, predict

RUNS = load_runs()


def test_every_row_names_its_source_and_a_measurement() -> None:
    assert len(RUNS) >= 30
    for run in RUNS:
        assert run.source and (run.measured_tflops or run.measured_tokens_per_s), run.name
        assert run.flops in ("model", "hardware"), run.name
        assert run.gpus % (run.tp * run.pp * run.cp) == 0, run.name
    # A100 and H100, 1B to 1T parameters, data, tensor, pipeline and sharded layouts
    assert {r.gpu for r in RUNS} >= {"A100-SXM4-80GB", "H100-SXM"}
    assert {r.zero for r in RUNS} >= {0, 1, 3} and max(r.pp for r in RUNS) >= 64
    sizes = [predict(r).plan.params for r in RUNS]
    assert min(sizes) < 2e9 and max(sizes) > 1e12


@pytest.mark.parametrize("run", [r for r in RUNS if r.outside_band is None],
                         ids=lambda r: r.name)
def test_predicted_over_measured_stays_in_band(run) -> None:
    ratio = predict(run).ratio
    assert BAND[0] <= ratio <= BAND[1], f"{run.name}: predicted / measured = {ratio:.2f}"


def test_rows_outside_the_band_are_few_and_explained() -> None:
    outside = [r for r in RUNS if r.outside_band is not None]
    assert len(outside) <= 1
    for r in outside:
        assert len(r.outside_band) > 80
        assert not BAND[0] <= predict(r).ratio <= BAND[1]  # else drop the exemption


def test_measured_order_of_layouts_is_kept() -> None:
    groups: dict[str, list] = {}
    for r in RUNS:
        if r.group:
            groups.setdefault(r.group, []).append(predict(r))
    assert len(groups) >= 5
    for name, preds in groups.items():
        assert len(preds) >= 2, name
        by_measured = sorted(preds, key=lambda p: -p.measured_tflops)
        by_predicted = sorted(preds, key=lambda p: -p.predicted_tflops)
        assert [p.run.name for p in by_measured] == [p.run.name for p in by_predicted], name


def test_zero3_without_model_parallelism_loses_at_scale() -> None:
    """Narayanan et al. 2021, Table 2: 175B on 1536 A100s, ZeRO-3 44 TFLOP/s, TP 8 x PP 12
    141: the exposed FSDP traffic (one NIC per GPU across nodes) must show."""
    by_name = {r.name: predict(r) for r in RUNS}
    zero3 = by_name["GPT-3 175B, ZeRO-3, 1536 GPUs"]
    ptdp = by_name["GPT-3 175B, PTD-P TP 8 x PP 12, 1536 GPUs"]
    assert ptdp.predicted_tflops > 2 * zero3.predicted_tflops
    assert zero3.times["dp_comm_exposed"] > zero3.times["compute"]
