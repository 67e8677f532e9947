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
