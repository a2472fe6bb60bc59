"""Settings the user left unset, fitted to the run at compose time.

``train.warmup_steps`` and ``train.measure_warmup_steps`` default to ``null``: 2 each, shrunk to fit a short
run (``train.steps=1`` trains and times its one step). A value the user gave (command line, sweep file,
experiment, their own ``train`` option) is kept as given, and the rules refuse it when it does not fit.
The shrink is said once, on stderr, per command (its child processes inherit the mark).

``train.dtype=auto`` (the default) is ``bf16`` on CUDA, and on a CPU ``bf16`` only where the CPU computes it
natively (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``), else ``fp32``: emulated bf16 ran at 112.6
vs 1,676 tokens/s for fp32 on such a CPU (README). ``VRAMSWEEP_CPU_BF16=native|emulated`` overrides the
detection (the test suite pins it). The trial records the CPU's flags in ``meta.cpu_bf16``.
"""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig, open_dict

#: The default LR warm-up, in optimizer steps, when ``train.warmup_steps`` is unset (at most half the run).
WARMUP_STEPS = 2
#: The default of steps left out of tokens/s when ``train.measure_warmup_steps`` is unset (at least one
#: step stays measured).
MEASURE_WARMUP_STEPS = 2
#: Notes already said by this command (inherited by the trial processes it starts).
SAID_ENV = "VRAMSWEEP_SAID"


#: CPU flags that mean bf16 matmuls run natively (Intel AVX512-BF16, AMX-BF16).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: ``native`` / ``emulated``: overrides the CPU's flags for ``train.dtype=auto``.
CPU_BF16_ENV = "VRAMSWEEP_CPU_BF16"


def cpu_bf16(cpuinfo: str | None = None) -> dict:
    """Whether this CPU computes bf16 natively: ``{"native": bool | None, "flags": [...], "source": ...}``
    from :data:`CPU_BF16_ENV`, else the ``flags`` line of ``/proc/cpuinfo`` (``cpuinfo``: its text, for
    tests); ``native`` is None where neither says."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip().lower()
    if forced in ("native", "emulated"):
        return {"native": forced == "native", "flags": [], "source": f"{CPU_BF16_ENV}={forced}"}
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return {"native": None, "flags": [], "source": "no /proc/cpuinfo"}
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
            break
    have = sorted(f for f in BF16_FLAGS if f in flags)
    return {"native": bool(have), "flags": have, "source": "/proc/cpuinfo"}


def auto_dtype(device: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """``train.dtype=auto`` on ``device``: the dtype and why."""
    if device == "cuda":
        return "bf16", "CUDA: bf16"
    info = cpu_bf16(cpuinfo)
    if info["native"]:
        return "bf16", f"CPU with native bf16 ({', '.join(info['flags']) or info['source']})"
    why = "no avx512_bf16/amx_bf16" if info["native"] is False else info["source"]
    return "fp32", f"CPU without native bf16 ({why}): bf16 would be emulated, several times slower"


def say_once(key: str, text: str) -> bool:
    """Print ``text`` on stderr unless ``key`` was said by this process or the one that started it.
    Returns whether it was printed."""
    said = os.environ.get(SAID_ENV, "").split(",")
    if key in said:
        return False
    os.environ[SAID_ENV] = ",".join(k for k in [*said, key] if k)
    print(text, file=sys.stderr, flush=True)
    return True


def fitted_warmups(steps: int) -> tuple[int, int]:
    """``(warmup_steps, measure_warmup_steps)`` for an unset pair: the defaults, shrunk so that the LR
    warm-up is at most half of ``steps`` and at least one step is measured."""
    steps = max(int(steps), 1)
    return min(WARMUP_STEPS, steps // 2), min(MEASURE_WARMUP_STEPS, steps - 1)


def fit_unset(cfg: DictConfig) -> list[str]:
    """Fill ``train.dtype=auto`` (:func:`auto_dtype`) and the unset (``null``) warm-ups of ``cfg.train``
    (:func:`fitted_warmups`). Returns the ``key=value`` settings that were shrunk (empty when none was),
    for :func:`say_fitted` once the rules have passed (a bad ``train.steps`` gets its error alone)."""
    t = cfg.get("train")
    if t is None or "warmup_steps" not in t:
        return []
    if str(t.get("dtype")) == "auto":
        device = str(cfg.get("hardware", {}).get("device", "cpu"))
        t.dtype = auto_dtype(device)[0]
    steps = t.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool):
        steps = 1  # a bad value: the rules name it; the warm-ups must not fail first
    warm, measure = fitted_warmups(steps)
    shrunk = []
    with open_dict(cfg):
        for key, value, default in (
            ("warmup_steps", warm, WARMUP_STEPS),
            ("measure_warmup_steps", measure, MEASURE_WARMUP_STEPS),
        ):
            if t.get(key) is None:
                t[key] = value
                if value != default:
                    shrunk.append(f"train.{key}={value}")
    return shrunk


def say_fitted(cfg: DictConfig, shrunk: list[str]) -> None:
    """Once per command, after the rules passed: which unset warm-ups :func:`fit_unset` shrank."""
    if shrunk:
        say_once(
            "short-run-warmups",
            f"vramsweep: note: train.steps={cfg.train.steps} is shorter than the default warm-ups: "
            f"{', '.join(shrunk)} (set train.warmup_steps / train.measure_warmup_steps to choose)",
        )
