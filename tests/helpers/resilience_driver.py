"""`scaletrain train` as a torchrun worker, with faults injected for the resilience tests:

    python -m torch.distributed.run ... -m tests.helpers.resilience_driver [--kill R:S,...]
        [--stop R:S] [--sleep SECONDS] --train TRAIN_ARGS

(`--train`, not `--`: torchrun's parser drops a `--` from the script's arguments.)

- `--kill R:S,...`: the i-th entry applies to torchrun's i-th start of the workers
  (TORCHELASTIC_RESTART_COUNT): rank R kills itself with SIGKILL before its step S.
- `--stop R:S`: rank R stops itself with SIGSTOP before its step S (a hung rank).
- `--sleep SECONDS`: every rank sleeps after each step (time to signal a run mid-way).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any


def _pairs(text: str) -> list[tuple[int, int]]:
    return [(int(r), int(s)) for r, s in (p.split(":") for p in text.split(",") if p)]


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--train")
    p = argparse.ArgumentParser()
    p.add_argument("--kill", default="")
    p.add_argument("--stop", default="")
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args(argv[:split])
    train_args = argv[split + 1:]
    kills, stops = _pairs(a.kill), _pairs(a.stop)
    start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))

    from scaletrain.commands import train
    from scaletrain.train.trainer import Trainer

    original = Trainer.run_step

    def faulty_step(self: Any, batches: Any) -> Any:
        here = (rank, self.step + 1)
        if start < len(kills) and kills[start] == here:
            os.kill(os.getpid(), signal.SIGKILL)
        if here in stops:
            os.kill(os.getpid(), signal.SIGSTOP)
        out = original(self, batches)
        if a.sleep:
            time.sleep(a.sleep)
        return out

    Trainer.run_step = faulty_step  # type: ignore[method-assign]
    code = train.main(train_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the test ranks do: no interpreter shutdown with gloo threads alive


if __name__ == "__main__":
    main()
