"""The error every reader and path helper raises for an input it cannot use."""

from __future__ import annotations


class InputError(ValueError):
    """An input that cannot be read; the message names the path and the fix."""


__all__ = ["InputError"]
