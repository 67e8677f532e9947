"""The planner's search room: the layouts that fit a cluster ranked by step time (`space`),
the changes that make a layout fit (`advice`), the command that runs one (`command`), this
host as a device (`cpu_device`) and the published runs the step time is held to
(`calibration`)."""

from scaletrain import _moved

__getattr__ = _moved.forward(__name__)  # names of the old plan/search.py, for one release
