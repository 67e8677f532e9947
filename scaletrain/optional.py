"""Optional dependencies of the data package: imported when first used, with one clear
error that says what to install when they are missing."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, message: str, error: type[Exception] = RuntimeError) -> ModuleType:
    """`import module`, or raise `error(message)` (the message names the package to install)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise error(message) from e
