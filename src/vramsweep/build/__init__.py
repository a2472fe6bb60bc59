"""Build a trial's model and optimizer: source -> quantisation -> vocab -> attention -> kernels -> adapter."""

from vramsweep.build.model import Built, build_model, torch_dtype
from vramsweep.build.optim import build_optimizer, build_scheduler

__all__ = ["Built", "build_model", "build_optimizer", "build_scheduler", "torch_dtype"]
