"""Killing the curation driver mid-stage: its workers are gone within seconds, and running
the command again gives the output of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.curate import fixture_dir
from tests.helpers.proc import scaled

REPO = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _run(out: Path, *, wait: bool = True) -> subprocess.Popen:
    inputs = [str(p) for p in sorted(fixture_dir().glob("ccnet_en_head-*.jsonl.gz"))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.lifeline_driver", str(out),
                             *inputs],
                            cwd=REPO, env=env)
    if wait:
        assert proc.wait(timeout=scaled(120)) == 0
    return proc


def _result(out: Path) -> dict[str, bytes]:
    files = sorted(p for p in out.rglob("*") if p.is_file() and "_work" not in p.parts
                   and p.name not in ("stats.json", ".lock"))
    return {str(p.relative_to(out)): p.read_bytes() for p in files}


def test_killed_driver_leaves_no_workers_and_rerun_is_identical(tmp_path: Path) -> None:
    if not Path("/proc/self/stat").exists():
        import pytest

        pytest.skip("needs /proc (Linux)")
    _run(tmp_path / "ref")
    out = tmp_path / "killed"
    proc = _run(out, wait=False)
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while time.monotonic() < deadline and not (out / "_work/job-0/done").is_dir():
        time.sleep(0.05)
    while time.monotonic() < deadline and len(workers) < 2:
        workers = _children(proc.pid)
        time.sleep(0.05)
    assert len(workers) >= 2, "the driver did not start its workers"
    assert not (out / "manifest.json").exists()  # killed mid-stage
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    while any(_alive(w) for w in workers) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "workers outlived their driver"
    assert time.monotonic() - t0 < 5

    _run(out)  # the same command again finishes the run
    assert _result(out) == _result(tmp_path / "ref")


def test_a_run_waits_for_processes_of_an_earlier_run(tmp_path: Path) -> None:
    """A stale worker inherits the run lock: a new run in the same folder waits for it
    (and says so after its timeout) instead of racing it on the same files."""
    import pytest

    from scaletrain.curate.executors.lifeline import RunLock

    with RunLock(str(tmp_path)):
        pid = os.fork()
        if pid == 0:  # a worker forked during the run, outliving it
            time.sleep(1.5)
            os._exit(0)
    with pytest.raises(RuntimeError, match="in use by another run"), \
            RunLock(str(tmp_path), timeout=0.3):
        pass
    t0 = time.monotonic()
    with RunLock(str(tmp_path), timeout=30):
        assert time.monotonic() - t0 > 0.5  # it waited for the stale process to end
    os.waitpid(pid, 0)
