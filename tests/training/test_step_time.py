"""bench/step_time.py's host vs device split: what the GPU run reads the fixed per-step cost
from (goal: step(1,024) <= 0.35 x step(4,096))."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("step_time", ROOT / "bench" / "step_time.py")
    mod = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "bench"))  # its bench/_child.py, as when run as a script
        spec.loader.exec_module(mod)
    return mod


def test_host_vs_device_split(bench):
    # a host-bound CUDA step: the host issues for 0.62 s and waits 0.03 s for the device
    phases = {"h2d": 0.01, "forward": 0.25, "backward": 0.3, "optimizer": 0.05, "sync_wait": 0.03,
              "other": 0.01, "step": 0.65, "host_bound": True}  # fmt: skip
    split = bench.host_device_split(phases)
    assert split["host_s"] == pytest.approx(0.62) and split["wait_s"] == pytest.approx(0.03)
    assert split["host_share"] == pytest.approx(0.62 / 0.65)
    assert bench._split_text(split) == (
        "host 0.6200 s + device wait 0.0300 s of 0.6500 s/step (host 95%); device time: no CUDA events (CPU)"
    )
    assert bench.host_device_split({}) is None and bench._split_text(None) == "host vs device: n/a"


def test_bench_prints_device_time_from_the_events(bench):
    """A Liger step on CUDA: the in-forward wait counts as device wait; the device's seconds come from the
    events."""
    phases = {"h2d": 0.001, "forward": 0.035, "backward": 0.05, "optimizer": 0.014, "sync_wait": 0.0,
              "loss_sync": 0.9, "other": 0.0, "step": 1.0, "host_bound": False,
              "device_s": {"h2d": 0.01, "forward": 0.4, "backward": 0.5, "optimizer": 0.09, "step": 1.0}}  # fmt: skip
    split = bench.host_device_split(phases)
    assert split["wait_s"] == pytest.approx(0.9) and split["device_s"] == 1.0
    assert split["device_phases"] == {"h2d": 0.01, "forward": 0.4, "backward": 0.5, "optimizer": 0.09}
    assert bench._split_text(split) == (
        "host 0.1000 s + device wait 0.9000 s of 1.0000 s/step (host 10%); device 1.0000 s/step from CUDA events "
        "(h2d 0.0100, forward 0.4000, backward 0.5000, optimizer 0.0900)"
    )


# ------------------------------------------------------------------- device time from events


class FakeGPU:
    """One CUDA stream, simulated: the host clock (the StepClock's timer), queued device work, events that
    complete when the device reaches them. Reading an event before it completed fails, as CUDA's
    ``cudaEventElapsedTime`` does (``cudaErrorNotReady``)."""

    def __init__(self):
        self.host = 0.0  # host seconds
        self.tail = 0.0  # device time at which the queued work ends
        self.synchronized = 0

    def timer(self) -> float:
        return self.host

    def work(self, host_s: float, device_s: float) -> None:
        """The host spends ``host_s`` issuing ``device_s`` of kernels (they start once issued and the
        device is free)."""
        start = max(self.tail, self.host)
        self.host += host_s
        self.tail = start + device_s

    def block(self) -> None:
        """A host sync (``.item()``, ``synchronize``): the host waits for the queue."""
        self.host = max(self.host, self.tail)

    def synchronize(self) -> None:
        self.synchronized += 1
        self.block()

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGPU):
        self.gpu, self.t = gpu, None

    def record(self) -> None:
        self.t = max(self.gpu.tail, self.gpu.host)  # reached after the work queued before it
        self.gpu.tail = self.t

    def query(self) -> bool:
        return self.t is not None and self.t <= self.gpu.host

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "event read before the device reached it (a hidden sync)"
        return (end.t - self.t) * 1e3

    def synchronize(self) -> None:
        raise AssertionError("the clock never waits on an event")


def _clock(gpu: FakeGPU):
    from vramsweep.measure.steps import StepClock

    return StepClock(cuda=True, event=gpu.event, synchronize=gpu.synchronize, timer=gpu.timer)


def _liger_steps(gpu: FakeGPU, clock, *, host: float, device: float, steps: int = 6) -> dict:
    """``steps`` steps in fit's order, each issuing for ``host`` s and ``device`` s of GPU work, with Liger's
    ``.item()`` as its loss starts (after the decoder's forward)."""
    clock.sync()
    clock.start()
    ends: list = []
    for _ in range(steps):
        clock.begin_step()
        with clock.phase("h2d"):
            gpu.work(0.01 * host, 0.01 * device)
        with clock.phase("forward"):
            gpu.work(0.3 * host, 0.3 * device)  # the decoder
            clock.sync_point()
            gpu.block()  # liger-kernel 0.8.5: target_mask.sum().item()
            gpu.work(0.05 * host, 0.1 * device)  # the fused loss's chunks
        with clock.phase("backward"):
            gpu.work(0.5 * host, 0.5 * device)
        with clock.phase("optimizer"):
            gpu.work(0.14 * host, 0.09 * device)
        clock.end_step()
        with clock.phase("sync_wait"):  # the previous step's loss (its event: after its optimizer)
            if ends:
                gpu.host = max(gpu.host, ends[-1])
        clock.collect()
        ends.append(gpu.tail)
    synced = gpu.synchronized
    clock.sync()
    assert synced == 1  # only the window's opening sync ran inside the steps
    return clock.per_step(steps)


def test_liger_device_bound_step_is_not_host_bound():
    """Device-bound (1.0 s of GPU work per step, 0.1 s of issuing) with Liger's in-forward sync: the host
    waits inside the forward, the loss read finds the step done. Before: sync_wait ~0 -> host_bound true
    for every Liger step; now the wait at the sync point is loss_sync, and host_bound is false."""
    gpu = FakeGPU()
    ph = _liger_steps(gpu, _clock(gpu), host=0.1, device=1.0)
    assert ph["host_bound"] is False
    # the first step waits for its own decoder forward (0.31 - 0.031 s), each later one for the device's
    # backlog: 1.0 - 0.1 s
    assert ph["sync_wait"] < 0.01 and ph["loss_sync"] == pytest.approx((0.279 + 5 * 0.9) / 6, abs=1e-4)
    assert ph["forward"] == pytest.approx(0.035, abs=1e-6)  # the host's issuing, without the wait
    assert ph["step"] == pytest.approx(1.0, abs=0.02)
    dev = ph["device_s"]  # the GPU's seconds per phase, from the events
    assert dev["forward"] == pytest.approx(0.4) and dev["backward"] == pytest.approx(0.5)
    assert dev["optimizer"] == pytest.approx(0.09) and dev["h2d"] == pytest.approx(0.01)
    assert dev["step"] == pytest.approx(1.0)
    parts = ("h2d", "forward", "backward", "optimizer", "sync_wait", "loss_sync", "other")
    assert sum(ph[k] for k in parts) == pytest.approx(ph["step"], abs=1e-5)


def test_liger_host_bound_step_is_host_bound():
    """Host-bound (1.0 s of issuing, 0.1 s of GPU work): the sync point finds the device idle."""
    gpu = FakeGPU()
    ph = _liger_steps(gpu, _clock(gpu), host=1.0, device=0.1)
    assert ph["host_bound"] is True
    assert ph["loss_sync"] == pytest.approx(0.0, abs=1e-6) and ph["forward"] == pytest.approx(0.35)
    assert ph["device_s"]["backward"] == pytest.approx(0.5)  # the device kept pace with the host


def test_fit_records_events_per_phase_and_reads_them_after_the_step():
    """fit() on CPU with a fake-event clock: an event pair per phase and micro-batch, the step's events
    read only once complete (FakeEvent refuses otherwise), the device time per phase exact."""
    torch = pytest.importorskip("torch")
    from vramsweep.loop import Loop, Timing, fit

    gpu = FakeGPU()
    clock = _clock(gpu)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.zeros(1, 4, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "no_padding": True,
             "n_loss_tokens": 4, "n_tokens": 4, "n_targets": 4}  # fmt: skip
    recorded: list[FakeEvent] = []
    make = gpu.event

    def event():
        ev = make()
        recorded.append(ev)
        return ev

    clock._event = event

    def loss_fn(ids, mask, labels):
        gpu.work(0.01, 0.05)  # the forward issues 0.05 s of device work
        return model(ids.float()).pow(2).mean()

    loop = Loop(
        model=model,
        optimizer=opt,
        scheduler=sched,
        batches=[batch] * 8,
        loss_fn=loss_fn,
        device=torch.device("cpu"),
        steps=4,
        grad_accum=2,
        clock=clock,
    )
    fit(loop, [Timing(clock, timed_from=1)])
    assert gpu.synchronized == 1  # the window's opening sync; nothing inside the steps
    clock.sync()
    ph = clock.per_step(3)
    assert clock.device_steps == 3  # every timed step's events read
    assert ph["device_s"]["forward"] == pytest.approx(2 * 0.05)  # two micro-batches
    # the anchor, then per timed step: begin + end, a pair per micro-batch for h2d, forward, backward, and
    # the optimizer's pair (the device is behind: none was complete to reuse from the pool yet)
    assert len(recorded) == 1 + 3 * (2 + 2 * 3 * 2 + 2)


def test_cpu_clock_records_no_events():
    from vramsweep.measure.steps import StepClock

    clock = StepClock()
    clock.start()
    clock.begin_step()
    with clock.phase("forward"):
        pass
    clock.end_step()
    clock.collect()
    ph = clock.per_step(1)
    assert "device_s" not in ph and ph["host_bound"] is False and ph["loss_sync"] == 0.0


def test_liger_sync_point_marks_the_decoder_forward():
    """kernels=liger with fused linear cross-entropy: a sync point after each decoder forward (where Liger's
    loss calls .item()); none without it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from vramsweep.config import compose
    from vramsweep.knobs.kernels import liger_sync_point

    conf = transformers.Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(conf)
    gpu = FakeGPU()
    clock = _clock(gpu)
    assert liger_sync_point(compose([], rules="none"), model, clock) is None
    cfg = compose(["kernels=liger"], rules="none")
    handle = liger_sync_point(cfg, model, clock)
    clock.start()
    clock.begin_step()
    with clock.phase("forward"), torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    assert len(clock._step.syncs) == 1
    handle.remove()


# ------------------------------------------------------- waits inside backward and the optimizer (issue 53)


def _steps(gpu: FakeGPU, clock, *, host: float, device: float, n_params: int, liger: bool, steps: int = 6):
    """Steps in fit's order without an in-forward sync: Liger's backward ``torch.equal`` (when ``liger``)
    and an 8-bit optimizer that calls ``torch.cuda.synchronize()`` after each of ``n_params`` updates."""
    import types

    cuda = types.SimpleNamespace(synchronize=gpu.block)
    restore = clock.count_synchronize(cuda)
    clock.backward_sync_point = liger
    clock.sync()
    clock.start()
    ends: list = []
    for _ in range(steps):
        clock.begin_step()
        with clock.phase("h2d"):
            gpu.work(0.01 * host, 0.01 * device)
        with clock.phase("forward"):
            gpu.work(0.35 * host, 0.4 * device)
        with clock.phase("backward"):
            if liger:
                gpu.block()  # liger-kernel 0.8.5: torch.equal(grad_output, 1.0) as its backward starts
            gpu.work(0.5 * host, 0.5 * device)
        with clock.phase("optimizer"):
            for _ in range(n_params):  # bitsandbytes Optimizer8bit.step: update, then sync_gpu(p)
                gpu.work(0.14 * host / n_params, 0.09 * device / n_params)
                cuda.synchronize()
        clock.end_step()
        with clock.phase("sync_wait"):
            if ends:
                gpu.host = max(gpu.host, ends[-1])
        clock.collect()
        ends.append(gpu.tail)
    clock.sync()
    restore()
    assert cuda.synchronize == gpu.block  # the window's wrapper is gone
    return clock.per_step(steps)


def test_bnb_per_parameter_syncs_are_optimizer_waits_not_host_work():
    """Device-bound step (1.0 s of GPU work, 0.1 s of issuing), bitsandbytes' 8-bit optimizer syncing after
    each of 12 parameters: the host waits for the whole step's backlog inside the optimizer. Before: that
    wait was optimizer host time, sync_wait ~0 and host_bound true; now it is optimizer_sync, counted 12
    calls a step, and host_bound is false."""
    gpu = FakeGPU()
    ph = _steps(gpu, _clock(gpu), host=0.1, device=1.0, n_params=12, liger=False)
    assert ph["sync_calls"] == {"optimizer": 12.0}
    assert ph["host_bound"] is False
    assert ph["sync_wait"] < 0.01 and ph["optimizer_sync"] > 0.8
    assert ph["optimizer"] == pytest.approx(0.014, abs=1e-6)  # the host's issuing only
    assert ph["device_s"]["optimizer"] == pytest.approx(0.09, abs=1e-6)
    parts = ("h2d", "forward", "backward", "optimizer", "sync_wait", "other", "h2d_sync", "loss_sync")
    total = sum(ph[k] for k in parts) + ph["backward_sync"] + ph["optimizer_sync"]
    assert total == pytest.approx(ph["step"], abs=1e-5)


def test_liger_backward_sync_is_attributed():
    """Liger's backward ``torch.equal`` waits for the forward's backlog: backward_sync, not backward work."""
    gpu = FakeGPU()
    ph = _steps(gpu, _clock(gpu), host=0.1, device=1.0, n_params=1, liger=True)
    assert ph["backward_sync"] > 0.3 and ph["backward"] == pytest.approx(0.05, abs=1e-6)
    assert ph["host_bound"] is False


def test_host_bound_only_when_the_host_did_not_wait():
    """Host-bound (1.0 s of issuing, 0.1 s of GPU work): every synchronize finds the device idle."""
    gpu = FakeGPU()
    ph = _steps(gpu, _clock(gpu), host=1.0, device=0.1, n_params=12, liger=True)
    assert ph["host_bound"] is True
    assert ph["optimizer_sync"] == pytest.approx(0.0, abs=1e-6) and ph["backward_sync"] == pytest.approx(0.0)
    assert ph["sync_calls"] == {"optimizer": 12.0}


def test_a_real_bitsandbytes_8bit_step_is_counted_per_parameter(monkeypatch):
    """bitsandbytes 0.50's ``Optimizer8bit.step`` calls ``sync_gpu(p)`` after every parameter, which calls
    ``torch.cuda.synchronize()`` for a CUDA tensor (no option turns it off). On CPU ``sync_gpu`` is made to
    take the CUDA branch and ``torch.cuda.synchronize`` is a fake: the clock counts one call per parameter
    with a gradient, inside the optimizer phase, through fit()."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.optim import optimizer as bnb_optimizer

    from vramsweep.loop import Loop, Timing, fit
    from vramsweep.measure.steps import count_cuda_synchronize

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda t: torch.cuda.synchronize())
    gpu = FakeGPU()
    clock = _clock(gpu)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))  # 4 parameters
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.zeros(1, 64, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "no_padding": True,
             "n_loss_tokens": 64, "n_tokens": 64, "n_targets": 64}  # fmt: skip
    loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=[batch] * 4,
                loss_fn=lambda i, m, lab: model(i.float()).pow(2).mean(), device=torch.device("cpu"),
                steps=4, grad_accum=1, clock=clock)  # fmt: skip
    restore = count_cuda_synchronize(clock)
    try:
        fit(loop, [Timing(clock, timed_from=1)])
    finally:
        restore()
    ph = clock.per_step(3)
    assert ph["sync_calls"] == {"optimizer": 4.0}  # 4 parameters, each synced, on the 3 timed steps
    assert len(calls) >= 4 * 4  # every step calls it; the warm-up step's calls are not counted
