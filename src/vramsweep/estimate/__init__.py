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

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.config.paths import find_option
from vramsweep.estimate.analytic import (
    DTYPE_BYTES,
    Estimate,
    Knobs,
    OptimizerState,
    estimate_knobs,
    resolve_targets,
)
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


def _sliced_vocab(cfg: DictConfig, dims: ModelDims, notes: list[str]) -> int:
    v = cfg.vocab
    if v.mode == "full":
        return dims.vocab_size
    if v.mode == "top_k" and int(v.top_k) > 0:
        kept = min(dims.vocab_size, int(v.top_k) + int(v.reserve))
        notes.append(f"vocab=sliced (top_k): V'={kept} = top_k + reserve (special tokens not added)")
        return kept
    notes.append(
        f"vocab=sliced (mode={v.mode}): the kept vocabulary depends on the corpus; V={dims.vocab_size} used "
        "(an upper bound for embeddings, lm_head and logits)"
    )
    return dims.vocab_size


def knobs_from_cfg(cfg: DictConfig, *, seq_len: int | None = None) -> Knobs:
    """Resolve the config values the memory model uses (plus the assumptions it makes)."""
    notes: list[str] = []
    dims = model_dims(cfg)
    vocab = _sliced_vocab(cfg, dims, notes)
    c = DTYPE_BYTES[str(cfg.train.dtype)]
    a = cfg.adapter
    method = str(a.method)
    targets = resolve_targets(a.targets, notes) if method == "lora" else frozenset()
    s = int(seq_len) if seq_len is not None else int(cfg.context.max_tokens)
    kern = cfg.kernels
    device = str(cfg.hardware.device)
    padded = int(cfg.train.micro_batch) > 1 and cfg.model.source != "arch"
    notes.append(
        f"every micro-batch is {s} tokens long (context.max_tokens): an upper bound for shorter documents"
    )
    if padded and cfg.attention.implementation == "sdpa":
        notes.append(
            "micro_batch > 1 on documents of different lengths: SDPA gets (b,1,s,s) bool + float padding masks "
            "and repeat_kv copies of k/v (no native GQA with a mask)"
        )
    if str(cfg.attention.implementation) == "flash_attention_2":
        notes.append("flash_attention_2 counted like SDPA's flash kernel (q, k, v, output, fp32 log-sum-exp)")
    liger, unsloth = bool(kern.liger), bool(kern.unsloth)
    # Liger's per-kernel flags (conf/kernels/liger.yaml; read with defaults so older configs still load)
    flce = liger and bool(kern.get("liger_fused_linear_cross_entropy", True))
    rms = liger and bool(kern.get("liger_rms_norm", True))
    swiglu = liger and bool(kern.get("liger_swiglu", True))
    rope = liger and bool(kern.get("liger_rope", True))
    if liger:
        on = [n for n, v in (("fused linear cross-entropy", flce), ("RMSNorm", rms), ("SwiGLU", swiglu)) if v]
        off = [
            n
            for n, v in (("fused linear cross-entropy", flce), ("RMSNorm", rms), ("SwiGLU", swiglu))
            if not v
        ]
        notes.append(
            f"Liger kernels on: {', '.join(on) or 'none'}"
            + (f"; off (HF modules): {', '.join(off)}" if off else "")
            + ": RMSNorm saves its compute-dtype input + fp32 rstd, SwiGLU saves only its two inputs, fused "
            "linear cross-entropy keeps one logits chunk; RoPE changes no saved tensor"
        )
    if unsloth:
        notes.append(
            "Unsloth: fused RMSNorm/SwiGLU; its fused chunked cross-entropy computes the loss gradient inside "
            "the forward, one chunk of the logits at a time (unsloth_zoo UnslothFusedLoss); with "
            "checkpointing the layer inputs are offloaded to host memory"
        )
    budget = budget_bytes(cfg)
    opt_state = optimizer_state(cfg.optimizer)
    if device == "cuda":
        notes.append(
            "CUDA: the peak is the caching allocator's reserved memory (what the budget and the emulated cap "
            "limit): allocated tensors + the reserve model (idle loss blocks, one layer's cycling working set, "
            f"small-pool holes); the CUDA context (hardware.overhead_bytes={int(cfg.hardware.overhead_bytes)}) "
            "lives outside the allocator and is not counted against the budget"
        )
        if opt_state.paged:
            notes.append("paged optimizer state is counted on the device (it only pages out under pressure)")
    if method == "lora" and cfg.quant.bits == 16 and c == 2:
        notes.append(
            "LoRA adapters in fp32 (PEFT autocast_adapter_dtype): each adapted projection keeps an "
            "fp32 copy of its input for backward"
        )
    return Knobs(
        dims=dims,
        vocab=vocab,
        c=c,
        quant_bits=int(cfg.quant.bits),
        quant_type=cfg.quant.quant_type,
        double_quant=bool(cfg.quant.double_quant),
        blocksize=int(cfg.quant.blocksize),
        skip=frozenset(str(x) for x in cfg.quant.skip_modules),
        method=method,
        r=int(a.r),
        dropout=float(a.dropout),
        dora=bool(a.use_dora),
        targets=targets,
        optimizer=str(cfg.optimizer.name),
        opt=opt_state,
        attention=str(cfg.attention.implementation),
        liger=liger,
        liger_flce=flce,
        unsloth=unsloth,
        checkpointing=bool(cfg.checkpointing.enabled),
        micro_batch=int(cfg.train.micro_batch),
        grad_accum=int(cfg.train.grad_accum),
        seq_len=s,
        device=device,
        overhead=int(cfg.hardware.overhead_bytes) if device == "cuda" else 0,
        padded_batches=padded,
        notes=notes,
        fused_rms_norm=rms or unsloth,
        fused_swiglu=swiglu or unsloth,
        fused_rope=rope or unsloth,
        budget=budget,
        allocator=device == "cuda",
        adapter_bytes=c if str(a.get("dtype", "fp32")) == "compute" else 4,
        fp32_master=method == "lora" and a.get("dtype") == "compute" and bool(a.get("fp32_master", True)),
        **registry.estimate_fields(cfg),  # knobs registered with estimate hooks (vramsweep.knobs.registry)
    )


def optimizer_state(o: DictConfig) -> OptimizerState:
    """The optimizer's state spec (``optimizer.state``, declared in its option file), with the 8-bit
    threshold the class is given (``optimizer.kwargs.min_8bit_size``; else the spec's, the class default).

    A result written before optimizers were declarative (``optimizer.impl``, no ``state``) takes the spec
    of the option file of the same name and its own ``min_8bit_size``."""
    if "state" in o:
        state, kwargs = o.state, o.get("kwargs") or {}
    else:
        path = find_option("optimizer", str(o.name))
        if path is None:
            raise ValueError(f"optimizer={o.name}: no state spec and no file conf/optimizer/{o.name}.yaml")
        declared = OmegaConf.load(path)
        state, kwargs = declared.state, dict(declared.get("kwargs") or {})
        if "min_8bit_size" in kwargs and "min_8bit_size" in o:
            kwargs["min_8bit_size"] = o.min_8bit_size
    spec = OptimizerState.from_mapping(state)
    if "min_8bit_size" in kwargs:
        spec = dataclasses.replace(spec, min_8bit_size=int(kwargs["min_8bit_size"]))
    return spec


def budget_bytes(cfg: DictConfig) -> int | None:
    """``hardware.budget_gib`` in bytes (GiB = 2**30); None when 0 (no budget)."""
    gib = float(cfg.hardware.budget_gib)
    return int(gib * GIB) if gib > 0 else None


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
    """Longest ``context.max_tokens`` whose estimate fits ``hardware.budget_gib`` (bisection on the estimator).

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
        from vramsweep.config.rope import plan as rope_plan

        hi = int(rope_plan(cfg)["positions"] or 0)  # the model's positions, x rope.factor with rope scaling
        hi = hi if hi > 0 else 1 << 20
    hi = max(1, int(hi))

    def est_at(tokens: int) -> dict[str, Any]:
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
