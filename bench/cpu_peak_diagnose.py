"""Where a CPU rank's peak above its baseline comes from: anonymous or file-backed pages.

    python bench/cpu_peak_diagnose.py tp2_dp2 [--fresh-cache] [--load N] [--repeat K]
    python bench/cpu_peak_diagnose.py all --pageout     # every layout of the test, once

Runs one layout of `tests/plan/memory/distributed/test_cpu_peak.py` (same flags, the trainer's
defaults) under torchrun and, from outside, samples rank 0's /proc/PID/status every few
milliseconds. Printed per run: the planned peak, the trainer's measured peak (VmHWM above the
baseline), and the resident set at the baseline and at the sampled peak split into RssAnon / RssFile
/ RssShmem, so an excess shows which kind of page it is. `--fresh-cache`: a new tokenizer cache
for every run (the first layout of the test file builds it, the later ones load it);
`--load N`: N busy-loop processes run alongside (a loaded CI machine); `--pageout`: rank 0
unmaps its libraries' code pages just before the baseline (what the kernel's reclaim does on a
host under memory pressure; the first step maps them again). The trainer's measured peak is
its private memory's (`train/metrics.py` `MemoryBaseline`); the sampled split shows what the
whole resident set did.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM", "Threads")


def status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                value = int(rest.split()[0])
                out[key] = value * 1024 if key != "Threads" else value
    return out


def pageout_file_pages() -> int:
    """What the kernel's reclaim does to a process under memory pressure, on this process
    only: the pages of its libraries' code unmapped (`madvise(MADV_DONTNEED)` on the
    executable file mappings, which are never written: a later use faults them in again from
    the page cache); the bytes of RssFile this dropped."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    before = status()["RssFile"]
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6 or not parts[5].startswith("/") or parts[1] != "r-xp":
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            libc.madvise(lo, hi - lo, 4)  # MADV_DONTNEED: unmapped, faulted in again on use
    return before - status()["RssFile"]


def worker(out_dir: str, argv: list[str]) -> None:
    import logging

    logging.disable(logging.WARNING)
    from scaletrain.config import load_config
    from scaletrain.plan.from_config import plan_config
    from scaletrain.runtime import resolve_device
    from scaletrain.train import metrics
    from scaletrain.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    cfg = load_config(argv)
    plan, _ = plan_config(cfg, resolve_device(cfg.training.device))
    at_baseline: dict = {}
    original = metrics.MemoryBaseline.__init__

    def baseline_init(self, device):  # type: ignore[no-untyped-def]
        if os.environ.get("DIAG_PAGEOUT") and rank == 0:
            at_baseline["paged_out"] = pageout_file_pages()
        original(self, device)
        at_baseline.update(status(), time=time.time())

    metrics.MemoryBaseline.__init__ = baseline_init  # type: ignore[method-assign]
    import scaletrain.train.trainer as trainer_module

    trainer_module.MemoryBaseline.__init__ = baseline_init  # type: ignore[method-assign]
    trainer = Trainer(cfg)
    trainer.train()
    record = {"rank": rank, "planned": plan.peak_bytes,
              "measured": int(trainer.mem_baseline.peak_above_gib() * 2**30),
              "baseline": at_baseline, "end": status(), "memory_bytes": plan.memory_bytes}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def busy(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def sample(pid_file: Path, proc: subprocess.Popen) -> list[tuple[float, dict]]:
    while not pid_file.exists() and proc.poll() is None:
        time.sleep(0.01)
    samples = []
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return samples
    while proc.poll() is None:
        try:
            samples.append((time.time(), status(pid)))
        except (OSError, ValueError):
            break
        time.sleep(0.002)
    return samples


def run(layout: str, cache: Path, load: int) -> dict:
    from tests.plan.memory.distributed.test_cpu_peak import LAYOUTS, _env, _flags

    world, extra = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "records")
        out.mkdir()
        flags = [*_flags(Path(tmp, "run"), cache), *extra]
        env = {**_env(), "PYTHONPATH": str(ROOT)}
        stop_at = time.time() + 600
        loaders = [multiprocessing.Process(target=busy, args=(stop_at,)) for _ in range(load)]
        for p in loaders:
            p.start()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(world), __file__, "--worker", str(out), *flags]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        samples = sample(out / "rank0.pid", proc)
        _, err = proc.communicate()
        for p in loaders:
            p.terminate()
            p.join()
        if proc.returncode:
            raise SystemExit(err[-3000:])
        rec = json.loads((out / "rank0.json").read_text())
    base = rec["baseline"]
    after = [s for t, s in samples if t >= base["time"] and "VmRSS" in s]
    top = max(after, key=lambda s: s["VmRSS"]) if after else {}
    rec["sampled_peak"] = top
    rec["n_samples"] = len(after)
    return rec


def line(layout: str, rec: dict, note: str) -> str:
    mib = 2**20
    base, top = rec["baseline"], rec["sampled_peak"]
    parts = [f"{layout} {note}: planned {rec['planned'] / mib:.1f} measured "
             f"{rec['measured'] / mib:.1f} MiB ({rec['planned'] / rec['measured'] - 1:+.1%})"]
    if top:
        parts.append("sampled peak above baseline: " + " ".join(
            f"{k} {(top[k] - base[k]) / mib:+.1f}" for k in ("VmRSS", "RssAnon", "RssFile",
                                                             "RssShmem")))
    if "paged_out" in base:
        parts.append(f"paged out before baseline {base['paged_out'] / mib:.1f} MiB")
    parts.append("at baseline: " + " ".join(f"{k} {base[k] / mib:.1f}" for k in
                                           ("VmRSS", "RssAnon", "RssFile", "RssShmem"))
                 + f" threads {base['Threads']}")
    return " | ".join(parts)


def main() -> None:
    from tests.plan.memory.distributed.test_cpu_peak import LAYOUTS

    args = sys.argv[1:]
    layouts = list(LAYOUTS) if args[0] == "all" else [args[0]]
    fresh = "--fresh-cache" in args
    load = int(args[args.index("--load") + 1]) if "--load" in args else 0
    repeat = int(args[args.index("--repeat") + 1]) if "--repeat" in args else 1
    if "--pageout" in args:
        os.environ["DIAG_PAGEOUT"] = "1"  # read by rank 0's worker
    with tempfile.TemporaryDirectory() as shared:
        for layout in layouts:
            for _ in range(repeat):
                built = fresh or not Path(shared, "cache").exists()
                cache = Path(tempfile.mkdtemp(dir=shared)) if fresh else Path(shared, "cache")
                note = (f"{'fresh' if built else 'cached'} cache, load {load}"
                        + (", code pages dropped" if "--pageout" in args else ""))
                rec = run(layout, cache, load)
                print(line(layout, rec, note), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
