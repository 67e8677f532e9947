"""Where every rank was when a run hung: each rank's Python stacks (all threads) written to
`<output>/stacks/rank<r>.txt` by faulthandler's watchdog when one training step outlasts the
step timeout (it fires while the rank is still blocked, so the stack shows the waiting
collective), and at any time on `kill -USR2 <pid>`. Files that stayed empty are removed at the
end of the run."""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import threading
from pathlib import Path
from typing import TextIO


class StackDumps:
    def __init__(self, folder: Path, rank: int, on_demand: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.txt"
        self._file: TextIO | None = self.path.open("a")
        self._armed = False
        self._registered = False
        if on_demand and threading.current_thread() is threading.main_thread():
            faulthandler.register(signal.SIGUSR2, file=self._file, all_threads=True)
            self._registered = True

    def arm(self, timeout_s: float) -> None:
        """Dump the stacks if `disarm` is not called within `timeout_s` seconds."""
        if self._file is not None:
            faulthandler.dump_traceback_later(timeout_s, repeat=False, file=self._file)
            self._armed = True

    def disarm(self) -> None:
        if self._armed:
            faulthandler.cancel_dump_traceback_later()
            self._armed = False

    def close(self) -> None:
        self.disarm()
        if self._registered:
            faulthandler.unregister(signal.SIGUSR2)
            self._registered = False
        if self._file is not None:
            self._file.close()
            self._file = None
            if self.path.stat().st_size == 0:
                self.path.unlink()
                with contextlib.suppress(OSError):  # only when no other rank left a file
                    self.path.parent.rmdir()
