"""Old import paths of documented modules, kept for one release after the package was arranged
into rooms (see docs/api.md): importing one warns and gives the module at its new place (the
same module object, so `isinstance` checks and monkeypatching see one module)."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module being imported as `old` the module `new`, with a DeprecationWarning
    pointing at the importing line."""
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in the next "
                  "release)", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
