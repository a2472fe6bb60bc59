"""Build a trial's model and optimizer: source -> quantisation -> vocab -> attention -> kernels -> adapter."""

from vramsweep.knobs.model import Built, build_model, torch_dtype
from vramsweep.knobs.optim import build_optimizer, build_scheduler

__all__ = ["Built", "build_model", "build_optimizer", "build_scheduler", "torch_dtype"]
