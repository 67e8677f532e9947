"""A rank that dies mid-run: the other exits with an error naming it, inside the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.worker import free_port

SCRIPT = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.trainer_helpers import tiny_argv
from scaletrain.train.trainer import Trainer
from scaletrain.commands import train

if os.environ["RANK"] == "1":  # this rank dies in its third step
    original = Trainer.run_step
    def dying_step(self, batches):
        if self.step == 2:
            os._exit(17)
        return original(self, batches)
    Trainer.run_step = dying_step
argv = tiny_argv(Path({out!r}), Path({cache!r}), "--training.steps", "50",
                 "--parallel.timeout_s", "60", "--checkpoint.save_final", "false")
sys.exit(train.main(argv))
"""


@pytest.mark.distributed
def test_killed_rank_is_named_and_the_others_exit(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(root=root, out=str(tmp_path / "out"),
                                    cache=str(tmp_path / "cache")))
    # Prepare the corpus once so both ranks only read it.
    from scaletrain.train.trainer import Trainer
    from tests.trainer_helpers import tiny_config

    Trainer(tiny_config(tmp_path / "warm", tmp_path / "cache", "--training.steps", "1"))
    port = str(free_port())
    procs = []
    start = time.monotonic()
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        _, err0 = procs[0].communicate(timeout=120)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 17
    assert procs[0].returncode == 1, err0[-2000:]
    assert "rank(s) 1 stopped responding" in err0, err0[-2000:]
    assert "at step 3" in err0
    assert elapsed < 60 + 30  # inside the collective timeout (plus start-up)
