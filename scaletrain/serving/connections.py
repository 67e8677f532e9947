"""Who holds which connection, and which one gives way when there are too many.

A connection is *slow* while it is idle or still sending its request, and *busy* while its
request is answered. Slow connections cost the asyncio server a socket and a few kilobytes
(no thread), but they are still bounded:
- per client address, at most `max_slow_per_client` slow connections: a new connection beyond
  that pushes out the same client's oldest slow one;
- in all, at most `max_connections` connections: a new one beyond that pushes out the oldest
  slow connection of anyone, and is refused (503) only when every connection is busy.
So a client that opens many sockets and trickles bytes loses its own oldest sockets (408) and
never locks others out; each slow connection also ends at its own deadline (`wire`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class Tracked:
    client: str
    evict: Callable[[], None]
    """Called once when this connection must give way (the server closes it)."""
    busy: bool = False
    order: int = 0
    """Arrival order of the connection's current slow spell (smaller is older)."""


class ConnectionTable:
    def __init__(self, max_connections: int, max_slow_per_client: int) -> None:
        if max_connections < 1 or max_slow_per_client < 1:
            raise ValueError("max_connections and max_slow_per_client must be >= 1")
        self.max_connections, self.max_slow_per_client = max_connections, max_slow_per_client
        self._open: set[Tracked] = set()
        self._ticket = itertools.count()
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._open)

    def slow(self, client: str | None = None) -> list[Tracked]:
        """Slow connections (of `client`, or of everyone), oldest first."""
        return sorted((c for c in self._open if not c.busy
                       and (client is None or c.client == client)), key=lambda c: c.order)

    def admit(self, conn: Tracked) -> bool:
        """Register a new (slow) connection, evicting others as the limits say; False when it
        must be refused because every open connection is busy."""
        own = self.slow(conn.client)
        while len(own) >= self.max_slow_per_client:
            self._evict(own.pop(0))
        if len(self._open) >= self.max_connections:
            anyone = self.slow()
            if not anyone:
                self.refused += 1
                return False
            self._evict(anyone[0])
        conn.order = next(self._ticket)
        self._open.add(conn)
        return True

    def set_busy(self, conn: Tracked, busy: bool) -> None:
        conn.busy = busy
        if not busy:
            conn.order = next(self._ticket)  # a kept-alive connection queues anew

    def remove(self, conn: Tracked) -> None:
        self._open.discard(conn)

    def _evict(self, conn: Tracked) -> None:
        self._open.discard(conn)
        self.evicted += 1
        conn.evict()

    def metrics(self) -> dict[str, int]:
        slow = sum(not c.busy for c in self._open)
        return {"open": len(self._open), "slow": slow, "busy": len(self._open) - slow,
                "evicted": self.evicted, "refused": self.refused}
