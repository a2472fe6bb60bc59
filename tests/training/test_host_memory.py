"""Host memory edges of ``checkpointing=offload``'s pinned pool: the pre-flight keeps headroom
for the trial process, every result records the process's resident set, a SIGKILL while the pool grows
is ``host_oom``, and a failed ``cudaHostRegister`` does not leave CUDA's last error set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import trial_spec
from vramsweep.config import ConfigError, compose
from vramsweep.estimate import estimate
from vramsweep.longctx import offload
from vramsweep.preflight import HOST_PROCESS_HEADROOM_BYTES, check_host_memory
from vramsweep.record import hostmem
from vramsweep.record.units import GIB
from vramsweep.sweeper import isolation as R
from vramsweep.sweeper import trialproc as T
from vramsweep.sweeper.outcome import died_status

TESTS = Path(__file__).resolve().parents[1]
QWEN_OFFLOAD = [
    "model=qwen3_8b",
    "hardware=rtx4080_16gb",
    "quant=nf4_dq",
    "train.micro_batch=1",
    "kernels=liger",
    "checkpointing=offload",
    "tiling=mlp",
    "adapter.dtype=compute",
    "context.max_tokens=32768",
]


# --- (a) the pre-flight keeps room for the process beside the pool


def test_preflight_refuses_a_pool_equal_to_the_available_ram():
    """Before: ``need <= MemAvailable`` passed, leaving nothing for the trial process itself (the pool's
    page-locked pages cannot be reclaimed, so the OOM killer ends it). Now the pool plus the process's
    headroom must fit; the message names the headroom and a context that fits with it."""
    cfg = compose(QWEN_OFFLOAD, rules="none")
    need = estimate(cfg, calibration=False)["host_bytes"]
    assert need == 36 * 32768 * 4096 * 2 == 9 * GIB
    with pytest.raises(ConfigError) as err:
        check_host_memory(cfg, available=need)
    msg = str(err.value)
    assert err.value.key == "checkpointing"
    assert "plus 2.00 GiB for the trial process" in msg and "9.00 GiB of RAM available" in msg
    assert f"context.max_tokens<={32768 * 7 // 9}" in msg  # (9 - 2) GiB left for the pool
    with pytest.raises(ConfigError):
        check_host_memory(cfg, available=need + HOST_PROCESS_HEADROOM_BYTES - 1)
    check_host_memory(cfg, available=need + HOST_PROCESS_HEADROOM_BYTES)  # fits, exactly


# --- (b) the process's resident set in every result


def test_every_trial_result_records_the_process_rss(tmp_path, monkeypatch):
    """Also a trial that ends before anything is built (the host pool does not fit): the result says how
    much host memory the process held (``meta.host_memory.peak_rss_bytes``, ``rss_bytes``)."""
    from vramsweep import preflight
    from vramsweep.trial import run_trial

    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 4 * GIB)
    cfg = compose([*QWEN_OFFLOAD, f"results_dir={tmp_path}"], rules="none")
    res = run_trial(cfg, overrides=[], result_path=tmp_path / "r.json")
    assert res["status"] == "host_oom", res["reason"]
    host = json.loads((tmp_path / "r.json").read_text())["meta"]["host_memory"]
    mine = hostmem.process_rss()
    assert 100 * 2**20 < host["peak_rss_bytes"] <= mine["peak_rss_bytes"]
    assert 0 < host["rss_bytes"] <= host["peak_rss_bytes"]
    assert "VmHWM" in host["rss_definition"]


def test_process_rss_reads_proc_status():
    before = hostmem.process_rss()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page written
    after = hostmem.process_rss()
    assert after["rss_bytes"] - before["rss_bytes"] > 60 << 20
    assert after["peak_rss_bytes"] >= after["rss_bytes"]
    del block


# --- (c) a SIGKILL while the pool grows is host memory, not an error


def _spec(tmp_path: Path) -> T.TrialSpec:
    return trial_spec(
        tmp_path,
        trial_id=-1,
        sweep_name="host",
        study_name="host",
        trial_fn="_host_pool_kill:trial",
        parent_pid=os.getpid(),
        env=dict(os.environ),
        cwd=os.getcwd(),
    )


@pytest.mark.parametrize(
    ("mode", "status"),
    [("fill", "host_oom"), ("register", "host_oom"), ("held", "error"), ("plain", "error")],
)
def test_sigkill_while_the_pool_grows_is_host_oom(tmp_path, monkeypatch, mode, status):
    """A real trial process (forked) is SIGKILLed - what the kernel's OOM killer does - while its host pool
    is growing (pages being faulted in by writes, or by cudaHostRegister): ``host_oom`` with a reason
    naming the pool, and the marker it left in ``meta.host_memory.at_death``. A kill once the pool is held,
    or without a pool, stays ``error``. Before: every SIGKILL was ``error``."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("VRAMSWEEP_SIM_POOL", mode)
    spec = _spec(tmp_path)
    rep = R.ProcessRunner("fork").run(spec, tick_s=0.05, timeout_s=60)
    assert rep.exitcode == -9
    res = json.loads(Path(spec.result_path).read_text())
    assert res["status"] == rep.result["status"] == status, res["reason"]
    assert "SIGKILL" in res["reason"]
    assert not Path(hostmem.marker_path(spec.result_path)).exists()  # read, kept in the result, removed
    if status == "host_oom":
        assert "host pool for checkpointing=offload was growing to 0.06 GiB" in res["reason"]
        assert ("pinned host pool" in res["reason"]) == (mode == "register")
        at_death = res["meta"]["host_memory"]["at_death"]
        assert at_death["state"] == "growing" and at_death["pool_bytes"] == 64 << 20
        assert at_death["rss_bytes"] > 0 and at_death["pid"] != os.getpid()
        assert res["meta"]["optuna"]["failure"] is False  # not counted toward max_failure_rate
    elif mode == "held":
        assert res["meta"]["host_memory"]["at_death"]["state"] == "held"


def test_died_status_needs_sigkill_and_a_growing_pool():
    growing = {"state": "growing", "pool_bytes": 18 * GIB, "pinned": True, "rss_bytes": GIB}
    status, reason = died_status(-9, growing)
    assert status == "host_oom" and "growing to 18.00 GiB" in reason and "MemAvailable unknown" in reason
    assert died_status(-11, growing)[0] == "error"  # a segfault is not the OOM killer
    assert died_status(1, growing)[0] == "error"
    assert died_status(-9, {**growing, "state": "held"})[0] == "error"
    assert died_status(-9, None) == (
        "error",
        "trial process killed by SIGKILL (killed: kill -9 or the kernel's "
        "OOM killer) before writing its result",
    )


def test_pool_marker_states(tmp_path, monkeypatch):
    """growing from the allocation until every page is resident (a pinned pool: after cudaHostRegister;
    plain memory: after a pass filled it), failed when the allocation fails; nothing without the env."""
    marker = tmp_path / "m.json"
    pool = offload.HostPool(pin=False)
    pool.reserve(4096)
    assert not marker.exists()  # not a sweep trial: no marker
    monkeypatch.setenv(hostmem.MARKER_ENV, str(marker))
    pool = offload.HostPool(pin=False)
    pool.reserve(4096)
    assert hostmem.read_marker(marker)["state"] == "growing"
    pool.take(torch.Size([1024]), torch.float32)
    pool.reset()
    assert hostmem.read_marker(marker) == {**hostmem.read_marker(marker), "state": "held", "pool_bytes": 4096}
    pool.reserve(8192)  # a longer pass: it grows again
    assert hostmem.read_marker(marker)["state"] == "growing"
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(register=2))
    with pytest.raises(offload.HostMemoryError):
        offload.HostPool(pin=True).reserve(4096)
    assert hostmem.read_marker(marker)["state"] == "failed"
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(register=0))
    offload.HostPool(pin=True).reserve(4096)
    assert hostmem.read_marker(marker)["state"] == "held"


# --- (d) a failed cudaHostRegister leaves no CUDA error behind


class _FakeCudart:
    """libcudart as torch binds it, plus cudaGetLastError: a failed call sets the per-thread last error,
    cudaGetLastError returns and resets it, and torch's check after a kernel launch reads it."""

    def __init__(self, register: int):
        self.register, self.last, self.calls = register, 0, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
        self.calls.append("register")
        if self.register:
            self.last = self.register
        return self.register

    def cudaHostUnregister(self, ptr):  # noqa: N802
        return 0

    def cudaGetLastError(self):  # noqa: N802
        self.calls.append("get_last_error")
        err, self.last = self.last, 0
        return err

    def launch_kernel(self):
        """What C10_CUDA_KERNEL_LAUNCH_CHECK does after every launch."""
        err, self.last = self.last, 0
        if err:
            raise RuntimeError("CUDA error: out of memory")


def test_failed_register_clears_the_cuda_last_error(monkeypatch):
    """Before: the failed registration left cudaErrorMemoryAllocation as the thread's last error, and the
    next kernel launch in the process raised "CUDA error: out of memory" though the device had room."""
    rt = _FakeCudart(register=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    with pytest.raises(offload.HostMemoryError, match="last error cleared"):
        offload.HostPool(pin=True).reserve(4096)
    assert rt.calls == ["register", "get_last_error"]
    rt.launch_kernel()  # the next launch runs


def test_libcudart_is_found_in_the_process_maps():
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 456 /venv/lib/python3.12/site-packages/nvidia/cuda_runtime/lib/"
        "libcudart.so.12\n"
        "7f40-7f50 rw-p 00000000 00:00 0 \n"
    )
    assert offload.libcudart_path(maps).endswith("nvidia/cuda_runtime/lib/libcudart.so.12")
    assert offload.libcudart_path("7f40-7f50 rw-p 00000000 00:00 0 [heap]\n") is None


def test_no_runtime_to_clear_is_said_not_hidden(monkeypatch):
    """A runtime whose cudaGetLastError cannot be reached (this CPU build maps no libcudart): the error
    says the last error could not be cleared, rather than claiming it was."""

    class Bare(_FakeCudart):
        cudaGetLastError = None  # noqa: N815

    offload._libcudart_get_last_error.cache_clear()
    monkeypatch.setattr(offload, "_libcudart_get_last_error", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Bare(register=2))
    with pytest.raises(offload.HostMemoryError, match="could not be cleared"):
        offload.HostPool(pin=True).reserve(4096)
    assert offload.clear_last_cuda_error(object()) is None
