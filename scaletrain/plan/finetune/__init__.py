"""The planner's fine-tuning room: trainable parameters and memory per component (`estimate`),
activations with frozen parts (`activations`), FLOPs of the matmuls that run (`flops`), host
memory while the base loads (`host`) and the plan of a method (`plan`)."""

from scaletrain import _moved

__getattr__ = _moved.forward(__name__)  # names of the old plan/finetune.py, for one release
