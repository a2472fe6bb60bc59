"""Memory estimator: predicted peak memory and its breakdown for a composed trial config.

No weights are loaded: the estimate is arithmetic on the model dims (config group or
``<model.path>/config.json``) and the knobs; see :mod:`vramsweep.estimate.analytic` for the formulas and
their sources, and docs/ESTIMATOR.md for the method note and the measured error.

Public API::

    estimate(cfg) -> {"peak_memory_bytes", "breakdown_bytes", "budget_bytes", "fits", "assumptions", ...}
    preflight(cfg, margin=0.10) -> (ok, estimate)
    max_context(cfg) -> {"max_tokens", ...}                    # longest context.max_tokens that fits
    run_estimate(overrides, as_json=...) -> exit code          # ``vramsweep estimate``
    calibrate(results, device_key=...) -> constants            # fit activation constants
    run_calibrate(sweep_dir) -> exit code                      # ``vramsweep estimate --calibrate``
"""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig

from vramsweep.config.packing import packed
from vramsweep.config.rope import plan as rope_plan
from vramsweep.estimate.analytic import Estimate, Knobs, estimate_knobs
from vramsweep.estimate.calibration import (
    calibrate,
    calibration_path,
    device_key_for,
    load_calibration,
    save_calibration,
)
from vramsweep.estimate.cli import run_calibrate, run_estimate
from vramsweep.estimate.dims import ModelDims, model_dims
from vramsweep.knobs import registry
from vramsweep.knobs.train_step import budget_bytes
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.units import GIB

__all__ = [
    "GIB",
    "ModelDims",
    "calibrate",
    "calibration_path",
    "device_key_for",
    "estimate",
    "knobs_from_cfg",
    "load_calibration",
    "max_context",
    "model_dims",
    "preflight",
    "run_calibrate",
    "run_estimate",
    "save_calibration",
]


def knobs_from_cfg(cfg: DictConfig, *, seq_len: int | None = None) -> Knobs:
    """Resolve the config values the memory model uses (plus the assumptions it makes): the fields come
    from the active providers' estimate hooks (:mod:`vramsweep.knobs.registry`), in pipeline order."""
    e = registry.Estimating(dims=model_dims(cfg), seq_len=seq_len)
    return Knobs(dims=e.dims, notes=e.notes, **registry.estimate_fields(cfg, e))


def estimate(
    cfg: DictConfig, *, seq_len: int | None = None, calibration: dict | bool | None = None
) -> dict[str, Any]:
    """Predicted peak memory of one training step for a composed trial config.

    Args:
        cfg: composed trial config (``vramsweep.config.compose``); machine rules need not pass.
        seq_len: tokens per sequence (default ``context.max_tokens``, the worst case).
        calibration: fitted activation constants; None loads ``<results_dir>/calibration/<device>.json``
            when it exists, False uses the analytic constants.

    Returns:
        ``peak_memory_bytes`` (CUDA: the caching allocator's reserved peak, ``max_memory_reserved``, as
        measured with room to spare; CPU: the tracked tensor peak); ``required_bytes`` (what must fit
        under a hard cap: allocated + the reserve the allocator cannot release; equal to the peak on CPU);
        ``breakdown_bytes`` (params, grads, optimizer, activations, logits, overhead = the allocator's
        reserve: the moment of the peak, summing to it); ``budget_bytes``/``fits`` (``required_bytes`` <=
        budget; None without a budget); ``assumptions``; ``components_bytes`` (steady sizes: params,
        grads, optimizer state, activation peak; ``allocated_peak``, the ``reserve_*`` terms and
        ``cuda_context``); ``peak_phase``; ``calibration`` (constants used or None); ``host_bytes`` /
        ``host_breakdown_bytes`` (host memory beside the device: the pinned pool of
        ``checkpointing=offload``); ``extrapolated_terms`` (CUDA terms no GPU run has checked yet).
    """
    knobs = knobs_from_cfg(cfg, seq_len=seq_len)
    calib_used: dict | None = None
    if calibration is None:
        loaded = load_calibration(str(cfg.results_dir), device_key_for(cfg))
        calib_used = loaded.get("constants") if loaded else None
    elif isinstance(calibration, dict):
        calib_used = calibration.get("constants", calibration)
    est: Estimate = estimate_knobs(knobs, calib_used)
    budget = budget_bytes(cfg)
    notes = list(knobs.notes)
    notes.append(f"peak phase: {est.peak_phase}")
    share = est.at_peak["logits"] / est.peak if est.peak else 0.0
    if share > 0.3 and not knobs.liger_flce:
        notes.append(
            f"logits + loss are {100 * share:.0f}% of the peak: kernels=liger (fused linear cross-entropy), "
            "vocab=sliced or a shorter context.max_tokens shrink them"
        )
    if calib_used:
        notes.append(f"activation constants calibrated for {device_key_for(cfg)}: {calib_used}")
    if est.host:
        notes.append(
            "host memory: "
            + ", ".join(f"{name} {v / GIB:.2f} GiB" for name, v in est.host.items())
            + " (checkpointing=offload: one exact-size page-locked pool of layers x tokens x hidden x dtype; "
            "checked against the available RAM before a trial runs)"
        )
    if est.extrapolated:
        notes.append("extrapolated (no GPU measurement yet): " + "; ".join(est.extrapolated))
    return {
        M.PEAK_MEMORY_BYTES: int(est.peak),
        "required_bytes": int(est.required),
        "breakdown_bytes": dict(est.at_peak),
        "budget_bytes": budget,
        "fits": None if budget is None else bool(est.required <= budget),
        "assumptions": notes,
        "components_bytes": dict(est.components),
        "phases_bytes": dict(est.phases),
        "peak_phase": est.peak_phase,
        "seq_len": knobs.seq_len,
        "calibration": calib_used,
        "host_bytes": int(sum(est.host.values())),
        "host_breakdown_bytes": dict(est.host),
        "extrapolated_terms": list(est.extrapolated),
    }


def preflight(cfg: DictConfig, margin: float = 0.10) -> tuple[bool, dict[str, Any]]:
    """Sweeper pre-flight: False when the required bytes exceed ``hardware.budget_gib`` x (1 + margin).

    A budget of 0 means no budget (always True). The estimate dict is returned either way so the
    sweeper can record it with status ``infeasible_estimate``.
    """
    est = estimate(cfg)
    budget = est["budget_bytes"]
    if budget is None:
        return True, est
    return bool(est["required_bytes"] <= budget * (1.0 + float(margin))), est


def max_context(
    cfg: DictConfig, *, calibration: dict | bool | None = None, hi: int | None = None
) -> dict[str, Any]:
    """Longest ``context.max_tokens`` whose estimate fits ``hardware.budget_gib`` (bisection on the
    estimator).

    Every micro-batch is taken to be ``max_tokens`` long (the estimator's worst case). The estimate grows
    with the tokens (Unsloth's loss chunks aside, whose count steps up by 4), so the bisection finds the
    boundary between the last token count that fits and the first that does not.

    Returns ``{"max_tokens", "budget_bytes", "estimate" (at max_tokens), "next_estimate" (at max_tokens
    + 1, or None at the upper end), "upper_bound"}``; ``max_tokens`` is 0 when not even one token fits.
    Raises ``ValueError`` without a budget.
    """
    budget = budget_bytes(cfg)
    if budget is None:
        raise ValueError("hardware.budget_gib=0 means no budget: choose a hardware profile with a budget")
    if hi is None:
        hi = int(rope_plan(cfg)["positions"] or 0)  # the model's positions, x rope.factor with rope scaling
        hi = hi if hi > 0 else 1 << 20
    hi = max(1, int(hi))

    def est_at(tokens: int) -> dict[str, Any]:
        if packed(cfg):  # packed rows are always context.max_tokens long: that is what grows
            at = copy.deepcopy(cfg)
            at.context.max_tokens = tokens
            return estimate(at, seq_len=tokens, calibration=calibration)
        return estimate(cfg, seq_len=tokens, calibration=calibration)

    lo_est = est_at(1)
    if not lo_est["fits"]:
        return {
            "max_tokens": 0,
            "budget_bytes": budget,
            "estimate": lo_est,
            "next_estimate": lo_est,
            "upper_bound": hi,
        }
    top = est_at(hi)
    if top["fits"]:
        return {
            "max_tokens": hi,
            "budget_bytes": budget,
            "estimate": top,
            "next_estimate": None,
            "upper_bound": hi,
        }
    lo, up = 1, hi  # fits(lo), not fits(up)
    while up - lo > 1:
        mid = (lo + up) // 2
        if est_at(mid)["fits"]:
            lo = mid
        else:
            up = mid
    return {
        "max_tokens": lo,
        "budget_bytes": budget,
        "estimate": est_at(lo),
        "next_estimate": est_at(up),
        "upper_bound": hi,
    }
