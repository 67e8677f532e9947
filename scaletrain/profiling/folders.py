"""The traces of a folder written by PyTorch's `tensorboard_trace_handler`.

`torch.profiler.tensorboard_trace_handler(dir, worker_name=None, use_gzip=False)` writes one
file per worker (process: rank) and profiling cycle, `{worker}.{time_ns}.pt.trace.json[.gz]`,
the worker defaulting to `{hostname}_{pid}`. With `schedule(..., repeat=N)` each worker leaves N
files. `diagnose` reads the newest cycle of every worker, as it reads the newest step of every
rank in a `scaletrain profile` folder.
"""

from __future__ import annotations

import re
from pathlib import Path

_HANDLER_RE = re.compile(r"^(?P<worker>.+)\.(?P<time>\d+)\.pt\.trace\.json(?:\.gz)?$")


def handler_traces(folder: str | Path) -> list[Path]:
    """The newest trace of each worker in `folder` (not its subfolders), ordered by worker."""
    newest: dict[str, tuple[int, Path]] = {}
    for p in Path(folder).iterdir():
        m = _HANDLER_RE.match(p.name)
        if m is None or not p.is_file():
            continue
        worker, stamp = m["worker"], int(m["time"])
        if worker not in newest or stamp > newest[worker][0]:
            newest[worker] = (stamp, p)
    return [newest[w][1] for w in sorted(newest)]


def run_folders(logdir: str | Path) -> list[Path]:
    """Subfolders holding handler traces: a TensorBoard logdir with one folder per run."""
    return sorted(p for p in Path(logdir).iterdir() if p.is_dir() and handler_traces(p))


def memory_timelines(folder: str | Path) -> dict[int, str]:
    """`memory_timeline_rank{R}.raw.json[.gz]` files of a profile folder, by rank."""
    out: dict[int, str] = {}
    for f in sorted(Path(folder).glob("memory_timeline_rank*.raw.json*")):
        rank = f.name.removeprefix("memory_timeline_rank").split(".")[0]
        if rank.isdigit():
            out[int(rank)] = str(f)
    return out
