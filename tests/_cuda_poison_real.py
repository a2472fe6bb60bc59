"""GPU-test helper: poisons forks for real, as a library that counts devices without NVML does
(``torch._C._cuda_getDeviceCount()`` is what ``torch.cuda.is_available()`` calls without
``PYTORCH_NVML_BASED_CUDA_CHECK=1``); ``torch.cuda.is_initialized()`` stays False."""

import torch

COUNT = torch._C._cuda_getDeviceCount()


def trial(overrides, **_):
    from vramsweep.record.result import new_result

    x = torch.ones(4, device="cuda")
    res = new_result(status="ok", overrides=list(overrides))
    res["metrics"]["eval_loss"] = float(x.sum().item())
    return res
