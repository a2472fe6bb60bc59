"""``train.deterministic``: bitwise-repeatable kernels on CUDA, recorded in ``meta.deterministic``.

A CPU run is repeatable already (same inputs, same kernels, same order; resume is bitwise:
tests/production/test_resume_matrix.py). On CUDA it is not: FlashAttention's backward and several
PyTorch kernels accumulate with atomics, and cuBLAS picks reduction splits by workspace, so two
uninterrupted runs may already differ in the last bits. ``train.deterministic=true`` on CUDA:

1. ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's documented deterministic setting; a value the user set is
   kept). PyTorch sizes each cuBLAS workspace from it once per process, at the first cuBLAS call, so it is
   set first thing in the trial, before anything touches CUDA. A sweep's fork server never initialises
   CUDA (sweeper/zygote.py), so a forked trial sets it in time; a process that used CUDA before (an
   in-process trial after another) records ``set_before_cuda_init: false``: its bits are not promised.
2. ``torch.use_deterministic_algorithms(True)``: an op without a deterministic kernel raises (the trial's
   status ``error`` names it) instead of silently differing.
3. ``FLASH_ATTENTION_DETERMINISTIC=1``: transformers then passes ``deterministic=True`` to flash-attn's
   backward (``modeling_flash_attention_utils``).

:func:`apply` returns the record and a ``restore`` that puts PyTorch's flag and the FlashAttention variable
back when the trial ends (an in-process caller runs other trials next); the cuBLAS variable stays, as the
workspace it sized does. The cost (tokens/s with and without) is to be measured on the next GPU run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: cuBLAS's deterministic workspace setting (NVIDIA cuBLAS docs, "Results reproducibility")
CUBLAS_WORKSPACE = ":4096:8"
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


@dataclass
class Determinism:
    meta: dict[str, Any]
    restore: Callable[[], None] = field(default=lambda: None)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    # broad on purpose: a torch without a working CUDA runtime has no initialised CUDA
    except Exception:
        return False


def apply(cfg: Any) -> Determinism:
    """Set deterministic kernels for ``cfg`` (``train.deterministic`` on a CUDA ``hardware.device``);
    returns ``meta.deterministic`` and how to undo PyTorch's flag afterwards."""
    on = bool(cfg.train.get("deterministic", False))
    device = str(cfg.hardware.device)
    if not on:
        return Determinism({"enabled": False})
    if device != "cuda":
        return Determinism(
            {"enabled": True, "device": device, "applied": "nothing to set: CPU runs repeat bitwise"}
        )
    import torch

    before_init = not _cuda_initialised()
    user = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if user not in DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    flash_before = os.environ.get("FLASH_ATTENTION_DETERMINISTIC")
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)

    def restore() -> None:
        torch.use_deterministic_algorithms(was)
        if flash_before is None:
            os.environ.pop("FLASH_ATTENTION_DETERMINISTIC", None)
        else:
            os.environ["FLASH_ATTENTION_DETERMINISTIC"] = flash_before

    meta = {
        "enabled": True,
        "device": device,
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "flash_attention_deterministic": True,
        "set_before_cuda_init": before_init,
    }
    return Determinism(meta, restore)
