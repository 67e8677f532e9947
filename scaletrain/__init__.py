"""scaletrain: train, plan, profile and feed Llama-style language models.

The public Python API is the names below (docs/api.md has one example each); they are imported
when first used, so `import scaletrain` stays cheap. Everything else is internal and may move:
import it from its module at your own risk.
"""

from __future__ import annotations

import importlib

from scaletrain import _moved

__version__ = "0.1.0"
_moved.install()  # documented old module paths, for one release (docs/api.md)

# public name -> (module, attribute)
_API: dict[str, tuple[str, str]] = {
    # configuration (the same tree as the CLI's flags)
    "Config": ("scaletrain.config", "Config"),
    "ConfigError": ("scaletrain.config", "ConfigError"),
    "load_config": ("scaletrain.config", "load_config"),
    # training
    "Trainer": ("scaletrain.train.trainer", "Trainer"),
    "TrainResult": ("scaletrain.train.trainer_loop", "TrainResult"),
    # planning
    "ModelArgs": ("scaletrain.models.args", "ModelArgs"),
    "get_preset": ("scaletrain.models.args", "get_preset"),
    "Layout": ("scaletrain.plan.layout", "Layout"),
    "Plan": ("scaletrain.plan.layout", "Plan"),
    "PlanError": ("scaletrain.plan.layout", "PlanError"),
    "check_dims": ("scaletrain.plan.layout", "check_dims"),
    "estimate": ("scaletrain.plan.estimate", "estimate"),
    "Cluster": ("scaletrain.plan.timing.step_time", "Cluster"),
    "search_layouts": ("scaletrain.plan.search.space", "search"),
    "get_device": ("scaletrain.plan.hardware", "get_device"),
    # profiling and diagnosis
    "ProfilingConfig": ("scaletrain.config_sections", "ProfilingConfig"),
    "StepProfiler": ("scaletrain.profiling.capture", "StepProfiler"),
    "phase": ("scaletrain.profiling.capture", "phase"),
    "diagnose": ("scaletrain.profiling.analyze", "analyze"),
    "format_report": ("scaletrain.profiling.report", "terminal"),
    # corpus curation
    "Document": ("scaletrain.curate.documents", "Document"),
    "Step": ("scaletrain.curate.pipeline", "Step"),
    "Filter": ("scaletrain.curate.pipeline", "Filter"),
    "Pipeline": ("scaletrain.curate.pipeline", "Pipeline"),
    "build_step": ("scaletrain.curate.registry", "build_step"),
    "read_documents": ("scaletrain.curate.io.readers", "read_documents"),
    "run_pipeline": ("scaletrain.curate.runner", "run_pipeline"),
    # inference
    "LoadedModel": ("scaletrain.inference.loader", "LoadedModel"),
    "load_model": ("scaletrain.inference.loader", "load_model"),
    "generate": ("scaletrain.inference.generation", "generate"),
}

__all__ = sorted(_API)


def __getattr__(name: str) -> object:
    if name not in _API:
        raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
    module, attribute = _API[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])

