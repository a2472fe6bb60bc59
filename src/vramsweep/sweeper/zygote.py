"""Fork-server preload: imported once by the warm fork server; every trial process is forked from it.

The modules to import come from ``VRAMSWEEP_PRELOAD`` (comma-separated, set by the sweeper before it
starts the fork server). A module that fails to import is skipped (the trial will report the error
itself). CUDA must never be initialised here: a process forked after CUDA was initialised cannot use
the GPU ("Cannot re-initialize CUDA in forked subprocess"), and the server would hold a CUDA context
(hundreds of MB of device memory) while trials are measured. ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps
``torch.cuda.is_available()`` fork-safe; on a CUDA host the runner leaves out the modules known to
initialise CUDA on import (:data:`vramsweep.sweeper.isolation.CUDA_INIT_MODULES`). Whatever happens, this
module records after each import whether CUDA got initialised and writes its state as JSON to
``VRAMSWEEP_ZYGOTE_STATUS``; the runner reads it and refuses to fork trials from a server whose CUDA is
initialised (it falls back to spawn and says why).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

PRELOADED: dict[str, float] = {}
FAILED: dict[str, str] = {}
CUDA_INITIALISED_BY: str | None = None


def cuda_initialised() -> bool:
    """True when this process has initialised CUDA (only looks if torch is already imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    # broad on purpose: a torch without a working CUDA runtime has no initialised CUDA
    except Exception:
        return False


def _note_cuda(name: str) -> None:
    global CUDA_INITIALISED_BY
    if CUDA_INITIALISED_BY is None and cuda_initialised():
        CUDA_INITIALISED_BY = name


for _name in [m.strip() for m in os.environ.get("VRAMSWEEP_PRELOAD", "").split(",") if m.strip()]:
    _t0 = time.perf_counter()
    try:
        importlib.import_module(_name)
        PRELOADED[_name] = time.perf_counter() - _t0
    except Exception as _exc:  # a broken optional module must not kill the fork server
        FAILED[_name] = f"{type(_exc).__name__}: {_exc}"
    _note_cuda(_name)

# What every trial process uses whatever the trial function: the trial process's code, outcomes, and Optuna's
# storage (intermediate reports for pruning).
for _name in (
    "vramsweep.sweeper.trialproc",
    "vramsweep.sweeper.outcome",
    "vramsweep.sweeper.samplers",
    "vramsweep.sweeper.storage",
    "optuna",
    "psutil",
):
    importlib.import_module(_name)
    _note_cuda(_name)

if "vramsweep.config" in PRELOADED:
    # Warm Hydra too: the plugin scan and a first compose load most of what each trial's compose needs.
    try:
        from vramsweep.config import compose as _compose

        _compose([], rules="none")
    # broad on purpose: a preload step that fails is recorded; the trial composes again itself
    except Exception as _exc:
        FAILED["compose"] = f"{type(_exc).__name__}: {_exc}"
    _note_cuda("compose")

_status_path = os.environ.get("VRAMSWEEP_ZYGOTE_STATUS")
if _status_path:
    with contextlib.suppress(OSError):
        # the fork server's own atomic write (temp + replace, no fsync: the status only has to outlive the
        # server): record/atomic.py's writer would import vramsweep before the preload is timed
        with open(_status_path + ".tmp", "w") as _fh:
            json.dump(
                {
                    "pid": os.getpid(),
                    "preloaded": {k: round(v, 3) for k, v in PRELOADED.items()},
                    "failed": FAILED,
                    "cuda_initialised": cuda_initialised(),
                    "cuda_initialised_by": CUDA_INITIALISED_BY,
                    "top_level_modules": sorted({m.split(".")[0] for m in sys.modules}),
                },
                _fh,
            )
        os.replace(_status_path + ".tmp", _status_path)
