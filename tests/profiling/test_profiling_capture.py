"""Our own profiler on CPU: traces are written, and a run made input-bound with a slow dataset is
diagnosed input-bound, while the same run with DataLoader workers is not."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scaletrain.data.loader import Windows
from scaletrain.profiling.analyze import analyze, latest_traces
from scaletrain.train.trainer import Trainer
from tests.helpers.trainer import tiny_config

PROFILE = ["--profiling.enabled", "true", "--profiling.wait", "1", "--profiling.warmup", "1",
           "--profiling.active", "3", "--training.steps", "5", "--training.eval_sequences", "4",
           "--checkpoint.save_final", "false",
           # a model big enough that compute, not DataLoader IPC, fills the fixed run's step
           "--data.seq_len", "64", "--model.dim", "128", "--model.ffn_dim", "256",
           "--training.micro_batch_size", "16"]
# Per sequence: 80 ms per batch of 16, longer than the model's step even on a loaded machine
# (sleeping, like a slow network disk, so the delay does not grow with load the way compute does);
# 8 workers deliver a batch every 10 ms, faster than the step even on an idle machine. Batches of
# 16 keep the fixed run's per-batch cost of receiving from a worker small against its compute.
SAMPLE_DELAY_S = 0.005


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded machine OpenMP's spinning threads slow tiny ops by
    10-50x, which would let compute swamp any data delay."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def slow_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sequence takes SAMPLE_DELAY_S to load (like a dataset on a slow network disk)."""
    fetch = Windows.__getitems__  # the loader fetches a whole batch of samples at once

    def slow(self, indices):  # type: ignore[no-untyped-def]
        time.sleep(SAMPLE_DELAY_S * len(indices))
        return fetch(self, indices)

    monkeypatch.setattr(Windows, "__getitems__", slow)


def _profile(out: Path, cache: Path, *extra: str) -> dict:
    cfg = tiny_config(out, cache, *PROFILE, *extra)
    Trainer(cfg).train()
    traces = latest_traces(out / "profile")
    assert len(traces) == 1
    return analyze(traces, cfg=cfg)


def test_trace_has_our_ranges_and_steps(tmp_path: Path, cache: Path) -> None:
    r = _profile(tmp_path / "run", cache)
    trace = latest_traces(tmp_path / "run" / "profile")[0]
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    for phase in ("data", "forward", "backward", "optimizer"):
        assert f"scaletrain/{phase}" in names
        assert r["cpu"]["phases"][phase]["ms_per_step"] > 0
    steps = sorted(n for n in names if n and n.startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # the active steps
    assert r["platform"] == "cpu" and r["cpu"]["steps"] == 3
    assert sum(r["breakdown"].values()) == pytest.approx(1.0)
    assert r["memory"]["peak_allocated_bytes"] > 0  # profile_memory events


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_slow_dataset_is_input_bound_and_workers_fix_it(tmp_path: Path, cache: Path,
                                                        slow_dataset: None,
                                                        one_thread: None) -> None:
    slow = _profile(tmp_path / "slow", cache)
    assert slow["verdict"] == "input-bound", slow["evidence"]
    assert slow["input_wait"] > 0.15  # the verdict's threshold (the share varies with load)
    keys = [r.get("key") for r in slow["remedies"]]
    assert "data.num_workers" in keys
    num_workers = next(r for r in slow["remedies"] if r.get("key") == "data.num_workers")
    assert num_workers["current"] == "0" and num_workers["flag"] == "--data.num_workers 4"

    fixed = _profile(tmp_path / "fixed", cache, "--data.num_workers", "8",
                     "--data.prefetch_factor", "4", "--profiling.wait", "3",
                     "--training.steps", "7")
    assert fixed["verdict"] != "input-bound", fixed["evidence"]
    assert fixed["input_wait"] < slow["input_wait"] / 3


def test_profile_verb_writes_report(tmp_path: Path, cache: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from scaletrain.commands import profile
    from tests.helpers.trainer import tiny_argv

    out = tmp_path / "p"
    argv = tiny_argv(out, cache)
    i = argv.index("--training.steps")
    del argv[i : i + 2]  # the verb runs as many steps as the profiler schedule needs
    assert profile.main([*argv, "--profiling.memory_timeline", "true"]) == 0
    report = json.loads((out / "profile" / "diagnosis.json").read_text())
    memory = report["memory"]  # from the exported memory timeline, by category
    assert memory["source"].startswith("memory timeline")
    assert memory["at_peak"]["parameter"] > 0 and memory["at_peak"]["optimizer_state"] > 0
    assert memory["peak_phase"] in {"forward", "backward", "optimizer"}
    assert report["verdict"] in {"compute-bound", "overhead-bound", "input-bound", "mixed"}
    assert report["cpu"]["steps"] == 3  # wait 1 + warmup 1 + active 3 steps were run
    assert "<svg" in (out / "profile" / "report.html").read_text()
    assert "VERDICT" in capsys.readouterr().out
    from scaletrain.commands import diagnose

    assert diagnose.main([str(out / "profile"), "--json"]) == 0  # a folder: its newest traces
    assert json.loads(capsys.readouterr().out)["verdict"] == report["verdict"]


class _FakeProfiler:
    def step(self) -> None:
        pass


def test_nsys_capture_range_follows_the_schedule(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """cudaProfilerStart/Stop bracket exactly the active steps (checked without a GPU)."""
    import torch

    from scaletrain.config import ProfilingConfig
    from scaletrain.profiling.capture import StepProfiler

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda m: calls.append(f"push {m}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    cfg = ProfilingConfig(enabled=True, wait=1, warmup=1, active=2, repeat=1, nsys=True)
    prof = StepProfiler(cfg, tmp_path, torch.device("cpu"), rank=0)
    prof.cuda, prof._prof = True, _FakeProfiler()  # as if on a GPU with the profiler running
    seen = []
    for step in range(1, 7):  # the training loop: step N runs, then prof.step()
        seen.append((step, prof._nsys_on))
        prof.step()
    prof._prof = None
    prof.stop()
    assert [s for s, on in seen if on] == [3, 4]  # wait 1 + warmup 1, then 2 active steps
    assert calls == ["start", "push scaletrain/step#3", "pop", "push scaletrain/step#4", "pop",
                     "stop"]


def test_oom_writes_snapshot_and_plan_estimate(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The OOM path (CUDA-only) with the CUDA calls replaced: snapshot + summary, error kept."""
    import torch

    from scaletrain.config import ProfilingConfig
    from scaletrain.plan import from_config
    from scaletrain.profiling import capture

    monkeypatch.setattr(capture, "dump_snapshot", lambda p: Path(p).write_bytes(b"snapshot"))
    monkeypatch.setattr(capture, "cuda_memory_stats", lambda d: {"max_allocated_bytes": 7})
    monkeypatch.setattr(from_config, "estimate_for_config",
                        lambda cfg: {"total_bytes": 5, "model": cfg})
    prof = capture.StepProfiler(ProfilingConfig(), tmp_path, torch.device("cpu"), rank=3)
    prof.cuda = True  # as if training on a GPU
    with pytest.raises(torch.OutOfMemoryError), prof.oom_guard("the-config"):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert (tmp_path / "profile" / "oom_snapshot_rank3.pickle").read_bytes() == b"snapshot"
    info = json.loads((tmp_path / "profile" / "oom_rank3.json").read_text())
    assert info["max_allocated_bytes"] == 7 and info["step"] == 1
    assert info["plan_estimate"] == {"total_bytes": 5, "model": "the-config"}
    assert capture.plan_estimate(None) is None
