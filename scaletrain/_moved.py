"""Old import paths of documented modules, kept for one release after the package was arranged
into rooms (docs/api.md). `import scaletrain` puts a finder on `sys.meta_path` that answers
for these names only: importing one warns and gives the module at its new place (the same
module object, so `isinstance` checks and monkeypatching see one module). No file stands at
the old place, so no room holds an import of another."""

from __future__ import annotations

import importlib
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED = {
    "scaletrain.loader": "scaletrain.inference.loader",
    "scaletrain.models.generation": "scaletrain.inference.generation",
    "scaletrain.train.native_format": "scaletrain.checkpoint.native_format",
    "scaletrain.train.safe_dcp": "scaletrain.checkpoint.safe_dcp",
    "scaletrain.train.integrity": "scaletrain.checkpoint.integrity",
    "scaletrain.finetune.estimate": "scaletrain.plan.finetune_estimate",
    "scaletrain.data.io": "scaletrain.curate.io",
    "scaletrain.data.runner": "scaletrain.curate.runner",
}


def new_name(name: str) -> str | None:
    """Where module `name` lives now (modules inside a moved package included), else None."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _MovedFinder:
    """A meta path finder and loader for the names in MOVED (and the modules below them)."""

    def find_spec(self, name: str, path: object = None, target: object = None
                  ) -> ModuleSpec | None:
        return ModuleSpec(name, self) if new_name(name) else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None
        # stacklevel 2 is the import statement: the import system's own frames are skipped
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes "
                      "in the next release)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to ours next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran at its new place): give it its own spec back."""
        moved = module.__spec__
        if moved is not None and moved.loader is self:
            module.__spec__ = moved.loader_state


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
