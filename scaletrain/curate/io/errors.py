"""The error every reader and path helper raises for an input it cannot use."""

from __future__ import annotations


class InputError(ValueError):
    """An input that cannot be read; the message names the path and the fix."""


__all__ = ["InputError"]


class DamagedInput(InputError):
    """A file whose content cannot be read as its format (not gzip, not Parquet, ...).

    Readers raise it; the run counts the file as a malformed record (named with its path)
    and goes on, or stops at it in strict mode. A missing dependency is an `InputError`."""


__all__ += ["DamagedInput"]
