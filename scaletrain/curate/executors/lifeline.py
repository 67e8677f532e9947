"""Worker processes die with their driver, and one output folder has one run at a time.

`bind_to_parent` is the initializer of every local worker pool: on Linux the kernel sends the
worker SIGKILL when its parent dies (`PR_SET_PDEATHSIG`); everywhere a daemon thread also
checks the parent id every `HEARTBEAT_S` seconds and exits when the worker was re-parented.
So killing the driver (SIGKILL, an out-of-memory kill, a closed terminal) leaves no worker
writing into the output folder.

`RunLock` is an exclusive `flock` on `OUTPUT/.lock` held for a whole run. Forked workers
inherit it, so a re-run waits until every process of an earlier run, stale workers
included, is gone, instead of racing them on the same temporary files.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import IO, Any

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
_PR_SET_PDEATHSIG = 1
LOCK_NAME = ".lock"


def bind_to_parent() -> None:
    """Make this (worker) process end when its parent ends."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="scaletrain-parent-watch", daemon=True).start()


class RunLock:
    """An exclusive lock on a run's output folder (`OUTPUT/.lock`), waited for up to
    `timeout` seconds; the error names the folder and what to do."""

    def __init__(self, directory: str, timeout: float = 60.0):
        self.path = os.path.join(directory, LOCK_NAME)
        self.timeout = timeout
        self._f: IO[Any] | None = None

    def __enter__(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock
            return self
        self._f = open(self.path, "a+")  # noqa: SIM115 - held for the run
        t0 = time.monotonic()
        warned = False
        while not self._try_lock(fcntl):
            if time.monotonic() - t0 > self.timeout:
                self._f.close()
                self._f = None
                raise RuntimeError(
                    f"'{os.path.dirname(self.path)}' is in use by another run (or by processes "
                    f"left from one) for over {self.timeout:.0f}s; stop it, or choose another "
                    "--output"
                )
            if not warned:
                log.warning("waiting for the processes of an earlier run in '%s' to end",
                            os.path.dirname(self.path))
                warned = True
            time.sleep(0.2)
        return self

    def _try_lock(self, fcntl: Any) -> bool:
        """True when locked (or when the filesystem has no locks), False when held."""
        assert self._f is not None
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as e:  # a filesystem without locks (some network mounts)
            log.warning("cannot lock '%s' (%s); running without the lock", self.path, e)
        return True

    def __exit__(self, *_: Any) -> None:
        if self._f is not None:
            self._f.close()  # releases the lock once no forked worker holds it either
            self._f = None
