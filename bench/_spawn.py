"""Run one function on `world` spawned CPU ranks and collect the JSON each rank writes."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def spawn_json(rank_main: Callable[..., None], world: int, *args: Any) -> list[dict[str, Any]]:
    """`rank_main(rank, world, port, *args, out)` on `world` spawned processes; each writes
    `out/rank{rank}.json`, returned in rank order."""
    import torch.multiprocessing as mp

    from bench.fused_loss_tp_cpu import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(world, free_port(), *args, out), nprocs=world,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def torchrun_records(script: str, ranks: int, args: list[str], env: dict[str, str]
                     ) -> list[dict[str, Any]]:
    """`torchrun --standalone --nproc_per_node ranks script --worker DIR *args --output RUN`:
    each rank's record (`DIR/rank*.json`), in rank order; a failed launch exits with its
    stderr's end."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "records")
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(ranks), script, "--worker", str(out), *args,
               "--output", str(Path(tmp, "run"))]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                      key=lambda r: r["rank"])
