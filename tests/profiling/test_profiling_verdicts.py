"""`scaletrain diagnose` verdicts on small synthetic traces, one per cause and per pitfall
(tests/helpers/profiling_traces.py builds them the way Kineto writes them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.commands import diagnose
from scaletrain.profiling.analyze import analyze
from tests.helpers.profiling_traces import cpu_trace, gpu_trace


def _run(tmp_path: Path, *traces, name: str = "t") -> dict:
    paths = [t.write(tmp_path / f"{name}_rank{i}.pt.trace.json.gz") for i, t in enumerate(traces)]
    return analyze(paths)


def _share(r: dict, cause: str) -> float:
    return next((c["share"] for c in r["causes"] if c["cause"] == cause), 0.0)


@pytest.mark.parametrize("segments,verdict,cause", [
    ([("compute", 3000), ("launch", 80), ("compute", 100)] + [("launch", 900)] * 3,
     "cpu/launch-bound", "cpu/launch"),
    ([("compute", 3000), ("input", 2000)], "input-bound", "input"),
    ([("compute", 3000), ("collective", 2000)], "communication-bound", "communication"),
    ([("compute", 3000), ("exposed_comm", 2000)], "communication-bound", "communication"),
    ([("compute", 3000), ("alltoall", 2000)], "communication-bound", "communication"),
    ([("compute", 3000), ("mpi", 2000)], "communication-bound", "communication"),
    ([("compute", 3000), ("copy", 2000)], "memory-bound", "memory"),
    ([("compute", 3000), ("memcpy", 2000)], "memory-bound", "memory"),
    ([("compute", 3000), ("sync", 2000)], "sync-bound", "sync"),
])
def test_each_cause_gets_its_verdict_and_cites_its_share(tmp_path: Path, segments, verdict,
                                                         cause) -> None:
    r = _run(tmp_path, gpu_trace(segments))
    assert r["verdict"] == verdict, (r["causes"], r["evidence"])
    lost = sum(d for k, d in segments if k != "compute")
    # the share cited is the time lost over the device span (4 steps)
    assert _share(r, cause) == pytest.approx(4 * lost / r["span_us"], abs=0.02)
    assert f"{100 * _share(r, cause):.1f} %" in " ".join(r["evidence"])
    assert r["platform"] == "cuda"
    assert all("cuda_sync" in w for w in r["warnings"]) and bool(r["warnings"]) == (cause == "sync")


def test_one_small_allreduce_does_not_turn_launch_gaps_into_communication(tmp_path: Path) -> None:
    r = _run(tmp_path, gpu_trace([("compute", 2000), ("launch", 3000), ("exposed_comm", 50),
                                  ("launch", 1000), ("compute", 200)]))
    assert r["verdict"] == "cpu/launch-bound", r["evidence"]
    assert _share(r, "communication") < 0.02


def test_losses_each_under_threshold_are_reported_together(tmp_path: Path) -> None:
    # 14 % input + 14.6 % launch + 14.4 % copies, 57 % compute: 43 % lost in all
    r = _run(tmp_path, gpu_trace([("compute", 5700), ("input", 1400), ("launch", 1460),
                                  ("memcpy", 1440)]))
    assert r["verdict"] == "mixed", r["evidence"]
    assert {c["cause"] for c in r["causes"]} >= {"input", "cpu/launch", "memory"}
    assert all(c["share"] < 0.15 for c in r["causes"])
    text = r["evidence"][0]
    assert "input" in text and "host launch" in text and "memory copies" in text
    assert {x.get("key") for x in r["remedies"]} >= {"data.num_workers", "compile.enabled"}


def test_compute_bound_when_losses_are_small(tmp_path: Path) -> None:
    r = _run(tmp_path, gpu_trace([("compute", 9000), ("launch", 300)]))
    assert r["verdict"] == "compute-bound" and r["causes"] == [] or \
        r["causes"][0]["share"] < 0.05


def test_stragglers_are_the_rank_the_others_wait_for(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # 4 ranks; rank 2's data loader takes 22 ms per step, the others wait for it in NCCL
    others = [("compute", 30_000), ("exposed_comm", 22_500)]
    slow = [("input", 22_000), ("compute", 30_000), ("exposed_comm", 500)]
    traces = [gpu_trace(slow if i == 2 else others, steps=2, rank=i, world=4) for i in range(4)]
    paths = [t.write(tmp_path / f"rank{i}.json.gz") for i, t in enumerate(traces)]
    r = analyze(paths)
    assert r["across_ranks"]["straggler_rank"] == 2
    assert r["verdict"] == "input-bound" and r["job_verdict"] == "communication-bound"
    assert diagnose.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "VERDICT: input-bound (straggler rank 2" in out
    assert out.count("  rank ") == 4 and "4 of 4 ranks" in out
    # two ranks: the one that computes longer (135 vs 106 ms) is the straggler, not the waiter
    a = gpu_trace([("compute", 135_000), ("exposed_comm", 1_000)], steps=2, rank=0, world=128)
    b = gpu_trace([("compute", 106_000), ("exposed_comm", 30_000)], steps=2, rank=1, world=128)
    r2 = analyze([a.write(tmp_path / "a_rank0.json.gz"), b.write(tmp_path / "b_rank1.json.gz")])
    assert r2["across_ranks"]["straggler_rank"] == 0
    assert r2["ranks"][1]["collective_ms_per_step"] > r2["ranks"][0]["collective_ms_per_step"]


def test_no_straggler_when_ranks_are_even(tmp_path: Path) -> None:
    traces = [gpu_trace([("compute", 3000), ("exposed_comm", 500)], rank=i, world=2)
              for i in range(2)]
    r = _run(tmp_path, *traces)
    assert r["across_ranks"]["straggler_rank"] is None and "job_verdict" not in r


def test_device_traces_are_never_cpu(tmp_path: Path) -> None:
    mtia = gpu_trace([("compute", 3000), ("launch", 2000)])
    for e in mtia.events:
        if e["cat"] == "cuda_runtime":
            e["cat"], e["name"] = "mtia_runtime", "mtiaLaunchKernel"
    r = _run(tmp_path, mtia, name="mtia")
    assert r["platform"] == "mtia" and r["breakdown"]
    # a CUPTI range profile: counters per range, no kernel timeline
    rp = cpu_trace([("op", 500), ("python", 100)])
    rp.add("cuda_profiler_range", "range 0", 1000, 500)
    r = _run(tmp_path, rp, name="range")
    assert r["platform"] == "cuda" and r["verdict"] == "no kernel timing"
    assert "no kernel timing" in r["note"] and not r["remedies"]


def test_zero_length_device_trace_is_stated_not_called_compute_bound(tmp_path: Path) -> None:
    t = gpu_trace([("compute", 3000)])
    for e in t.events:
        if e["cat"] == "kernel":
            e["dur"] = 0
    r = _run(tmp_path, t)
    assert r["verdict"] == "no kernel timing"
    assert any("zero length" in w for w in r["warnings"])


@pytest.mark.parametrize("segments,verdict", [
    ([("op", 9900), ("python", 100)], "compute-bound"),      # a plain loop of matmuls
    ([("op", 3000), ("data", 6000), ("python", 100)], "input-bound"),
    ([("op", 3000), ("python", 6000)], "overhead-bound"),
    ([("op", 3000), ("mpi", 6000)], "communication-bound"),  # MPI ranges are communication
])
def test_cpu_only_traces_on_their_own_terms(tmp_path: Path, segments, verdict) -> None:
    r = _run(tmp_path, cpu_trace(segments))
    assert r["platform"] == "cpu" and r["verdict"] == verdict, r["evidence"]
    assert "launch" not in " ".join(r["evidence"])


def test_pitfall_warnings(tmp_path: Path) -> None:
    r = _run(tmp_path, gpu_trace([("compute", 3000)], markers=False), name="nomark")
    assert any("no ProfilerStep markers" in w for w in r["warnings"])
    r = _run(tmp_path, gpu_trace([("compute", 3000)], first_step_extra=20_000), name="warm")
    assert any("warm-up" in w for w in r["warnings"])
    r = _run(tmp_path, gpu_trace([("compute", 3000), ("sync", 2000)]), name="sync")
    assert any("cuda_sync" in w for w in r["warnings"])
    mixed = _run(tmp_path, gpu_trace([("compute", 3000)], rank=0, world=2),
                 cpu_trace([("op", 3000)], rank=1, world=4), name="mixed")
    text = " ".join(mixed["warnings"])
    assert "device types" in text and "world sizes" in text


def test_other_profiler_files_get_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    timeline = tmp_path / "memory_timeline.raw.json"
    timeline.write_text(json.dumps([[1, 0, 1024, 0], [2, 0, 2048, 4]]))
    assert diagnose.main([str(timeline)]) == 2
    assert "--memory-timeline" in capsys.readouterr().err
    et = tmp_path / "et.json"
    et.write_text(json.dumps({"schema": "1.0.1", "nodes": []}))
    assert diagnose.main([str(et)]) == 2
    assert "execution trace" in capsys.readouterr().err


TIMELINE = Path("/work/shared/fixtures/traces/memory_timeline.raw.gz")


@pytest.mark.skipif(not TIMELINE.exists(), reason="shared fixtures not present")
def test_profile_folder_reads_memory_timeline_and_against_shows_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run" / "profile"
    (run / "traces").mkdir(parents=True)
    gpu_trace([("compute", 3000), ("launch", 500)]).write(
        run / "traces" / "rank0.step5.pt.trace.json.gz")
    (run / "memory_timeline_rank0.raw.json.gz").write_bytes(TIMELINE.read_bytes())
    (run / "oom_rank0.json").write_text(json.dumps({
        "step": 7, "snapshot": str(run / "oom_snapshot_rank0.pickle"),
        "max_reserved_bytes": 79 * 2**30, "device_total_bytes": 80 * 2**30}))
    other = gpu_trace([("compute", 6000), ("launch", 500)]).write(tmp_path / "other.json.gz")
    assert diagnose.main([str(run), "--json", "--against", str(other)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["memory"]["source"].startswith("memory timeline")
    assert r["memory"]["at_peak"]["activation"] > 2e9
    assert any("out of memory at step 7" in w for w in r["warnings"])
    mem = r["against"]["memory"]
    assert mem["peak_bytes"] == pytest.approx(r["memory"]["peak_allocated_bytes"])
    assert mem["at_peak"]["activation"]["other_bytes"] == 0.0
    assert diagnose.main([str(run), "--against", str(other)]) == 0
    out = capsys.readouterr().out
    assert "peak memory" in out and "activation" in out


def test_remedies_already_in_effect_are_not_proposed(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from scaletrain.profiling.remedies import remedies

    cfg = SimpleNamespace(precision=SimpleNamespace(dtype="auto"),
                          compile=SimpleNamespace(enabled=False),
                          training=SimpleNamespace(micro_batch_size=4),
                          data=SimpleNamespace(num_workers=8, prefetch_factor=2,
                                               pin_memory=False))
    keys = {x.get("key") for x in remedies("compute-bound", {"platform": "cuda"}, cfg)}
    assert "precision.dtype" not in keys and "compile.enabled" in keys  # auto is bf16 on GPU
    keys = {x.get("key") for x in remedies("input-bound", {"platform": "cuda"}, cfg)}
    assert "data.num_workers" not in keys and "data.prefetch_factor" in keys  # 8 >= 4


def test_html_report_has_plots(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    traces = [gpu_trace([("compute", 3000), ("exposed_comm", 500 + 2000 * (i == 0))],
                        rank=i, world=2) for i in range(2)]
    html = tmp_path / "r.html"
    paths = [t.write(tmp_path / f"rank{i}.json.gz") for i, t in enumerate(traces)]
    assert diagnose.main([*map(str, paths), "--html", str(html)]) == 0
    text = html.read_text()
    for title in ("Per-step breakdown", "Time breakdown per rank", "Own work and collectives"):
        assert title in text
    assert "plotly" in text.lower()


@pytest.mark.parametrize("name", [
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",  # NCCL all-to-all (send/recv)
    "ncclDevKernel_AllToAll_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "void deep_ep::intranode::dispatch<8, 768, 8192>(...)",
])
def test_expert_parallel_all_to_all_kernels_are_communication(name: str) -> None:
    from scaletrain.profiling.trace import COMM, kernel_kind

    assert kernel_kind(name) == COMM


@pytest.mark.parametrize("name", ["c10d::alltoall_base_", "gloo:all_to_all",
                                  "record_param_comms", "nccl:all_to_all"])
def test_all_to_all_host_ops_are_communication(name: str) -> None:
    from scaletrain.profiling.cpu import COMM_RE

    assert COMM_RE.match(name)


def test_a_straggler_that_computes_longer_is_compute_bound(tmp_path: Path) -> None:
    """Rank 0 computes 12 ms per step, rank 1 2.2 ms and then waits for rank 0 in the
    all-reduce. Rank 0's own all-reduce (no waiting: pure transfer) is 19 % of its step, over
    the 15 % threshold, yet the job waits for rank 0's computation: the headline is
    compute-bound, and no communication remedy is proposed for it."""
    slow = cpu_trace([("op", 12_000), ("mpi", 2_800)], rank=0, world=2)
    fast = cpu_trace([("op", 2_200), ("mpi", 12_600)], rank=1, world=2)
    r = _run(tmp_path, slow, fast)
    assert r["across_ranks"]["straggler_rank"] == 0
    assert r["ranks"][0]["verdict"] == "communication-bound"  # its step, collectives included
    assert r["verdict"] == "compute-bound" and r["straggler_verdict"] == "compute-bound"
    assert r["job_verdict"] == "communication-bound"  # the mean over ranks
    assert not any("bucket_cap_mb" in x.get("flag", "") for x in r["remedies"])
    assert any("own work" in e and "compute-bound" in e for e in r["evidence"])
    # the same ranks with a slow data loader on rank 0 instead: input-bound (2 steps: with
    # fewer than 5 operators the reader takes the durations as microseconds)
    slow = cpu_trace([("op", 2_000), ("data", 10_000), ("mpi", 2_800)], steps=2, rank=0,
                     world=2)
    fast = cpu_trace([("op", 2_200), ("mpi", 12_600)], steps=2, rank=1, world=2)
    r = _run(tmp_path, slow, fast, name="input")
    assert r["across_ranks"]["straggler_rank"] == 0 and r["verdict"] == "input-bound"


def test_the_phase_line_of_several_ranks_is_the_stragglers(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """With several ranks the per-phase line is one rank's: the straggler's, and it says so
    (rank 0's line showed 0 ms of data loading under an input-bound verdict for rank 1)."""
    fast = cpu_trace([("op", 2_200), ("mpi", 12_600)], steps=2, rank=0, world=2)
    slow = cpu_trace([("op", 2_000), ("data", 10_000), ("mpi", 2_800)], steps=2, rank=1,
                     world=2)
    paths = [t.write(tmp_path / f"rank{i}.json.gz") for i, t in enumerate((fast, slow))]
    assert diagnose.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("CPU per step"))
    assert line.startswith("CPU per step, rank 1 (") and "data 10.0 ms" in line, line
