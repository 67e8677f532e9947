"""Old import paths of documented modules, kept for one release after the package was arranged
into rooms (docs/api.md). `import scaletrain` puts a finder on `sys.meta_path` that answers
for these names only: importing one warns and gives the module at its new place (the same
module object, so `isinstance` checks and monkeypatching see one module). No file stands at
the old place, so no room holds an import of another."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED = {
    "scaletrain.loader": "scaletrain.inference.loader",
    "scaletrain.models.generation": "scaletrain.inference.generation",
    "scaletrain.train.native_format": "scaletrain.checkpoint.native_format",
    "scaletrain.train.safe_dcp": "scaletrain.checkpoint.safe_dcp",
    "scaletrain.train.integrity": "scaletrain.checkpoint.integrity",
    "scaletrain.finetune.estimate": "scaletrain.plan.finetune.estimate",
    "scaletrain.data.io": "scaletrain.curate.io",
    "scaletrain.data.runner": "scaletrain.curate.runner",
    # the planner's sub-rooms (docs/api.md)
    "scaletrain.plan.activations": "scaletrain.plan.memory.activations",
    "scaletrain.plan.korthikanti": "scaletrain.plan.memory.korthikanti",
    "scaletrain.plan.stage_activations": "scaletrain.plan.memory.stage_activations",
    "scaletrain.plan.pipeline_memory": "scaletrain.plan.memory.pipeline",
    "scaletrain.plan.host_memory": "scaletrain.plan.memory.host",
    "scaletrain.plan.collectives": "scaletrain.plan.timing.collectives",
    "scaletrain.plan.comm": "scaletrain.plan.timing.comm",
    "scaletrain.plan.advice": "scaletrain.plan.search.advice",
    "scaletrain.plan.command": "scaletrain.plan.search.command",
    "scaletrain.plan.cpu_device": "scaletrain.plan.search.cpu_device",
    "scaletrain.plan.calibration": "scaletrain.plan.search.calibration",
    "scaletrain.plan.finetune_estimate": "scaletrain.plan.finetune.estimate",
    "scaletrain.plan.finetune_activations": "scaletrain.plan.finetune.activations",
    "scaletrain.plan.finetune_flops": "scaletrain.plan.finetune.flops",
    "scaletrain.plan.finetune_host": "scaletrain.plan.finetune.host",
}

MOVED_NAMES: dict[str, tuple[str, ...]] = {
    # a module (or a module that became a package of the same name) whose names moved out
    "scaletrain.plan.estimate": ("scaletrain.plan.layout",),
    "scaletrain.plan.search": ("scaletrain.plan.timing.step_time", "scaletrain.plan.search.space"),
    "scaletrain.plan.memory": ("scaletrain.plan.memory.states",),
    "scaletrain.plan.finetune": ("scaletrain.plan.finetune.plan",),
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


def forward(module: str) -> Callable[[str], object]:
    """A module `__getattr__` for `module` (a key of MOVED_NAMES): a name that moved out of it
    warns and is taken from its new module, so `from old import name` works for one release."""

    def __getattr__(name: str) -> object:
        if not name.startswith("__"):
            for new in MOVED_NAMES[module]:
                value = getattr(importlib.import_module(new), name, _MISSING)
                if value is not _MISSING:
                    warnings.warn(f"{module}.{name} moved to {new}; import it from there (the "
                                  "old path goes in the next release)", DeprecationWarning,
                                  stacklevel=2)
                    return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


_MISSING = object()
