"""Starting processes from tests so that they hold up on a loaded machine (CI: 2 shared cores).

- `scaled(seconds)`: a wall-clock limit stretched by how loaded the machine is now, for
  `subprocess` timeouts and the like (a generous limit against hangs, never a speed check).
- `Rendezvous`: a TCPStore server that the test process binds to port 0 and holds for the whole
  launch; every rank joins it as a client, as under `torchrun` (its agent store). No port is
  picked and released (another process could take it in between: gloo alone opens hundreds
  of ephemeral ports), and the store outlives the ranks, so the last rank to leave never finds
  the rank that hosted it gone.
- `run_ranks(fn, world, *args)`: `fn(rank, world, *args)` in `world` spawned processes on one
  `Rendezvous`; each rank ends its process groups on the way out, also after an error
  (`shutdown_process_group`: gloo threads left for interpreter exit can abort the process with
  "terminate called without an active exception"); a launch that outlives its scaled limit
  has every rank's Python stacks dumped to stderr and is killed, so a hang is a failure with
  evidence instead of a stuck CI job.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCALE_ENV = "SCALETRAIN_TEST_TIMEOUT_SCALE"
MAX_SCALE = 4.0  # beyond 4x an idle machine, a run is better failed than waited for


def load_scale() -> float:
    """How many times slower than idle this machine may run now: the 1-minute load average per
    core, between 1 and `MAX_SCALE` (`SCALETRAIN_TEST_TIMEOUT_SCALE` overrides it)."""
    if os.environ.get(SCALE_ENV):
        return float(os.environ[SCALE_ENV])
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 1.0
    return min(max(per_core, 1.0), MAX_SCALE)


def scaled(seconds: float) -> float:
    """`seconds` (a limit that holds on an idle machine) stretched by `load_scale()`."""
    return seconds * load_scale()


class Rendezvous:
    """A TCPStore server bound to a port chosen by the kernel and held until `close()`; `env`
    gives the variables a rank needs to join it through `init_process_group`'s env://."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = self.store.port

    def env(self, rank: int, world: int) -> dict[str, str]:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port), "RANK": str(rank),
                "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                # every rank is a client of this store (torchrun's agent store), none hosts it
                "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def close(self) -> None:
        del self.store

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rank_main(rank: int, fn: Callable[..., None], world: int, env: list[dict[str, str]],
               args: tuple[Any, ...]) -> None:
    os.environ.update(env[rank])
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks on a timeout
    from scaletrain.parallel.mesh import shutdown_process_group

    try:
        fn(rank, world, *args)
    finally:
        # Also after an error: the peers' collectives then fail at once (connection closed)
        # instead of waiting out the timeout. And as the commands do: groups that `fn`'s
        # leftovers (a trainer's mesh, in cycles) still hold end here, not at interpreter exit.
        shutdown_process_group()
    # Done, results on disk, groups destroyed: leave without interpreter shutdown (as
    # multiprocessing ends its forked children). Groups torch's DTensor caches still hold keep
    # their gloo threads, and tearing those down in interpreter shutdown aborted a rank after a
    # successful run ("terminate called without an active exception": test_tp_activations in
    # a full suite on a loaded machine). An error takes the normal way out with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 900.0) -> None:
    """Run `fn(rank, world, *args)` in `world` spawned processes joined to one `Rendezvous`
    (`fn` calls `init_process_group`, directly or through the trainer). Raises what a rank
    raised (`torch.multiprocessing.ProcessRaisedException`, its traceback included) or, after
    `scaled(timeout_s)`, `TimeoutError` once every rank's stacks are on stderr."""
    with Rendezvous() as rdzv:
        env = [rdzv.env(r, world) for r in range(world)]
        limit = scaled(timeout_s)
        ctx = mp.start_processes(_rank_main, args=(fn, world, env, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + limit
        try:
            while not ctx.join(timeout=max(min(5.0, deadline - time.monotonic()), 0.1)):
                if time.monotonic() >= deadline:
                    _dump_and_kill(ctx.processes)
                    raise TimeoutError(f"{world} ranks of {fn.__name__} still running after "
                                       f"{limit:.0f} s; their stacks are on stderr above")
        finally:  # an interrupted test leaves no rank behind
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(10)


def _dump_and_kill(processes: list[Any]) -> None:
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2.0)  # let faulthandler write
    for p in alive:
        p.kill()
    for p in alive:
        p.join(10)
