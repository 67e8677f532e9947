"""Naming the rank that failed: each rank writes a heartbeat (the time and where it is: the
step and what it was doing) into the rendezvous store, and a rank whose collective fails
reports the ranks whose heartbeat stopped and where each was last."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_PREFIX = "scaletrain/heartbeat/"


class Heartbeat:
    """A daemon thread writing `time.time()` and `where` under this rank's key every
    `interval_s`."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.interval_s = interval_s
        self.where = "start-up"
        """What this rank is doing (set through `at`)."""
        self._lock = threading.Lock()
        self.last_seen: dict[int, str] = {}
        """Where each silent rank was at its last beat (filled by `silent_ranks`)."""
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        with self._lock:
            self.store.set(f"{_PREFIX}{self.rank}", f"{time.time()!r}|{self.where}")

    def at(self, where: str) -> None:
        """This rank is now at `where` ("step 7: training step"), published at once: a rank
        that stops right after is named with the place it stopped in."""
        self.where = where
        with contextlib.suppress(Exception):  # a lost store is reported by the collectives
            self._beat()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store went away: the job is ending
                return

    def stop(self) -> None:
        """Stop the thread and wait for it: a daemon thread still inside a store call when the
        interpreter shuts down is ended while returning from C++, and that aborts the process
        ("terminate called without an active exception")."""
        self._stop.set()
        # A store call ends within the store's timeout; a beat normally takes milliseconds.
        self._thread.join(timeout=max(10 * self.interval_s, 30.0))

    def silent_ranks(self, stale_s: float = 3.0) -> list[int] | None:
        """Other ranks whose heartbeat is older than `stale_s` (None if the store is
        unreachable). This rank is alive, however late its own beat on a loaded machine."""
        # Wait until a rank that died at the failure has been silent for longer than stale_s.
        time.sleep(stale_s + self.interval_s)
        try:
            now = time.time()
            out = []
            for r in range(self.world):
                if r == self.rank:
                    continue
                beat, _, where = self.store.get(f"{_PREFIX}{r}").decode().partition("|")
                if now - float(beat) > stale_s:
                    out.append(r)
                    self.last_seen[r] = where
            return out
        except Exception:
            return None


def describe_failure(heartbeat: Heartbeat | None, step: int, error: BaseException) -> str:
    """One message: which rank stopped (if known), at which step, and the collective's error."""
    silent = heartbeat.silent_ranks() if heartbeat is not None else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    if silent:
        assert heartbeat is not None
        who = "; ".join(f"rank {r} stopped responding (last seen at {heartbeat.last_seen[r]})"
                        for r in silent)
    elif silent is None:
        who = "the rendezvous store is unreachable (the rank hosting it, usually rank 0, died)"
    else:
        who = "a peer failed"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"distributed training failed on rank {rank} at step {step}: {who}; "
            f"collective error: {first[:300]}")


class DistributedFailure(RuntimeError):
    """A collective failed because another rank died or stopped answering."""


# Words of the errors gloo and NCCL raise when a peer dies or a collective times out.
_PEER_WORDS = ("connection closed", "connection reset", "connection refused", "broken pipe",
               "timed out", "timeout", "socket", "peer", "gloo", "nccl", "store")


def is_peer_failure(error: BaseException) -> bool:
    """True for a communication failure (a lost peer, a collective timeout); False for an
    error of this rank's own work (out of memory, a shape error)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error).lower()
    return any(word in text for word in _PEER_WORDS)


@contextlib.contextmanager
def guard(heartbeat: Heartbeat | None, step: int) -> Iterator[None]:
    """Turn a failed collective into one `DistributedFailure` naming the rank that stopped;
    any other error (OOM, shape, NaN) passes through as what it is."""
    if heartbeat is None:
        yield
        return
    try:
        yield
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        raise DistributedFailure(describe_failure(heartbeat, step, e)) from None
