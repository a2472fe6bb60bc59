"""Build a trial's model and optimizer: source -> quantisation -> vocab -> attention -> kernels -> adapter
-> registered knob hooks (:mod:`vramsweep.knobs.registry`).

Imports are lazy: :mod:`vramsweep.knobs.registry` (used by the estimator) must not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Built": "vramsweep.knobs.model",
    "build_model": "vramsweep.knobs.model",
    "torch_dtype": "vramsweep.knobs.model",
    "build_optimizer": "vramsweep.knobs.optim",
    "build_scheduler": "vramsweep.knobs.optim",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vramsweep.knobs' has no attribute {name!r}")
