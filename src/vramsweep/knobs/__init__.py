"""Build a trial's model and optimizer: the providers of :mod:`vramsweep.knobs.registry` (one per config
group, beside its code) run stage by stage: patch -> load -> build.

Imports are lazy: :mod:`vramsweep.knobs.registry` (used by the estimator) must not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Built": "vramsweep.knobs.build",
    "build_model": "vramsweep.knobs.build",
    "torch_dtype": "vramsweep.knobs.build",
    "build_optimizer": "vramsweep.knobs.optim",
    "build_scheduler": "vramsweep.knobs.optim",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vramsweep.knobs' has no attribute {name!r}")
