"""A rank that dies mid-run: the other exits with an error naming it, inside the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.proc import Rendezvous, scaled

SCRIPT = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.helpers.trainer import tiny_argv
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
                 "--parallel.timeout_s", "{timeout}", "--checkpoint.save_final", "false")
code = train.main(argv)
sys.stdout.flush(); sys.stderr.flush()
os._exit(code)  # as run_ranks' ranks do: no interpreter shutdown (see tests/helpers/proc.py)
"""
TIMEOUT_S = 60  # the collective timeout of the run


@pytest.mark.distributed
def test_killed_rank_is_named_and_the_others_exit(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[3])
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(root=root, out=str(tmp_path / "out"),
                                    cache=str(tmp_path / "cache"), timeout=TIMEOUT_S))
    # Prepare the corpus once so both ranks only read it.
    from scaletrain.train.trainer import Trainer
    from tests.helpers.trainer import tiny_config

    Trainer(tiny_config(tmp_path / "warm", tmp_path / "cache", "--training.steps", "1"))
    procs = []
    # Output to files, not pipes: a pipe nobody reads while waiting for the other rank fills
    # and stalls its writer.
    logs = [tmp_path / f"rank{r}.err" for r in range(2)]
    with Rendezvous() as rdzv:
        for rank in range(2):
            env = {**os.environ, **rdzv.env(rank, 2), "OMP_NUM_THREADS": "1"}
            with open(logs[rank], "w") as err:
                procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                              stdout=subprocess.DEVNULL, stderr=err))
        try:
            procs[1].wait(timeout=scaled(300))  # start-up and two steps, then it dies
            died = time.monotonic()
            procs[0].wait(timeout=scaled(TIMEOUT_S + 60))
            noticed = time.monotonic() - died
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    err0 = logs[0].read_text()
    assert procs[1].returncode == 17, logs[1].read_text()[-2000:]
    assert procs[0].returncode == 1, err0[-2000:]
    assert "rank 1 stopped responding" in err0, err0[-2000:]
    assert "at step 3" in err0
    # The survivor leaves on the closed connection, well inside the collective timeout (it
    # would otherwise wait all of it). Measured from the death, so start-up time on a loaded
    # machine does not count.
    assert noticed < TIMEOUT_S, noticed
