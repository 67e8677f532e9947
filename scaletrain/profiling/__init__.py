"""Profiling: capture (torch.profiler around a loop), trace reading, analyses, verdict, reports.

`scaletrain.profiling.profile(...)` profiles any loop (`session.ProfileSession`); it is loaded
on first use, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ProfileSession", "profile"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from scaletrain.profiling import session

        return getattr(session, name)
    raise AttributeError(f"module 'scaletrain.profiling' has no attribute {name!r}")
