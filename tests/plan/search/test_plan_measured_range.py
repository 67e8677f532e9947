"""The calibrated range: `plan` and `plan search` say when a layout relies on a regime the
calibration table did not measure (a sharded data-parallel group larger than any measured on
NCCL's rings), with the nearest measured evidence; the limit is read from the table."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import main as cli
from scaletrain.plan.hardware import get_device
from scaletrain.plan.layout import Layout
from scaletrain.plan.search.calibration import load_runs
from scaletrain.plan.search.calibration.measured_range import (
    MeasuredRange,
    calibration_note,
    measured_range,
    sharded_group,
)
from scaletrain.plan.search.space import search
from scaletrain.plan.timing.step_time import Cluster

RUNS = load_runs()
BY_NAME = {r.name: r for r in RUNS}


def test_the_limit_is_the_largest_fsdp_group_measured_on_nccl_rings() -> None:
    striped = [sharded_group(r) for r in RUNS if r.framework is None]
    largest = measured_range().largest_fsdp
    assert largest is not None and sharded_group(largest) == max(striped)
    # DeepSpeed's 2021 ZeRO-3 groups are larger, but not measured on striped rings
    assert max(sharded_group(r) for r in RUNS) > sharded_group(largest)
    # a table without the runs of that size moves the limit: they are beyond the rest
    limit = sharded_group(largest)
    rest = MeasuredRange(tuple(r for r in RUNS if r.framework or sharded_group(r) < limit))
    assert rest.note(largest.layout()) is not None
    assert measured_range().note(largest.layout()) is None


def test_search_names_its_175b_zero3_first_choice_as_beyond_the_measured() -> None:
    """GPT-3 175B on 1,536 A100s: the search's #1 is TP 1 x ZeRO-3 over 1,536 ranks (HSDP: 3
    replicas of FSDP over 512, or FSDP over all); the one measurement of that kind of layout at
    that scale ran at a third of PTD-P's speed."""
    run = BY_NAME["GPT-3 175B, PTD-P TP 8 x PP 12, 1536 GPUs"]
    args = run.model_args().replace(tie_embeddings=False)
    fitting, _ = search(args, Cluster(get_device(run.gpu), run.gpus), run.seq_len,
                        run.gbs * run.seq_len, Layout(precision="bf16"))
    zero3 = [c for c in fitting if c.layout.dims.tp == 1 and c.layout.zero == 3
             and c.layout.dims.dp == 1536]
    assert zero3
    assert any(c.layout.dims.dp_replicate > 1 for c in zero3)  # HSDP is noted too
    for c in zero3:
        note = calibration_note(c.layout)
        assert note is not None
        assert "1,536 ranks" in note and "(512 GPUs)" in note
        if c.layout.dims.dp_replicate > 1:
            assert note.startswith(f"HSDP over 1,536 ranks ({c.layout.dims.dp_replicate} "
                                   f"replicas of FSDP over {c.layout.dims.dp_shard:,})")
    assert "44 TFLOP/s at 1,536 A100s vs 141 for TP 8 x PP 12" in note
    assert "Narayanan et al. 2021" in note
    ptdp = [c for c in fitting if c.layout.dims.tp == 8 and c.layout.dims.pp > 1]
    assert ptdp and calibration_note(ptdp[0].layout) is None


def test_no_note_inside_the_measured_range() -> None:
    run = BY_NAME["Llama 3 8B, FSDP 64, A100"]
    assert run.layout().fsdp and calibration_note(run.layout()) is None


def test_cli_prints_one_note_and_a_json_field(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["plan", "--model", "llama3-8b", "--gpu", "A100", "--zero", "3", "--mbs", "1",
              "--seq-len", "2048"]
    assert cli([*common, "--dp", "1536"]) == 0
    out = capsys.readouterr().out
    assert out.count("beyond the largest measured FSDP run") == 1
    assert cli([*common, "--dp", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration_note"] is None
    assert cli(["plan", "search", "--model", "llama3-8b", "--gpus", "16", "--gpu", "H100",
                "--seq-len", "8192", "--gbs-tokens", str(2**20), "--json", "--top", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["calibration_note"] is None for r in rows)
