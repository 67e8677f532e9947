"""Remedies follow the cause and where its time falls; none is already in effect; a straggler
is told apart as a slow device or extra work; collectives as transfer or waiting."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from scaletrain.commands import diagnose
from scaletrain.profiling.analyze import analyze
from scaletrain.profiling.verdict import queue_full
from tests.helpers.profiling_traces import NCCL, cpu_trace, gpu_trace


def _run(tmp_path: Path, *traces, name: str = "t") -> dict:
    paths = [t.write(tmp_path / f"{name}_rank{i}.pt.trace.json.gz") for i, t in enumerate(traces)]
    return analyze(paths)


def _keys(r: dict) -> list[str | None]:
    return [x.get("key") for x in r["remedies"]]


def test_host_bound_optimizer_gets_the_fused_optimizer_first(tmp_path: Path) -> None:
    r = _run(tmp_path, gpu_trace([("compute", 3000), ("optimizer_loop", 3000)]))
    assert r["verdict"] == "cpu/launch-bound", r["evidence"]
    phases = r["idle_by_phase"]["host_launch"]
    assert max(phases, key=phases.get) == "optimizer"
    assert r["optimizer_launches_per_step"] == pytest.approx(100)
    first = r["remedies"][0]
    assert first["flag"] == "--optimizer.implementation fused", r["remedies"]
    assert "launching 100 kernels per step" in first["change"]
    # an optimizer that computes on the host (2 launches): keep it on the device first
    r = _run(tmp_path, gpu_trace([("compute", 3000), ("optimizer_host", 3000)]), name="host")
    assert r["remedies"][0]["flag"] == "--optimizer.offload false", r["remedies"]
    # launch gaps outside any phase get the generic launch remedies, no optimizer advice
    r = _run(tmp_path, gpu_trace([("compute", 3000)] + [("launch", 900)] * 3), name="gen")
    assert r["verdict"] == "cpu/launch-bound"
    assert _keys(r)[0] == "compile.enabled" and "optimizer.implementation" not in _keys(r)


def test_cpu_only_for_loop_optimizer_gets_the_fused_optimizer(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from scaletrain.profiling.remedies import remedies

    r = _run(tmp_path, cpu_trace([("op", 3000), ("optimizer", 3000)]))
    assert r["platform"] == "cpu" and r["optimizer_launches_per_step"] == pytest.approx(100)
    first = r["remedies"][0]
    assert first["flag"] == "--optimizer.implementation fused" and first["cause"] == "optimizer"
    cfg = SimpleNamespace(optimizer=SimpleNamespace(implementation="auto"))  # fused on CPU
    assert "optimizer.implementation" not in [x.get("key") for x in
                                              remedies(r["verdict"], r, cfg)]
    plain = _run(tmp_path, cpu_trace([("op", 3000), ("python", 3000)]), name="plain")
    assert "optimizer.implementation" not in _keys(plain)


def test_input_bound_trace_gets_data_loading_remedies(tmp_path: Path) -> None:
    r = _run(tmp_path, gpu_trace([("compute", 3000), ("input", 2000)]))
    assert r["verdict"] == "input-bound"
    assert r["remedies"][0]["flag"] == "--data.num_workers 4"
    assert {"data.prefetch_factor", "data.pin_memory"} <= set(_keys(r))


def test_every_cause_over_the_threshold_gets_its_remedy(tmp_path: Path) -> None:
    """Input is second behind host launch (about 20 % of the span): it still gets its own
    remedy, tagged with its cause."""
    r = _run(tmp_path, gpu_trace([("compute", 3000), ("launch", 900), ("launch", 900),
                                  ("input", 1200)]))
    assert r["verdict"] == "cpu/launch-bound"
    input_share = next(c["share"] for c in r["causes"] if c["cause"] == "input")
    assert input_share > 0.15
    by_key = {x.get("key"): x for x in r["remedies"]}
    assert by_key["data.num_workers"]["cause"] == "input"
    assert by_key["compile.enabled"]["cause"] == "cpu/launch"


def test_bf16_only_for_fp32_gemms_and_no_tensor_parallel_for_an_all_reduce(
        tmp_path: Path) -> None:
    bf16 = _run(tmp_path, gpu_trace([("compute", 9000), ("launch", 300)]), name="bf16")
    assert bf16["verdict"] == "compute-bound"
    assert bf16["kernels_summary"]["low_precision_gemm_share"] == 1.0
    assert "precision.dtype" not in _keys(bf16)  # the GEMMs already run in bf16
    fp32 = gpu_trace([("compute", 9000), ("launch", 300)])
    for e in fp32.events:
        if e["cat"] == "kernel":
            e["name"] = "volta_sgemm_128x64_nn"
    r = _run(tmp_path, fp32, name="fp32")
    assert r["remedies"][0]["flag"] == "--precision.dtype bf16"
    comm = _run(tmp_path, gpu_trace([("compute", 3000), ("exposed_comm", 2000)]), name="comm")
    assert comm["verdict"] == "communication-bound"
    assert comm["collectives"]["main"] == "all_reduce"
    keys = _keys(comm)
    assert "parallel.bucket_cap_mb" in keys
    assert "parallel.tp" not in keys and "parallel.dp_shard" not in keys


def test_remedies_in_effect_in_the_config_are_left_out(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from scaletrain.profiling.remedies import remedies

    r = _run(tmp_path, gpu_trace([("compute", 3000), ("optimizer_loop", 3000)]))
    cfg = SimpleNamespace(optimizer=SimpleNamespace(implementation="fused", offload=False),
                          compile=SimpleNamespace(enabled=False))
    keys = [x.get("key") for x in remedies(r["verdict"], r, cfg)]
    assert "optimizer.implementation" not in keys and "compile.enabled" in keys
    cfg = SimpleNamespace(parallel=SimpleNamespace(bucket_cap_mb=200.0))
    comm = _run(tmp_path, gpu_trace([("compute", 3000), ("exposed_comm", 2000)]), name="c")
    assert "parallel.bucket_cap_mb" not in [x.get("key") for x in
                                            remedies(comm["verdict"], comm, cfg)]


def test_the_launch_queue_is_full_only_when_it_is() -> None:
    assert queue_full({"mean": 812.0, "max": 1022})  # the saturated V100 fixture
    assert not queue_full({"mean": 136.0, "max": 400})


def _straggler(tmp_path: Path, slow_segments: list, name: str) -> dict:
    """4 ranks of 2 steps; the others wait for rank 2 in their all-reduce."""
    base = [("compute", 2000)] * 5
    traces = []
    for i in range(4):
        own = slow_segments if i == 2 else base
        work = sum(d for _, d in own)
        traces.append(gpu_trace(own + [("exposed_comm", 16_000 - work)], steps=2, rank=i,
                                world=4))
    return _run(tmp_path, *traces, name=name)


def test_a_slow_device_straggler_is_told_from_extra_work(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    # rank 2 runs the same five GEMMs, each 1.5x longer
    r = _straggler(tmp_path, [("compute", 3000)] * 5, "slow")
    assert r["across_ranks"]["straggler_rank"] == 2
    dev = r["straggler_device"]
    assert dev["cause"] == "slow device" and dev["same_kernels_ratio"] == pytest.approx(1.5)
    assert r["ranks"][2]["kernel_ms_per_step"] == pytest.approx(15.0)
    assert r["ranks"][0]["kernel_ms_per_step"] == pytest.approx(10.0)
    assert "1.50x slower" in r["remedies"][0]["change"]
    assert r["remedies"][0]["cause"] == "slow device"
    # rank 2 runs eight GEMMs of the same length: more work, not a slower device
    r = _straggler(tmp_path, [("compute", 2000)] * 8, "extra")
    assert r["straggler_device"]["cause"] == "extra work"
    assert r["remedies"][0]["cause"] == "extra work"
    paths = sorted(tmp_path.glob("slow_rank*.json.gz"))
    assert diagnose.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "kernels 15.0 ms" in out and "device is slow" in out


def _sized_allreduce(durations: list[float]) -> dict:
    """One all-reduce of 4 Mi floats among 8 ranks per step, with the given durations (the
    reader leaves the profiler's last step out, as HTA does)."""
    t = gpu_trace([("compute", 3000), ("exposed_comm", 3000)], steps=len(durations))
    calls = [e for e in t.events if e["cat"] == "kernel" and e["name"] == NCCL]
    for e, d in zip(calls, [*durations, durations[-1]], strict=True):
        e["dur"] = d
        e["args"].update({"Collective name": "allreduce", "In msg nelems": 4 << 20,
                          "Out msg nelems": 4 << 20, "dtype": "Float", "Group size": 8})
    return t


def test_bus_bandwidth_tells_transfer_from_waiting(tmp_path: Path) -> None:
    r = _run(tmp_path, _sized_allreduce([400.0] * 4), name="even")
    c = r["collectives"]
    g = c["groups"][0]
    assert g["collective"] == "all_reduce" and g["bytes"] == 16 * 2**20 and g["ranks"] == 8
    busbw = 16 * 2**20 / 400e-6 * 2 * 7 / 8 / 1e9  # nccl-tests: algbw x 2(n-1)/n
    assert g["busbw_best_gbps"] == pytest.approx(busbw)
    assert c["reading"] == "transfer" and c["waiting_share"] == 0.0
    r = _run(tmp_path, _sized_allreduce([400.0, 2400.0, 2400.0, 2400.0]), name="wait")
    c = r["collectives"]
    assert c["reading"] == "waiting on a peer"
    assert c["waiting_share"] == pytest.approx(6000 / 7600)
    assert c["groups"][0]["busbw_median_gbps"] == pytest.approx(busbw / 6)


def test_missing_and_nan_durations_are_counted_not_zero(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    t = gpu_trace([("compute", 3000), ("launch", 500)])
    kernels = [e for e in t.events if e["cat"] == "kernel"]
    del kernels[0]["dur"]
    kernels[1]["dur"] = math.nan
    r = _run(tmp_path, t)
    assert any("2 device activities (kernels, copies) without a valid" in w
               for w in r["warnings"])
    assert r["breakdown"]["compute"] > 0.5  # the rest is analysed, not turned into idle
    # every kernel untimed: a device job without kernel timing, never "nan %"
    for e in kernels:
        e["dur"] = math.nan
    path = t.write(tmp_path / "untimed.json.gz")
    assert diagnose.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "nan %" not in out and "VERDICT: no kernel timing" in out
    assert "10 device activities without a duration" in out


def test_mtia_timed_device_events_are_kernel_timing(tmp_path: Path) -> None:
    t = gpu_trace([("compute", 3000), ("launch", 2000)])
    for e in t.events:
        if e["cat"] == "cuda_runtime":
            e["cat"], e["name"] = "mtia_runtime", "mtiaLaunchKernel"
        elif e["cat"] == "kernel":
            e["cat"] = "mtia_ccp_events"
    r = _run(tmp_path, t)
    assert r["platform"] == "mtia" and r["verdict"] == "cpu/launch-bound", r.get("note")
    assert r["breakdown"]["idle"] == pytest.approx(
        _run(tmp_path, gpu_trace([("compute", 3000), ("launch", 2000)]),
             name="cuda")["breakdown"]["idle"])
