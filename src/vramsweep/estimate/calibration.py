"""Calibration of the activation constants from measured trials.

The analytic activation model (:func:`vramsweep.estimate.analytic.activation_terms`) is a sum of three
features: per-layer saved tensors, eager attention probabilities, and logits + loss. On a device whose
kernels save more or less than the HF/PyTorch CPU code paths (CUDA flash/mem-efficient kernels, fused
kernels, allocator rounding), one multiplier per feature is fitted by least squares on the measured
activation bytes of finished trials (result JSONs, docs/CONTRACTS.md), and stored per device key
(hardware profile name, ``cpu`` on CPU) under ``<results_dir>/calibration/<device_key>.json``.
:func:`vramsweep.estimate.estimate` picks the file up automatically.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import atomic_write_json
from vramsweep.record.status import Status

FEATURES = ("layers", "attention", "logits")
FACTOR_RANGE = (0.25, 4.0)


def device_key_for(cfg: DictConfig) -> str:
    """Calibration key of a config: the hardware profile name (``cpu`` for CPU)."""
    return str(cfg.hardware.name) if cfg.hardware.device == "cuda" else "cpu"


def calibration_path(results_dir: str | Path, device_key: str) -> Path:
    return Path(results_dir) / "calibration" / f"{device_key}.json"


def load_calibration(results_dir: str | Path, device_key: str) -> dict[str, Any] | None:
    """The stored calibration for ``device_key`` or None (missing or unreadable file)."""
    path = calibration_path(results_dir, device_key)
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    consts = data.get("constants") if isinstance(data, dict) else None
    if not isinstance(consts, dict) or not all(isinstance(consts.get(f, 1.0), int | float) for f in FEATURES):
        return None
    return data


def save_calibration(results_dir: str | Path, device_key: str, data: dict[str, Any]) -> Path:
    return atomic_write_json(calibration_path(results_dir, device_key), data)


def _measured_seq_len(result: dict) -> int | None:
    """Longest trained sequence: the loop puts the two longest micro-batches first."""
    try:
        longest = int(result["meta"]["data"]["train"]["max_length"])
    except (KeyError, TypeError, ValueError):
        return None
    return longest if longest > 0 else None


def trial_point(result: dict) -> dict[str, Any] | None:
    """(features, measured activation bytes) of one result, or None when it cannot be used.

    Measured activations = the measured peak minus the estimator's params + optimizer + grads alive at
    the peak (CPU: tracked peak; CUDA: ``max_memory_allocated``, without the allocator's reserve and
    without paged optimizer state, which lives in unified memory).
    Only trials whose estimated peak is the loss phase (the sum the features describe) are used.
    """
    from vramsweep.estimate import estimate_knobs, knobs_from_cfg

    if result.get("status") != Status.OK or not result.get("config"):
        return None
    m = result.get("metrics") or {}
    kind = m.get(M.MEMORY_KIND)
    if kind == "cuda_reserved":
        measured = m.get(M.CUDA_MAX_ALLOCATED_BYTES)
    else:
        measured = m.get(M.PEAK_MEMORY_BYTES)
    if not isinstance(measured, int | float) or measured <= 0:
        return None
    cfg = OmegaConf.create(result["config"])
    try:
        cfg_max = int(cfg.context.max_tokens)
        seen = _measured_seq_len(result)
        knobs = knobs_from_cfg(cfg, seq_len=min(cfg_max, seen) if seen else None)
        est = estimate_knobs(knobs, None)
    except Exception:  # an old or foreign result: skip it
        return None
    if est.peak_phase != "loss":
        return None
    static = est.at_peak["params"] + est.at_peak["grads"] + est.at_peak["optimizer"]
    if kind == "cuda_reserved":
        static -= est.components["optimizer_paged"]  # unified memory: not in max_memory_allocated
    y = float(measured) - static - est.features["fixed"]
    return {
        "x": [est.features[f] for f in FEATURES],
        "y": y,
        "measured": float(measured),
        "static": static,
        "fixed": est.features["fixed"],
        "trial": result.get("trial"),
    }


def _fit(points: list[dict]) -> dict[str, float]:
    """Least squares y ~ sum_i k_i x_i over the features that vary; one common factor when the
    system is underdetermined."""
    import numpy as np

    X = np.array([p["x"] for p in points], dtype=float)
    y = np.array([p["y"] for p in points], dtype=float)
    active = [i for i in range(X.shape[1]) if np.any(X[:, i] > 0)]
    consts = dict.fromkeys(FEATURES, 1.0)
    if not active:
        return consts
    Xa = X[:, active]
    if len(points) >= len(active) and np.linalg.matrix_rank(Xa) == len(active):
        k, *_ = np.linalg.lstsq(Xa, y, rcond=None)
    else:
        s = float((Xa.sum(axis=1) * y).sum() / max((Xa.sum(axis=1) ** 2).sum(), 1e-30))
        k = np.full(len(active), s)
    lo, hi = FACTOR_RANGE
    for i, ki in zip(active, k):
        consts[FEATURES[i]] = float(min(hi, max(lo, ki))) if math.isfinite(ki) else 1.0
    return consts


def _rel_errors(points: list[dict], consts: dict[str, float]) -> list[float]:
    out = []
    for p in points:
        act = sum(consts[f] * x for f, x in zip(FEATURES, p["x"]))
        pred = p["static"] + p["fixed"] + act
        out.append((pred - p["measured"]) / p["measured"])
    return out


def calibrate(results: list[dict], *, device_key: str) -> dict[str, Any]:
    """Fit the activation multipliers (``layers``, ``attention``, ``logits``) from trial results.

    Args:
        results: trial result dicts (docs/CONTRACTS.md); unusable ones (failed, no measurement,
            other device, optimizer-step peak) are skipped.
        device_key: the key the constants are stored under (``cpu`` or a hardware profile name);
            only results of that device are used.

    Returns:
        ``{"device_key", "constants", "n_trials", "mean_abs_error_before", "mean_abs_error_after",
        "max_abs_error_after", "fitted_at"}``; constants are 1.0 (the analytic model) without data.
    """
    points = []
    for r in results:
        cfg = r.get("config") or {}
        hw = cfg.get("hardware") or {}
        key = str(hw.get("name")) if hw.get("device") == "cuda" else "cpu"
        if key != device_key:
            continue
        p = trial_point(r)
        if p is not None:
            points.append(p)
    consts = _fit(points) if points else dict.fromkeys(FEATURES, 1.0)
    before = _rel_errors(points, dict.fromkeys(FEATURES, 1.0))
    after = _rel_errors(points, consts)

    def mean_abs(v: list[float]) -> float | None:
        return sum(abs(x) for x in v) / len(v) if v else None

    return {
        "device_key": device_key,
        "constants": consts,
        "n_trials": len(points),
        "mean_abs_error_before": mean_abs(before),
        "mean_abs_error_after": mean_abs(after),
        "max_abs_error_after": max((abs(x) for x in after), default=None),
        "fitted_at": datetime.now(UTC).isoformat(),
    }
