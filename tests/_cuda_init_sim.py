"""Test helper: a "preloaded" module that poisons forks the way a GPU host does, WITHOUT
``torch.cuda.is_initialized()`` ever saying so (simulated on CPU, at torch's own seams).

``VRAMSWEEP_SIM_POISON`` picks the mechanism:

* ``bad_fork`` (default): as after ``cudaGetDeviceCount`` without NVML (torch's ``poison_fork``): every
  process forked from the importer is a bad fork for torch (``torch.cuda._is_in_bad_fork()``), and CUDA
  cannot be initialised there;
* ``driver``: as after Triton or another library touched the driver: torch sees nothing, but
  ``torch.cuda.init()`` fails in a forked child (CUDA "initialization error").

In the importing process itself (the parent, or a spawned trial that imports this module) CUDA "works".
"""

import os

import torch

IMPORTED_IN = os.getpid()
MODE = os.environ.get("VRAMSWEEP_SIM_POISON", "bad_fork")


def _forked() -> bool:
    return os.getpid() != IMPORTED_IN


if MODE == "bad_fork":
    torch.cuda._is_in_bad_fork = _forked


def _init() -> None:
    if _forked():
        if MODE == "bad_fork":
            raise RuntimeError(
                "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing"
            )
        raise RuntimeError("CUDA error: initialization error")


torch.cuda.init = _init


def trial(overrides, **_):
    """A trial that uses the GPU (``torch.cuda.init()``) and reports which process imported this module."""
    from vramsweep.record.result import new_result

    torch.cuda.init()
    res = new_result(status="ok", overrides=list(overrides))
    res["metrics"]["eval_loss"] = 1.0
    res["meta"]["imported_in"] = IMPORTED_IN
    res["meta"]["pid"] = os.getpid()
    return res
