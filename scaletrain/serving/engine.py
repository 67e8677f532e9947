"""The batching engine: rows from concurrent requests decoded together, in one worker thread.

Continuous batching (the default where the model allows it, `inference.slot_decode`): a running
batch of `batch_size` slots; between two token steps waiting rows join free slots (their
prompt is prefilled) and finished or cancelled rows leave, so a short request never waits for
a long one and a freed slot is reused at the next step. Rows with different sampling settings
share the batch. Waiting rows join in arrival order, each as soon as a slot is free (every row
has its own positions: the batch never has to drain to make room, see `SlotBatch`).

Static batching (`continuous=False`, and models with learned absolute positions or LongRoPE):
the oldest waiting row and up to `batch_size - 1` more with the same temperature/top-k/top-p
are decoded by `decode_rows` until all of them have finished.

Both: the queue is bounded (a full queue refuses new work, 503); `cancel` drops waiting rows
and stops running ones at the next token (a client that went away); an exception fails only
the futures of the rows it concerns and the worker goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from scaletrain.inference.slot_decode import Sampling, SlotBatch, supports
from scaletrain.serving.protocol import ApiError

if TYPE_CHECKING:
    from scaletrain.inference.batch_decode import Row
    from scaletrain.inference.generators import LocalGenerator

logger = logging.getLogger(__name__)

Key = tuple[float, "int | None", "float | None"]
Item = tuple["Row", Key, Future]


class BatchingEngine:
    def __init__(self, gen: LocalGenerator, batch_size: int = 8, wait_s: float = 0.005,
                 max_queue: int = 1024, continuous: bool | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        self.gen, self.batch_size, self.wait_s, self.max_queue = gen, batch_size, wait_s, max_queue
        able = supports(gen.model)
        if continuous and not able:
            logger.warning("continuous batching needs RoPE positions without LongRoPE; this "
                           "model is decoded in static batches")
        self.continuous = able if continuous is None else bool(continuous and able)
        self._q: deque[Item] = deque()
        self._cv = threading.Condition()
        self._cancelled: set[Future] = set()
        self.batches = 0  # static: batches decoded; continuous: times a batch started empty
        self.rows_decoded = 0  # rows that started decoding
        self.rows_cancelled = 0
        self.tokens = 0
        self.steps = 0  # continuous: token steps
        self.slot_steps = 0  # continuous: occupied slots summed over steps
        self.occupied = 0  # rows decoding now
        self._stop = False
        loop = self._continuous_loop if self.continuous else self._static_loop
        self.thread = threading.Thread(target=loop, daemon=True, name="serve-batcher")
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

    def cancel(self, futures: list[Future]) -> None:
        """Give up on these rows: waiting ones leave the queue now, running ones stop at the
        next token and free their slot. Their futures end cancelled."""
        gone = set(futures)
        with self._cv:
            waiting = [it for it in self._q if it[2] in gone]
            if waiting:
                self._q = deque(it for it in self._q if it[2] not in gone)
            self._cancelled.update(f for f in futures if not f.done())
            self._cv.notify()
        for it in waiting:
            self._cancelled.discard(it[2])
            it[2].cancel()

    def metrics(self) -> dict[str, Any]:
        with self._cv:
            waiting = len(self._q)
        return {"batching": "continuous" if self.continuous else "static",
                "batch_size": self.batch_size, "waiting_rows": waiting,
                "occupied_slots": self.occupied, "batches": self.batches,
                "rows_decoded": self.rows_decoded, "rows_cancelled": self.rows_cancelled,
                "tokens": self.tokens, "steps": self.steps,
                "mean_slot_occupancy": round(self.slot_steps / self.steps / self.batch_size, 4)
                if self.steps else None}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _wait_for_work(self, busy: bool) -> bool:
        """Block until rows wait (or `busy`); False once closed."""
        with self._cv:
            while not self._q and not busy and not self._stop:
                self._cv.wait(0.1)
            return not self._stop

    def _closing(self, running: list[Future]) -> None:
        with self._cv:
            left = [it[2] for it in self._q] + running
            self._q.clear()
        for f in left:
            f.cancel()

    # --- continuous -----------------------------------------------------------------------
    def _continuous_loop(self) -> None:
        batch = SlotBatch(self.gen.model, self.batch_size, self.gen.stop_ids, self.gen.pad_id)
        while self._wait_for_work(batch.occupied > 0):
            fresh = not batch.occupied
            if fresh:
                time.sleep(self.wait_s)  # let concurrent requests start the batch together
            for fut, err in self._admit(batch):
                fut.set_exception(err)
            self.occupied = batch.occupied
            if not batch.occupied:
                continue
            self.batches += fresh
            self.steps += 1
            self.slot_steps += batch.occupied
            before = batch.tokens
            try:
                with self.gen.lock:
                    done = batch.step()
            except Exception as e:  # the forward pass: every row of the batch fails
                logger.exception("a decoding step of %d rows failed", batch.occupied)
                for fut in batch.clear():
                    fut.set_exception(e)  # type: ignore[union-attr]
                done = []
            self.tokens += batch.tokens - before
            for fut, res in done:
                self._cancelled.discard(fut)  # type: ignore[arg-type]
                if isinstance(res, Exception):
                    fut.set_exception(res)  # type: ignore[union-attr]
                else:
                    fut.set_result(res)  # type: ignore[union-attr]
            self._drop_cancelled(batch)
            self.occupied = batch.occupied
        self._closing(batch.clear())  # type: ignore[arg-type]

    def _admit(self, batch: SlotBatch) -> list[tuple[Future, Exception]]:
        """Waiting rows into free slots in arrival order (any row that fits the context alone
        fits the batch: `SlotBatch.try_join`); a row that does not fit stops admission."""
        failed = []
        with self._cv:
            while self._q and batch.occupied < self.batch_size:
                row, key, fut = self._q[0]
                try:
                    joined = batch.try_join(row, Sampling(*key), fut)
                except ValueError as e:  # an invalid row fails alone
                    self._q.popleft()
                    failed.append((fut, e))
                    continue
                if not joined:
                    break
                self._q.popleft()
                self.rows_decoded += 1
        return failed

    def _drop_cancelled(self, batch: SlotBatch) -> None:
        with self._cv:
            cancelled, self._cancelled = self._cancelled, set()
        for fut in cancelled:
            if batch.drop(fut) is not None:
                self.rows_cancelled += 1
            fut.cancel()

    # --- static ---------------------------------------------------------------------------
    def _take(self) -> list[Item]:
        time.sleep(self.wait_s)  # let concurrent requests join the batch
        with self._cv:
            if not self._q:  # all cancelled meanwhile
                return []
            key = self._q[0][1]
            items, rest = [], deque()
            while self._q and len(items) < self.batch_size:
                it = self._q.popleft()
                (items if it[1] == key else rest).append(it)
            self._q.extendleft(reversed(rest))
        return items

    def _stop_or_cancelled(self, row: Row, fut: Future) -> Row:
        """`row` whose stop callback also ends it once its future is cancelled."""
        own = row.stop
        return dataclasses.replace(
            row, stop=lambda ids: fut in self._cancelled or (own is not None and own(ids)))

    def _static_loop(self) -> None:
        from scaletrain.inference.batch_decode import decode_rows

        while self._wait_for_work(False):
            items = self._take()
            if not items:
                continue
            self.batches += 1
            self.rows_decoded += len(items)
            self.occupied = len(items)
            temperature, top_k, top_p = items[0][1]
            try:
                with self.gen.lock:
                    out = decode_rows(self.gen.model,
                                      [self._stop_or_cancelled(i[0], i[2]) for i in items],
                                      temperature, top_k, top_p, self.gen.stop_ids,
                                      self.gen.pad_id)
                for (_, _, fut), res in zip(items, out):
                    self.tokens += len(res.ids)
                    if fut in self._cancelled:
                        self.rows_cancelled += 1
                        fut.cancel()
                    else:
                        fut.set_result(res)
            except Exception as e:  # hand the error to every waiting request
                logger.exception("decoding a batch of %d failed", len(items))
                for it in items:
                    if not it[2].done():
                        it[2].set_exception(e)
            with self._cv:  # forget these rows and any cancelled after they were answered
                self._cancelled = {f for f in self._cancelled if not f.done()}
            self.occupied = 0
        self._closing([])
