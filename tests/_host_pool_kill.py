"""Trial functions for tests/training/test_host_memory.py: a trial process that the kernel's OOM killer would end
while its host pool grows, simulated by a SIGKILL to itself at that moment (``VRAMSWEEP_SIM_POOL``).

* ``fill``: a plain (CPU) pool of 64 MiB is reserved and its pages are faulted in by writing them, then
  SIGKILL before the pass ends (the marker still says ``growing``);
* ``register``: ``cudaHostRegister`` (a fake runtime) is where the kill lands, as on a CUDA host whose RAM
  runs out while the registration faults the pages in;
* ``held``: the pool has grown and a full pass has filled it (marker ``held``), then SIGKILL;
* ``plain``: SIGKILL without a host pool.

Pages are written through numpy: the test forks from a pytest process whose OpenMP pool may be running,
and a torch kernel's parallel region would hang in the fork.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

from vramsweep.longctx import offload
from vramsweep.record.result import new_result

POOL_BYTES = 64 << 20


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _KillingCudart:
    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
        torch.empty(size, dtype=torch.uint8).numpy().fill(1)  # the pages fault in ...
        _kill()  # ... and the OOM killer ends the process

    def cudaHostUnregister(self, ptr):  # noqa: N802
        return 0


def trial(overrides: list[str], *, sweep: str | None = None, trial: int | None = None, **_: Any) -> dict:
    mode = os.environ["VRAMSWEEP_SIM_POOL"]
    if mode == "plain":
        _kill()
    if mode == "register":
        torch.cuda.cudart = _KillingCudart
        offload.HostPool(pin=True).reserve(POOL_BYTES)
    pool = offload.HostPool(pin=False)
    pool.reserve(POOL_BYTES)
    pool.take(torch.Size([POOL_BYTES // 4]), torch.float32).numpy().fill(1.0)  # one pass fills the pool
    if mode == "held":
        pool.reset()  # the next pass starts: every page of the pool is resident
    _kill()
    return new_result(sweep=sweep, trial=trial, overrides=overrides)  # not reached
