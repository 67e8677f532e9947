"""Nsight Systems SQLite exports, built here with the documented export schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from scaletrain.profiling.analyze import analyze
from scaletrain.profiling.load import load
from scaletrain.profiling.trace import TraceError

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
US = 1000  # the export's unit is the nanosecond

SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL,
  deviceId INT NOT NULL, contextId INT NOT NULL, streamId INT NOT NULL,
  correlationId INT, globalPid INT, demangledName INT NOT NULL, shortName INT NOT NULL,
  mangledName INT, gridX INT, gridY INT, gridZ INT, blockX INT, blockY INT, blockZ INT);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT NOT NULL, end INT NOT NULL,
  deviceId INT NOT NULL, contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT,
  globalPid INT, bytes INT NOT NULL, copyKind INT NOT NULL, srcKind INT, dstKind INT);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INT NOT NULL, end INT NOT NULL,
  deviceId INT NOT NULL, contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT,
  globalPid INT, value INT NOT NULL, bytes INT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT NOT NULL, end INT NOT NULL,
  eventClass INT NOT NULL, globalTid INT, correlationId INT, nameId INT NOT NULL,
  returnValue INT NOT NULL, callchainId INT);
CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT,
  category INT, color INT, text TEXT, globalTid INT, endGlobalTid INT, textId INT,
  domainId INT, uint64Value INT, int64Value INT, doubleValue REAL, uint32Value INT,
  int32Value INT, floatValue REAL, jsonTextId INT, jsonText TEXT);
"""


def build(path: Path) -> Path:
    """Three 10 ms steps (the last is left out, as in HTA). Per step on stream 7: five 500 us
    bf16 GEMMs queued early with 100 us gaps, a 1 ms elementwise kernel launched late (host
    wait), a 200 us host-to-device copy and a 50 us memset that overlaps it on stream 8."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    names = {1: GEMM, 2: ELEMENTWISE, 3: "cudaLaunchKernel_v7000", 4: "cudaMemcpyAsync_v3020",
             5: "scaletrain/data", 6: "cudaMemsetAsync_v3020"}
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", names.items())
    pid = 1234 << 24  # globalPid: the process id above 24 bits of thread id
    tid = pid | 1234
    corr = 0

    def launch(t_us: float, name_id: int) -> int:
        nonlocal corr
        corr += 1
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,1,?,?,?,0,0)",
                   (int(t_us * US), int((t_us + 5) * US), tid, corr, name_id))
        return corr

    def kernel(start_us: float, dur_us: float, name_id: int, c: int) -> None:
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES "
                   "(?,?,0,1,7,?,?,?,?,0,1,1,1,128,1,1)",
                   (int(start_us * US), int((start_us + dur_us) * US), c, pid, name_id,
                    name_id))

    for s in range(3):
        base = s * 10_000
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) "
                   "VALUES (?,?,59,?,?)", (base * US, (base + 10_000) * US, f"scaletrain/step#{s}",
                                          tid))
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, textId, globalTid) "
                   "VALUES (?,?,59,5,?)", ((base + 4900) * US, (base + 5000) * US, tid))
        for k in range(5):
            kernel(base + 100 + 600 * k, 500, 1, launch(base + 10 * k, 3))
        kernel(base + 5010, 1000, 2, launch(base + 5000, 3))
        c = launch(base + 6100, 4)
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,0,1,7,?,?,1048576,1,0,1)",
                   ((base + 6110) * US, (base + 6310) * US, c, pid))
        c = launch(base + 6101, 6)
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (?,?,0,1,8,?,?,0,4096)",
                   ((base + 6150) * US, (base + 6200) * US, c, pid))
    db.commit()
    db.close()
    return path


def test_nsys_export_analysis(tmp_path: Path) -> None:
    r = analyze([build(tmp_path / "report.sqlite")])
    assert r["platform"] == "cuda" and r["time_unit"] == "ns"
    assert r["cpu"]["step_numbers"] == [0, 1]  # step 2 is left out
    span = 16_310 - 100
    assert r["span_us"] == pytest.approx(span)
    b = r["breakdown"]
    assert b["compute"] == pytest.approx(2 * 3500 / span)
    assert b["memory"] == pytest.approx(2 * 200 / span)
    assert b["idle"] == pytest.approx((span - 7400) / span)
    # host wait: the late elementwise launch (2010 us), the copy (100 us), between steps (3790)
    assert r["idle_breakdown"]["host_wait"] == pytest.approx(8010 / 8810)
    assert r["idle_breakdown"]["other"] == pytest.approx(800 / 8810)
    # nsys cuda_gpu_kern_sum's Time %: a kernel's total over all kernel time
    top = {k["name"]: k for k in r["top_kernels"]}
    assert top[GEMM]["share"] == pytest.approx(5000 / 7000)
    assert top[GEMM]["count"] == 10 and top[GEMM]["tensor_core_gemm"]
    assert r["kernels_summary"]["tensor_core_gemm_share"] == pytest.approx(5000 / 7000)
    assert r["kernels_summary"]["memory_ops_share_of_gpu_time"] == pytest.approx(500 / 7500)
    assert r["input_wait"] == pytest.approx(200 / span)  # NVTX data range over idle GPU time
    assert r["cpu"]["phases"]["data"]["ms_per_step"] == pytest.approx(0.1)
    assert r["verdict"] == "cpu/launch-bound"


def test_nsys_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.sqlite"
    sqlite3.connect(empty).execute("CREATE TABLE StringIds (id INTEGER, value TEXT)").connection \
        .close()
    with pytest.raises(TraceError, match="no CUDA activity tables"):
        load(empty)
    whole = build(tmp_path / "r.sqlite").read_bytes()
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(whole[:4096])
    with pytest.raises(TraceError, match="nsys"):
        load(cut)
    rep = tmp_path / "x.nsys-rep"
    rep.write_bytes(b"\0" * 32)
    with pytest.raises(TraceError, match="nsys export --type sqlite"):
        load(rep)


def test_nsys_export_of_two_gpus_is_two_timelines(tmp_path: Path) -> None:
    """The same work recorded on deviceId 1 (new correlation ids, same times): merged into
    one timeline it would look like overlapped kernels; per device it is two equal ranks."""
    path = build(tmp_path / "two.sqlite")
    db = sqlite3.connect(path)
    shift = 1_000_000
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME SELECT start, end, eventClass, "
               f"globalTid + 1, correlationId + {shift}, nameId, returnValue, callchainId "
               "FROM CUPTI_ACTIVITY_KIND_RUNTIME")
    for table in ("KERNEL", "MEMCPY", "MEMSET"):
        cols = [r[1] for r in db.execute(f"PRAGMA table_info(CUPTI_ACTIVITY_KIND_{table})")]
        sel = ", ".join("1" if c == "deviceId" else f"correlationId + {shift}"
                        if c == "correlationId" else c for c in cols)
        db.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_{table} SELECT {sel} "
                   f"FROM CUPTI_ACTIVITY_KIND_{table}")
    db.commit()
    db.close()
    one = analyze([build(tmp_path / "one.sqlite")])
    two = analyze([path])
    assert [r["rank"] for r in two["ranks"]] == [0, 1]
    for r in two["ranks"]:
        assert r["breakdown"] == pytest.approx(one["breakdown"])


def test_nsys_export_without_kernel_rows_is_a_device_job(tmp_path: Path) -> None:
    path = build(tmp_path / "calls.sqlite")
    db = sqlite3.connect(path)
    for table in ("KERNEL", "MEMCPY", "MEMSET"):
        db.execute(f"DELETE FROM CUPTI_ACTIVITY_KIND_{table}")
    db.commit()
    db.close()
    r = analyze([path])
    assert r["platform"] == "cuda" and r["verdict"] == "no kernel timing"


NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
STEPS = 6  # the last one is left out: 5 analysed
OFFSET_US = 37


def add_rank(db: sqlite3.Connection, rank: int, work_us: float) -> None:
    """One torchrun process (pid 4000 + rank, GPU `rank`) in an export: per 10 ms step an NVTX
    step range (rank r's steps start 37 r us later), `work_us` of GEMMs launched at the
    step's start, then an all-reduce that every rank finishes at the same time (a rank with
    less work waits longer in it). Correlation ids start from 1 in every process, as CUPTI
    numbers them."""
    pid = (4000 + rank) << 24
    tid = pid | (4000 + rank)
    db.executemany("INSERT OR IGNORE INTO StringIds VALUES (?, ?)",
                   {1: GEMM, 3: "cudaLaunchKernel_v7000", 7: NCCL}.items())
    corr = 0

    def kernel(launch_us: float, start_us: float, dur_us: float, name_id: int,
               stream: int) -> None:
        nonlocal corr
        corr += 1
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,1,?,?,3,0,0)",
                   (int(launch_us * US), int((launch_us + 5) * US), tid, corr))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES "
                   "(?,?,?,1,?,?,?,?,?,0,1,1,1,128,1,1)",
                   (int(start_us * US), int((start_us + dur_us) * US), rank, stream, corr, pid,
                    name_id, name_id))

    for s in range(STEPS):
        base = 1000 + s * 10_000 + OFFSET_US * rank
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) "
                   "VALUES (?,?,59,?,?)", (base * US, (base + 10_000) * US,
                                          f"scaletrain/step#{s}", tid))
        n = 4
        for k in range(n):
            kernel(base + 5 * k, base + 100 + k * work_us / n, work_us / n, 1, 7)
        done = 1000 + s * 10_000 + 8_500  # the same instant on every rank
        kernel(base + 30, base + 100 + work_us, done - (base + 100 + work_us), 7, 20)


def _export(path: Path, ranks: dict[int, float]) -> Path:
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    for rank, work in ranks.items():
        add_rank(db, rank, work)
    db.commit()
    db.close()
    return path


def test_a_multi_process_export_equals_one_export_per_rank(tmp_path: Path) -> None:
    """`nsys profile torchrun --nproc-per-node 4 ...` writes the 4 processes into one export
    with overlapping correlation ids: read per process, it gives the figures of 4 exports."""
    work = {0: 3000.0, 1: 3100.0, 2: 6000.0, 3: 2900.0}  # rank 2 is the straggler
    merged = analyze([_export(tmp_path / "all.sqlite", work)])
    apart = analyze([_export(tmp_path / f"rank{r}.sqlite", {r: w}) for r, w in work.items()])
    assert [r["rank"] for r in merged["ranks"]] == [0, 1, 2, 3]
    for a, b in zip(merged["ranks"], apart["ranks"], strict=True):
        assert a["breakdown"] == pytest.approx(b["breakdown"])
        assert a["step_ms"] == pytest.approx(b["step_ms"])
        assert a["work_ms_per_step"] == pytest.approx(b["work_ms_per_step"])
        assert a["verdict"] == b["verdict"]
    assert merged["cpu"]["steps"] == apart["cpu"]["steps"] == STEPS - 1
    ar, br = merged["across_ranks"], apart["across_ranks"]
    assert ar["straggler_rank"] == br["straggler_rank"] == 2
    # own work = step less all-reduce = work + the rank's start offset; less the median other's
    own = {r: w + OFFSET_US * r for r, w in work.items()}
    excess = (own[2] - sorted(v for r, v in own.items() if r != 2)[1]) / 1e3
    assert ar["straggler_excess_ms"] == pytest.approx(br["straggler_excess_ms"])
    assert ar["straggler_excess_ms"] == pytest.approx(excess, abs=0.01)
    assert merged["top_kernels"] == apart["top_kernels"]
