"""Fork-server preload: imported once by the warm fork server; every trial process is forked from it.

The modules to import come from ``VRAMSWEEP_PRELOAD`` (comma-separated, set by the sweeper before it
starts the fork server). A module that fails to import is skipped (the trial will report the error
itself). CUDA is never initialised here: ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps
``torch.cuda.is_available()`` fork-safe, and the zygote warns if a preloaded module did initialise it.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

PRELOADED: dict[str, float] = {}
FAILED: dict[str, str] = {}

for _name in [m.strip() for m in os.environ.get("VRAMSWEEP_PRELOAD", "").split(",") if m.strip()]:
    _t0 = time.perf_counter()
    try:
        importlib.import_module(_name)
        PRELOADED[_name] = time.perf_counter() - _t0
    except Exception as _exc:  # a broken optional module must not kill the fork server
        FAILED[_name] = f"{type(_exc).__name__}: {_exc}"

# What every trial process uses whatever the trial function: the runner, outcomes, and Optuna's
# storage (intermediate reports for pruning).
for _name in (
    "vramsweep.sweeper.runner",
    "vramsweep.sweeper.outcome",
    "vramsweep.sweeper.samplers",
    "vramsweep.sweeper.storage",
    "optuna",
    "psutil",
):
    importlib.import_module(_name)

if "vramsweep.config" in PRELOADED:
    # Warm Hydra too: the plugin scan and a first compose load most of what each trial's compose needs.
    try:
        from vramsweep.config import compose as _compose

        _compose([], validate_rules=False)
    except Exception as _exc:
        FAILED["compose"] = f"{type(_exc).__name__}: {_exc}"

if "torch" in sys.modules:
    try:
        if sys.modules["torch"].cuda.is_initialized():
            print(
                "vramsweep: WARNING: CUDA was initialised while preloading "
                f"{', '.join(PRELOADED)}; forked trials cannot use it: set hydra.sweeper.isolation=spawn",
                file=sys.stderr,
            )
    except Exception:
        pass
