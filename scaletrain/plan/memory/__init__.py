"""The planner's memory room: bytes per rank of model states (`states`), activations
(`activations`, `stage_activations`, `korthikanti`), what a pipeline rank holds at its fullest
moment (`pipeline`) and a CPU process's own memory (`host`)."""

from scaletrain import _moved

__getattr__ = _moved.forward(__name__)  # names of the old plan/memory.py, for one release
