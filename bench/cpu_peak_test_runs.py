"""Run `tests/plan/memory/distributed/test_cpu_peak.py` several times, each with a fresh basetemp,
alone or with busy-loop processes alongside, and collect each layout's planned/measured peak.

    python bench/cpu_peak_test_runs.py 3            # 3 runs of the file on the machine as it is
    python bench/cpu_peak_test_runs.py 2 --busy 2   # 2 runs with 2 busy loops alongside

Each run's figures come from the test's own `record_property` (pytest `--junitxml`); one line
per layout and run is appended to `bench/results/cpu_peak_test_runs.txt` with the load average
at the run's start.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "cpu_peak_test_runs.txt"


def busy(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def one_run(busy_loops: int) -> tuple[str, list[str]]:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp, "junit.xml")
        stop_at = time.time() + 900
        loops = [multiprocessing.Process(target=busy, args=(stop_at,))
                 for _ in range(busy_loops)]
        for p in loops:
            p.start()
        started = time.time()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "--basetemp", str(Path(tmp, "basetemp")), "--junitxml", str(xml),
                 "-o", "junit_family=xunit1",
                 "tests/plan/memory/distributed/test_cpu_peak.py"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                text=True)
        finally:
            for p in loops:
                p.terminate()
                p.join()
        lines = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            props = {p.get("name"): float(p.get("value")) for p in case.iter("property")}
            if "planned_mib" not in props:
                continue
            failed = case.find("failure") is not None
            planned, measured = props["planned_mib"], props["measured_mib"]
            lines.append(f"  {case.get('name').split('[')[-1].rstrip(']'):12s} planned "
                         f"{planned:6.1f} MiB measured {measured:6.1f} MiB "
                         f"({planned / measured - 1:+.1%}){'  FAILED' if failed else ''}")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    head = (f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(started))} UTC, busy loops "
            f"{busy_loops}, load1 at start {load:.1f}: {summary}")
    return head, lines


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    busy_loops = int(sys.argv[sys.argv.index("--busy") + 1]) if "--busy" in sys.argv else 0
    for _ in range(runs):
        head, lines = one_run(busy_loops)
        text = "\n".join([head, *lines]) + "\n"
        print(text, end="", flush=True)
        with RESULTS.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
