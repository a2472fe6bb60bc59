"""Where a sweep's trials run: the GPUs this host shows, how many worker slots (``hydra.sweeper.n_jobs``)
and how many trials one GPU holds at once (``hydra.sweeper.trials_per_gpu``), found without initialising
CUDA in the sweeper's process (it forks the trials: a CUDA context here would poison every fork).

1. :func:`visible_gpus`: ``hydra.sweeper.cuda_devices`` if given, else ``CUDA_VISIBLE_DEVICES``, else NVML
   (``nvidia-ml-py``), else a child process asks torch; card memory from NVML (or that child).
   ``VRAMSWEEP_FAKE_GPUS=80,80`` (GiB per card) stands in for the hardware in tests and ``--dry-run``.
2. :func:`plan_layout`: the slots and seats: ``n_jobs=auto`` is one slot per GPU seat (1 on CPU);
   ``trials_per_gpu=auto`` is ``k = ⌊(card − gpu_reserve_gib) ÷ (cap + CUDA context)⌋`` where the hardware
   profile's emulated cap (``hardware.budget_gib``, ``hardware.emulate_cap``) is below the card, else 1.
3. :class:`GpuSeats`: the seats at run time. A worker takes a seat on the least busy GPU when its trial
   starts and gives it back when the trial ends (no batch barrier); a trial whose estimate nears its cap
   takes a GPU alone (:func:`needs_gpu_alone`); who shared a GPU with whom is recorded in the result
   (``meta.gpu_share``), so throughput measured beside another trial is never taken for the card's own.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.record.status import Status
from vramsweep.record.units import GIB
from vramsweep.sweeper.isolation import cuda_host

#: Test and ``--dry-run`` stand-in for the host's GPUs: card memory in GiB, comma-separated (``80,80``).
FAKE_ENV = "VRAMSWEEP_FAKE_GPUS"
#: The CUDA context counted beside each trial's cap when GPUs are shared: at least this much (a trial's
#: context on an H100 with torch's kernels loaded is ~0.5-0.9 GiB; the profile's ``overhead_bytes`` when
#: larger). The cap (``set_per_process_memory_fraction``) does not cover it.
MIN_CONTEXT_BYTES = 1 * GIB
#: A device counts as bigger than the profile's card above this multiple of its nominal memory (the rule of
#: ``measure/cuda.py``'s cap: below it the trial is not capped, so it cannot share).
BIGGER_THAN = 1.05
#: Most trials one GPU may hold (``hydra.sweeper.trials_per_gpu``).
MAX_PER_GPU = 64


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: ``id`` as ``CUDA_VISIBLE_DEVICES`` takes it, its memory (``None``: unknown)."""

    id: str
    total_bytes: int | None = None
    name: str = ""


def visible_gpus(given: list[str] | None = None) -> tuple[list[Gpu], str]:
    """``(GPUs, where the list came from)``; no GPU on a CPU host. ``given``: ``hydra.sweeper.cuda_devices``
    (their memory looked up where NVML knows it)."""

    fake = os.environ.get(FAKE_ENV)
    if fake is not None:
        gpus = _fake_gpus(fake)
        if given:
            by_id = {g.id: g for g in gpus}
            return [by_id.get(str(d), Gpu(str(d))) for d in given], "hydra.sweeper.cuda_devices"
        return gpus, FAKE_ENV
    if given:
        known = _nvml_gpus() or []
        by_id = {k: g for g in known for k in (g.id, g.name)}
        return [by_id.get(str(d), Gpu(str(d))) for d in given], "hydra.sweeper.cuda_devices"
    if not cuda_host():
        return [], "no CUDA device"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        known = _nvml_gpus() or []
        by_id = {k: g for g in known for k in (g.id, g.name)}
        return [Gpu(i, by_id[i].total_bytes) if i in by_id else Gpu(i) for i in ids], "CUDA_VISIBLE_DEVICES"
    nvml = _nvml_gpus()
    if nvml is not None:
        return nvml, "NVML"
    return _torch_child_gpus(), "torch (asked in a child process)"


def _fake_gpus(text: str) -> list[Gpu]:
    """``VRAMSWEEP_FAKE_GPUS``: ``80,80`` -> two 80 GiB cards, ids 0 and 1; empty -> none."""
    out = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        try:
            gib = float(part)
        except ValueError:
            raise ConfigError(
                f"{FAKE_ENV}={text!r}: {part!r} is not a memory size in GiB",
                key=FAKE_ENV,
                allowed=["card memory in GiB per GPU, e.g. 80,80"],
            ) from None
        out.append(Gpu(str(i), int(gib * GIB), f"fake {gib:g} GiB"))
    return out


def _nvml_gpus() -> list[Gpu] | None:
    """Every GPU NVML lists (index ids; UUIDs kept as names for lookups), or None without NVML. NVML reads
    the driver: no CUDA context is made in this process."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    # broad on purpose: NVML missing or broken (NVMLError_*, OSError) = no GPU list from NVML
    except Exception:
        return None
    try:
        gpus = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            gpus.append(Gpu(str(i), int(pynvml.nvmlDeviceGetMemoryInfo(h).total), uuid))
        return gpus
    # broad on purpose: any NVML query error = no GPU list from NVML (CUDA_VISIBLE_DEVICES decides)
    except Exception:
        return None
    finally:
        # broad on purpose: NVML shutdown after the query; it may be gone already
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


_TORCH_QUERY = (
    "import json, torch\n"
    "print(json.dumps([torch.cuda.get_device_properties(i).total_memory "
    "for i in range(torch.cuda.device_count())]))\n"
)


def _torch_child_gpus() -> list[Gpu]:
    """Ask torch in a child process (this one must not initialise CUDA); PCI bus order, as NVML's."""
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    try:
        out = subprocess.run(
            [sys.executable, "-c", _TORCH_QUERY], capture_output=True, text=True, timeout=120, env=env
        )
        totals = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        totals = []
    return [Gpu(str(i), int(t)) for i, t in enumerate(totals)]


@dataclass(frozen=True)
class Layout:
    """Worker slots and GPU seats of one sweeper process (recorded in ``sweep.json`` as ``workers``).

    ``gpus`` the GPUs trials run on (empty: CPU, or a launcher's nodes); ``per_gpu`` trials one GPU holds at
    once; ``n_jobs`` the worker slots; ``line`` what the sweep's first line says (``4 workers on GPUs
    0,1,2,3``); ``why`` how ``per_gpu`` was chosen; ``source`` where the GPU list came from."""

    n_jobs: int
    gpus: tuple[str, ...] = ()
    per_gpu: int = 1
    line: str = ""
    why: str = ""
    source: str = ""
    card_bytes: int | None = None
    seat_bytes: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def shares(self) -> bool:
        return bool(self.gpus) and self.per_gpu > 1

    def public(self) -> dict[str, Any]:
        return {
            "n_jobs": self.n_jobs,
            "cuda_devices": list(self.gpus) or None,
            "trials_per_gpu": self.per_gpu,
            "line": self.line,
            "why": self.why,
            "source": self.source,
            "card_bytes": self.card_bytes,
            "seat_bytes": self.seat_bytes,
        }


@dataclass(frozen=True)
class Profile:
    """What the seat arithmetic reads of the sweep's hardware profile (``hardware.*`` of the base config)."""

    name: str = "cpu"
    device: str = "cpu"
    memory_gib: float = 0.0
    budget_gib: float = 0.0
    overhead_bytes: int = 0
    emulate_cap: bool = True
    swept: bool = False  # a hardware key is swept: each trial's cap may differ

    @classmethod
    def of(cls, hw: Any, *, swept: bool = False) -> Profile:
        def get(key: str, default: Any) -> Any:
            value = hw.get(key) if isinstance(hw, dict) else getattr(hw, key, None)
            return default if value is None else value

        return cls(
            name=str(get("name", "cpu")),
            device=str(get("device", "cpu")),
            memory_gib=float(get("memory_gib", 0.0)),
            budget_gib=float(get("budget_gib", 0.0)),
            overhead_bytes=int(get("overhead_bytes", 0)),
            emulate_cap=bool(get("emulate_cap", True)),
            swept=swept,
        )

    @property
    def cap_bytes(self) -> int:
        return int(self.budget_gib * GIB)

    @property
    def context_bytes(self) -> int:
        return max(int(self.overhead_bytes), MIN_CONTEXT_BYTES)


def seats_per_gpu(card_bytes: int | None, hw: Profile, reserve_gib: float) -> tuple[int, str]:
    """``(k, why)``: how many trials, each capped at the profile's budget, one card holds:
    ``⌊(card − reserve) ÷ (cap + CUDA context)⌋`` where the trial is capped below the card, else 1."""
    if hw.swept:
        return 1, "hardware is swept (each trial's cap may differ): one trial per GPU"
    if hw.device != "cuda" or hw.cap_bytes <= 0:
        return 1, f"hardware={hw.name} sets no memory cap: one trial per GPU"
    if not hw.emulate_cap:
        return 1, "hardware.emulate_cap=false (no per-trial cap): one trial per GPU"
    if card_bytes is None:
        return 1, "the card's memory is unknown (no NVML): one trial per GPU"
    nominal = int(hw.memory_gib * GIB) or hw.cap_bytes
    if card_bytes <= nominal * BIGGER_THAN:
        return 1, f"the card ({card_bytes / GIB:.1f} GiB) is no larger than {hw.name}: one trial per GPU"
    seat = hw.cap_bytes + hw.context_bytes
    k = max(1, math.floor((card_bytes - reserve_gib * GIB) / seat))
    why = (
        f"⌊({card_bytes / GIB:.1f} GiB card − {reserve_gib:g} GiB reserve) ÷ ({hw.budget_gib:g} GiB cap of "
        f"{hw.name} + {hw.context_bytes / GIB:.2f} GiB CUDA context)⌋ = {k}"
    )
    return k, why


def plan_layout(
    conf: Any, isolation: str, hw: Profile, gpus: list[Gpu] | None = None, source: str = ""
) -> Layout:
    """The slots and seats of a sweep (see the module docstring). ``conf``: the checked
    :class:`~vramsweep.sweeper.settings.SweeperConf`; ``gpus``: :func:`visible_gpus` (looked up if None)."""
    n_given = None if conf.n_jobs == "auto" else int(conf.n_jobs)
    if isolation in ("launcher", "inprocess"):
        n = 1 if isolation == "inprocess" else (n_given or 1)
        what = "launcher job in flight" if isolation == "launcher" else "worker (in process)"
        line = f"{n} {what}{'s' if n != 1 and isolation == 'launcher' else ''}"
        if isolation == "launcher" and n_given is None:
            line += " (n_jobs=auto: set hydra.sweeper.n_jobs for more)"
        return Layout(n, line=line, source=isolation, why=f"isolation={isolation}")
    if gpus is None:
        gpus, source = visible_gpus(conf.cuda_devices)
    if not gpus:
        n = n_given or 1
        return Layout(n, line=f"{n} worker{'s' if n != 1 else ''} on CPU", source=source, why="no GPU")
    cards = [g.total_bytes for g in gpus if g.total_bytes]
    card = min(cards) if len(cards) == len(gpus) else None
    if conf.trials_per_gpu == "auto":
        k, why = seats_per_gpu(card, hw, float(conf.gpu_reserve_gib))
    else:
        k, why = int(conf.trials_per_gpu), f"hydra.sweeper.trials_per_gpu={int(conf.trials_per_gpu)}"
        _check_fits(k, card, hw, float(conf.gpu_reserve_gib))
    notes = []
    if k > 1 and (card is None or hw.swept):
        notes.append(
            f"hydra.sweeper.trials_per_gpu={k} not checked against the card's memory ("
            + ("its size is unknown" if card is None else "hardware is swept: each trial's cap may differ")
            + f"): {k} x (largest cap + CUDA context) must fit the card"
        )
    n = n_given or len(gpus) * k
    if n > len(gpus) * k:
        k2 = math.ceil(n / len(gpus))
        notes.append(
            f"hydra.sweeper.n_jobs={n} on {len(gpus)} GPU(s) puts up to {k2} trials on one GPU "
            f"(trials_per_gpu gave {k}): their throughput is marked shared"
        )
        k = k2
    ids = tuple(g.id for g in gpus)
    line = f"{n} worker{'s' if n != 1 else ''} on GPU{'s' if len(ids) != 1 else ''} {','.join(ids)}"
    if k > 1:
        line += f", up to {k} trials per GPU"
    seat = hw.cap_bytes + hw.context_bytes if k > 1 and hw.cap_bytes else None
    return Layout(n, ids, k, line, why, source, card, seat, tuple(notes))


def _check_fits(k: int, card: int | None, hw: Profile, reserve_gib: float) -> None:
    """``trials_per_gpu=<k>`` above 1 needs a per-trial cap, and k capped trials must fit the card."""
    if k <= 1:
        return
    key = "hydra.sweeper.trials_per_gpu"
    auto, why = seats_per_gpu(card, hw, reserve_gib)
    if hw.device != "cuda" or hw.cap_bytes <= 0 or not hw.emulate_cap:
        raise ConfigError(
            f"{key}={k} needs a per-trial memory cap (a CUDA hardware profile with hardware.budget_gib and "
            f"hardware.emulate_cap=true; this sweep: hardware={hw.name}): uncapped trials on one GPU would "
            "measure each other's memory",
            key=key,
            allowed=["auto", "1"],
        )
    if card is not None and k > auto and not hw.swept:
        raise ConfigError(
            f"{key}={k} does not fit: {why}",
            key=key,
            allowed=["auto", f"1..{auto}"],
        )


#: The probe's allocation: 64 MiB written and read back on the device, in a child process.
_PROBE = (
    "import torch\n"
    "x = torch.ones(16 << 20, device='cuda')\n"
    "assert float(x.sum().item()) == float(16 << 20)\n"
    "torch.cuda.synchronize()\n"
)
PROBE_TIMEOUT_S = 120.0


def probe_gpu(gpu: str) -> str | None:
    """Allocate, write and read 64 MiB on ``gpu`` in a child process (this one never initialises CUDA):
    ``None`` when it worked, else why not. A faked GPU (``VRAMSWEEP_FAKE_GPUS``) is not probed."""
    if os.environ.get(FAKE_ENV) is not None:
        return None
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired:
        return f"the probe allocation did not finish in {PROBE_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"the probe could not start: {exc}"
    if out.returncode == 0:
        return None
    tail = [ln.strip() for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
    return f"the probe allocation failed (exit {out.returncode}): {tail[-1][:200] if tail else 'no output'}"


def needs_probe(result: dict[str, Any]) -> bool:
    """Whether a trial's GPU must pass a probe before it takes another trial: the trial ended ``error``
    (a crash, a signal, a CUDA error, a timeout); an OOM and every other outcome leave the GPU as it was."""
    return str(result.get("status")) == Status.ERROR


def needs_gpu_alone(cfg: Any, estimate: dict[str, Any] | None, share_below: float) -> str | None:
    """Why a trial must have its GPU alone (``None``: it may share): no estimate, an estimate at or above
    ``share_below`` × its cap (an OOM verdict that close to the cap is the trial's own finding; it must not
    depend on a neighbour's memory outside the caps), or a paged optimizer (its state is unified memory
    outside the per-process cap)."""
    if estimate is None:
        return "no memory estimate"
    if "paged" in str(getattr(getattr(cfg, "optimizer", None), "name", "")):
        return "paged optimizer state lives outside the per-process cap"
    cap = float(cfg.hardware.budget_gib or 0.0) * GIB
    need = float(estimate.get("required_bytes") or 0)
    if cap <= 0:
        return "no memory cap"
    if need >= share_below * cap:
        return (
            f"estimate {need / GIB:.2f} GiB is within {100 * (1 - share_below):.0f}% of its "
            f"{cap / GIB:g} GiB cap"
        )
    return None


class GpuSeats:
    """The GPU seats of one sweeper process: ``take`` blocks until a GPU has room (alone: an empty GPU, which
    is then held for that trial so shared trials cannot starve it), ``give_back`` returns who shared it.

    A shared trial takes the least busy GPU, so trials spread over the GPUs before any two share one."""

    def __init__(self, gpus: tuple[str, ...], per_gpu: int):
        self.gpus = tuple(gpus)
        self.per_gpu = max(1, int(per_gpu))
        self._cond = threading.Condition()
        self._on: dict[str, dict[int, set[int]]] = {g: {} for g in self.gpus}
        self._alone: dict[str, int] = {}  # GPU -> the trial holding it alone (or waiting for it to empty)
        self.blocked: dict[str, str] = {}  # GPU -> why it takes no trial (probe failed)

    def take(self, trial: int, alone: bool, stop: threading.Event | None = None) -> str | None:
        """A GPU for ``trial`` (``None`` when ``stop`` is set while it waits)."""
        with self._cond:
            while True:
                gpu = self._free(trial, alone)
                if gpu is not None:
                    for shared in self._on[gpu].values():
                        shared.add(trial)
                    self._on[gpu][trial] = set(self._on[gpu])
                    return gpu
                if stop is not None and stop.is_set():
                    self._release_hold(trial)
                    return None
                self._cond.wait(0.2)

    def _free(self, trial: int, alone: bool) -> str | None:
        open_ = [g for g in self.gpus if g not in self.blocked]
        if alone:
            held = [g for g, t in self._alone.items() if t == trial and g not in self.blocked]
            if not held:
                self._release_hold(trial)  # a held GPU that got blocked meanwhile: hold another
                candidates = [g for g in open_ if g not in self._alone]
                if not candidates:
                    return None
                gpu = min(candidates, key=lambda g: len(self._on[g]))
                self._alone[gpu] = trial  # held: no shared trial starts here until this one ends
                held = [gpu]
            return held[0] if not self._on[held[0]] else None
        room = [g for g in open_ if g not in self._alone and len(self._on[g]) < self.per_gpu]
        return min(room, key=lambda g: len(self._on[g])) if room else None

    def _release_hold(self, trial: int) -> None:
        for g, t in list(self._alone.items()):
            if t == trial:
                del self._alone[g]

    def give_back(self, gpu: str, trial: int) -> list[int]:
        """Free ``trial``'s seat on ``gpu``; the trials that ran on it at the same time."""
        with self._cond:
            shared = self._on[gpu].pop(trial, set())
            shared.discard(trial)
            if self._alone.get(gpu) == trial:
                del self._alone[gpu]
            self._cond.notify_all()
            return sorted(shared)

    def block(self, gpu: str, why: str) -> None:
        with self._cond:
            self.blocked[gpu] = why

    def unblock(self, gpu: str) -> None:
        with self._cond:
            self.blocked.pop(gpu, None)
            self._cond.notify_all()

    def busy(self) -> dict[str, list[int]]:
        with self._cond:
            return {g: sorted(on) for g, on in self._on.items()}
