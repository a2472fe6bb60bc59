"""Test helper: a "preloaded" module that initialises CUDA on import, as ``import bitsandbytes`` does on a
GPU host (simulated on CPU: ``torch.cuda.is_initialized`` now says True in this process and in every
process forked from it)."""

import os

import torch

IMPORTED_IN = os.getpid()
torch.cuda.is_initialized = lambda: True


def trial(overrides, **_):
    """Reports which process imported this module: the trial's own (spawned) or a fork server's."""
    from vramsweep.record.result import new_result

    res = new_result(status="ok", overrides=list(overrides))
    res["metrics"]["eval_loss"] = 1.0
    res["meta"]["imported_in"] = IMPORTED_IN
    res["meta"]["pid"] = os.getpid()
    return res
