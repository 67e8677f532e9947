"""The way out of a training run (`train`, `finetune`): every way it can end as one line on
stderr and its exit code, and nothing left behind (the start-up signal handlers, the process
groups).

Exit codes: 0 trained; 1 the run diverged or a rank failed; 2 a user error (bad settings, a
checkpoint that does not fit the run); 3 out of memory (`_memory_fit`); 75 stopped for
preemption with a checkpoint to continue from (`train/preemption.py`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def run_training(prog: str, cfg: Any, run: Callable[[], T],
                 user_errors: tuple[type[BaseException], ...] = ()) -> tuple[int, T | None]:
    """(exit code, `run()`'s result or None): preemption signals are caught from here on
    (`catch_during_startup`), `user_errors` exit 2 besides the config, checkpoint and layout
    errors every run has."""
    from scaletrain.commands._memory_fit import EXIT_OUT_OF_MEMORY, RunOutOfMemory
    from scaletrain.config import ConfigError
    from scaletrain.parallel.dims import ParallelDimsError
    from scaletrain.parallel.failure import DistributedFailure
    from scaletrain.parallel.mesh import shutdown_process_group
    from scaletrain.train.checkpoint import CheckpointError, NonFiniteStateError
    from scaletrain.train.preemption import (
        EXIT_PREEMPTED,
        Preempted,
        catch_during_startup,
        end_startup,
    )
    from scaletrain.train.trainer import TrainingDiverged

    codes: tuple[tuple[tuple[type[BaseException], ...], int], ...] = (
        ((NonFiniteStateError,), 1),  # diverged, not an input error (a CheckpointError too)
        ((ConfigError, CheckpointError, ParallelDimsError, *user_errors), 2),
        ((TrainingDiverged, DistributedFailure), 1),
        ((Preempted,), EXIT_PREEMPTED),  # a checkpoint was saved: the job is to be continued
        ((RunOutOfMemory,), EXIT_OUT_OF_MEMORY),  # before set-up (the plan), or in a step
    )
    catch_during_startup(cfg.checkpoint.signals, Path(cfg.output),
                         os.environ.get("RANK", "0") == "0")
    try:
        return 0, run()
    except tuple(t for types, _ in codes for t in types) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return next(code for types, code in codes if isinstance(e, types)), None
    finally:  # on every way out, also under torchrun (see shutdown_process_group)
        end_startup()
        shutdown_process_group()
