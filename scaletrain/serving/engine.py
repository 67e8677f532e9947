"""The batching engine: rows from concurrent requests decoded together.

A worker thread takes the oldest waiting row, lets concurrent requests arrive for `wait_s`,
then takes up to `batch_size` waiting rows with the same sampling settings (temperature, top-k,
top-p) and decodes them as one batch in which every row keeps its own budget, stops and logit
controls (`models.batch_decode`). The queue is bounded: a full queue refuses new work (503)
instead of growing without limit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

from scaletrain.serving.protocol import ApiError

if TYPE_CHECKING:
    from scaletrain.data.synth.generators import LocalGenerator
    from scaletrain.models.batch_decode import Row

logger = logging.getLogger(__name__)

Key = tuple[float, "int | None", "float | None"]


class BatchingEngine:
    def __init__(self, gen: LocalGenerator, batch_size: int = 8, wait_s: float = 0.005,
                 max_queue: int = 1024):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        self.gen, self.batch_size, self.wait_s, self.max_queue = gen, batch_size, wait_s, max_queue
        self._q: deque[tuple[Row, Key, Future]] = deque()
        self._cv = threading.Condition()
        self.batches = 0
        self.rows_decoded = 0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="serve-batcher")
        self.thread.start()

    def submit(self, rows: list[Row], key: Key) -> list[Future]:
        """Queue rows (all or none); their futures give `Decoded` results."""
        futs: list[Future] = [Future() for _ in rows]
        with self._cv:
            if len(self._q) + len(rows) > self.max_queue:
                raise ApiError(503, f"the server is busy ({len(self._q)} completions waiting); "
                                    "retry later", code="server_busy")
            self._q.extend((r, key, f) for r, f in zip(rows, futs))
            self._cv.notify()
        return futs

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _take(self) -> list[tuple[Row, Key, Future]] | None:
        with self._cv:
            while not self._q and not self._stop:
                self._cv.wait(0.1)
            if self._stop:
                return None
        time.sleep(self.wait_s)  # let concurrent requests join the batch
        with self._cv:
            key = self._q[0][1]
            items, rest = [], deque()
            while self._q and len(items) < self.batch_size:
                it = self._q.popleft()
                (items if it[1] == key else rest).append(it)
            self._q.extendleft(reversed(rest))
        return items

    def _loop(self) -> None:
        from scaletrain.models.batch_decode import decode_rows

        while (items := self._take()) is not None:
            self.batches += 1
            self.rows_decoded += len(items)
            temperature, top_k, top_p = items[0][1]
            try:
                with self.gen.lock:
                    out = decode_rows(self.gen.model, [i[0] for i in items], temperature, top_k,
                                      top_p, self.gen.eos_id, self.gen.pad_id)
                for it, res in zip(items, out):
                    it[2].set_result(res)
            except Exception as e:  # hand the error to every waiting request
                logger.exception("decoding a batch of %d failed", len(items))
                for it in items:
                    if not it[2].done():
                        it[2].set_exception(e)
