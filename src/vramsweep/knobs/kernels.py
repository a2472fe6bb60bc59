"""Fused-kernel dispatch: Liger (Triton patches) or Unsloth (its own loader). Never both (rules.py).

* ``kernels=liger``: before the model is instantiated,
  ``liger_kernel.transformers.apply_liger_kernel_to_<family>`` swaps the family's modeling classes (RMSNorm,
  SwiGLU MLP, RoPE) and the causal-LM ``forward`` (fused linear cross-entropy: the ``seq x vocab`` logits are
  never materialised in training). The family is ``model.family`` for embedded/arch models and ``model_type``
  of ``<model.path>/config.json`` for local checkpoints. After the build, :func:`apply_liger_to_instance`
  checks that the patches took effect (a knob that silently did nothing would measure the baseline twice).
* ``kernels=unsloth``: the model is loaded through ``unsloth.FastLanguageModel`` with our knobs translated
  (:func:`unsloth_kwargs`): ``load_in_4bit`` / ``load_in_8bit`` / ``load_in_16bit``, ``max_seq_length``,
  ``dtype``, full fine-tuning, and ``get_peft_model`` with rank/alpha/dropout/targets/RS-LoRA/DoRA and
  Unsloth's offloaded gradient checkpointing. What Unsloth decides for itself is only accepted where it
  matches the knob (:func:`check_unsloth`): its 4-bit is always NF4 + double quantisation computed in
  ``train.dtype`` (measured: ``quant=nf4`` came back double-quantised), and it picks its own attention
  kernel, so only ``quant=nf4_dq|int8|none`` and ``attention=sdpa`` run with it. It needs weights on
  disk: the embedded model, ``model.path``, or for an architecture-only model (``source=arch``) a folder of
  deterministic random weights written once into the cache (:mod:`vramsweep.knobs.arch_weights`).

Liger needs CUDA (Triton); Unsloth trains on CPU with its fallbacks. ``rules.py`` marks them
``unsupported`` where they cannot run, so these functions are only reached on a capable machine.

The ``kernels`` provider (:mod:`vramsweep.knobs.registry`, at the end of this file): Liger's class patches
before loading (``meta.build.kernels``) and its instance check after the adapter
(``meta.build.kernels_instance``); Unsloth's loader in place of the ``model`` provider's; the estimator's
fused-kernel fields.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from vramsweep.config.rules import UnsupportedError, check_unsloth  # noqa: F401 - re-exported
from vramsweep.knobs.quant import count_quantised_layers
from vramsweep.knobs.registry import KnobHooks, register

#: ``model_type`` -> the ``liger_kernel.transformers`` patch for that family (causal text LMs, Liger 0.8.5).
LIGER_PATCHES: dict[str, str] = {
    "qwen3": "apply_liger_kernel_to_qwen3",
    "llama": "apply_liger_kernel_to_llama",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3_moe": "apply_liger_kernel_to_qwen3_moe",
    "mistral": "apply_liger_kernel_to_mistral",
    "ministral": "apply_liger_kernel_to_ministral",
    "mixtral": "apply_liger_kernel_to_mixtral",
    "gemma": "apply_liger_kernel_to_gemma",
    "gemma2": "apply_liger_kernel_to_gemma2",
    "gemma3_text": "apply_liger_kernel_to_gemma3_text",
    "phi3": "apply_liger_kernel_to_phi3",
    "granite": "apply_liger_kernel_to_granite",
    "olmo2": "apply_liger_kernel_to_olmo2",
    "olmo3": "apply_liger_kernel_to_olmo3",
    "glm4": "apply_liger_kernel_to_glm4",
    "smollm3": "apply_liger_kernel_to_smollm3",
    "exaone4": "apply_liger_kernel_to_exaone4",
}
#: Families whose patched module classes we know by name, so :func:`apply_liger_to_instance` can verify them.
LIGER_VERIFIED = {
    "qwen3": {"rms_norm": "LigerRMSNorm", "swiglu": "LigerSwiGLUMLP"},
    "llama": {"rms_norm": "LigerRMSNorm", "swiglu": "LigerSwiGLUMLP"},
    "qwen2": {"rms_norm": "LigerRMSNorm", "swiglu": "LigerSwiGLUMLP"},
    "mistral": {"rms_norm": "LigerRMSNorm", "swiglu": "LigerSwiGLUMLP"},
}
#: ``adapter.targets=all-linear`` for the Llama/Qwen block (what Unsloth's fast LoRA paths are keyed on).
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------------------------------------ Liger
def model_type(cfg: DictConfig) -> str:
    """The transformers ``model_type`` of the configured model.

    ``model.family`` for ``source=embedded|arch``; ``model_type`` from ``<model.path>/config.json`` for
    ``source=path`` (a local checkpoint's family is whatever it says it is).
    """
    if cfg.model.source != "path":
        return str(cfg.model.family)
    path = Path(str(cfg.model.path)) / "config.json"
    try:
        mtype = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise UnsupportedError(
            f"kernels=liger cannot read the model family from {path}: {exc}", key="model.path"
        ) from exc
    if not mtype:
        raise UnsupportedError(f"kernels=liger: {path} has no model_type", key="kernels", allowed=["none"])
    return str(mtype)


def liger_patch_name(cfg: DictConfig) -> str:
    """Name of the ``liger_kernel.transformers`` function for the model family."""
    family = model_type(cfg)
    if family not in LIGER_PATCHES:
        raise UnsupportedError(
            f"kernels=liger has no patch for model family {family!r} (Liger families here: "
            f"{', '.join(sorted(LIGER_PATCHES))})",
            key="kernels",
            allowed=["none"],
        )
    return LIGER_PATCHES[family]


def liger_kwargs(cfg: DictConfig) -> dict[str, bool]:
    """Keyword arguments for the patch function from ``conf/kernels/liger.yaml``.

    ``cross_entropy`` (Liger's plain CE kernel) stays off: with fused linear cross-entropy on, Liger
    forbids both; with it off, the knob means "Liger without the loss change" (HF's loss).
    """
    k = cfg.kernels
    return {
        "rope": bool(k.liger_rope),
        "rms_norm": bool(k.liger_rms_norm),
        "swiglu": bool(k.liger_swiglu),
        "cross_entropy": False,
        "fused_linear_cross_entropy": bool(k.liger_fused_linear_cross_entropy),
    }


@dataclass
class LigerPlan:
    """What :func:`apply_liger` calls: the function, the kwargs it accepts, the ones it does not."""

    family: str
    function: str
    kwargs: dict[str, bool]
    dropped: dict[str, bool] = field(default_factory=dict)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"liger_kernel.transformers.{self.function}({args})"


def liger_plan(cfg: DictConfig, fn: Any = None) -> LigerPlan:
    """The dispatch decision for ``cfg`` (``fn``: the patch function, to filter kwargs by its signature)."""
    family = model_type(cfg)
    name = liger_patch_name(cfg)
    wanted = liger_kwargs(cfg)
    kwargs, dropped = dict(wanted), {}
    if fn is not None:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in wanted.items() if k in params}
            dropped = {k: v for k, v in wanted.items() if k not in params}
    return LigerPlan(family=family, function=name, kwargs=kwargs, dropped=dropped)


def apply_liger(cfg: DictConfig) -> str:
    """Patch the transformers modeling classes for the family *before* the model is instantiated.

    Returns:
        the call that was made (recorded in ``meta.build.kernels``).
    """
    try:
        import liger_kernel.transformers as lk
    except ImportError as exc:
        raise UnsupportedError(
            f"kernels=liger needs liger-kernel (pip install -e '.[gpu]'): {exc}",
            key="kernels",
            allowed=["none"],
        ) from exc
    name = liger_patch_name(cfg)
    fn = getattr(lk, name)
    plan = liger_plan(cfg, fn)
    fn(**plan.kwargs)
    return plan.describe()


def _causal_lm(model: Any) -> Any:
    """The transformers causal LM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def apply_liger_to_instance(cfg: DictConfig, model: Any) -> dict[str, Any]:
    """Check that the class patches reached the built model; raise if a requested patch is missing.

    Counts Liger modules by class name and looks at the causal LM's ``forward`` (fused linear
    cross-entropy replaces it with Liger's ``lce_forward``). For families whose module names are not
    listed in :data:`LIGER_VERIFIED` the counts are recorded but not enforced.

    Returns:
        notes for ``meta.build.kernels_instance``.
    """
    lm = _causal_lm(model)
    counts: dict[str, int] = {}
    for mod in lm.modules():
        name = type(mod).__name__
        if name.startswith("Liger"):
            counts[name] = counts.get(name, 0) + 1
    fwd = getattr(type(lm), "forward", None)
    inst_fwd = lm.__dict__.get("forward")
    fwd_module = getattr(inst_fwd if inst_fwd is not None else fwd, "__module__", "") or ""
    flce = fwd_module.startswith("liger_kernel")
    family = model_type(cfg)
    want = liger_kwargs(cfg)
    missing: list[str] = []
    expected = LIGER_VERIFIED.get(family)
    if expected is not None:
        for knob, cls_name in expected.items():
            if want.get(knob) and not counts.get(cls_name):
                missing.append(f"{knob} (no {cls_name} module)")
        if want["fused_linear_cross_entropy"] and not flce:
            missing.append(
                f"fused_linear_cross_entropy ({type(lm).__name__}.forward is from {fwd_module or '?'})"
            )
    notes = {
        "family": family,
        "liger_modules": counts,
        "fused_linear_cross_entropy_forward": flce,
        "verified": expected is not None,
    }
    if missing:
        raise RuntimeError(
            "kernels=liger: the patches did not reach the model: "
            + "; ".join(missing)
            + " (was the model class imported or instantiated before the patch?)"
        )
    return notes


# ---------------------------------------------------------------------------------------------- Unsloth
def unsloth_kwargs(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Translate our knobs into ``FastLanguageModel.from_pretrained`` and ``get_peft_model`` kwargs.

    * quant: ``load_in_4bit`` / ``load_in_8bit`` / ``load_in_16bit`` (Unsloth defaults to 4-bit, so
      16-bit is explicit); its 4-bit is NF4 + double quantisation in ``dtype`` (= ``quant=nf4_dq``).
    * checkpointing: ``use_gradient_checkpointing="unsloth"`` (Unsloth's offloaded checkpointing) or
      ``False``, in both calls (``from_pretrained`` applies it for full fine-tuning).
    * adapter: r, alpha, dropout, targets (``all-linear`` -> the seven Llama/Qwen projections),
      ``use_rslora``, ``use_dora`` (only when on: it disables Unsloth's fast LoRA path).

    Returns:
        ``(load_kwargs, peft_kwargs)``; ``model_name`` is added by :func:`load_with_unsloth`.
    """
    from vramsweep.knobs.common import torch_dtype

    q, a = cfg.quant, cfg.adapter
    gc: str | bool = "unsloth" if cfg.checkpointing.enabled else False
    load: dict[str, Any] = {
        "max_seq_length": int(cfg.context.max_tokens),
        "dtype": torch_dtype(cfg.train.dtype),
        "load_in_4bit": q.bits == 4,
        "load_in_8bit": q.bits == 8,
        "load_in_16bit": q.bits == 16,
        "full_finetuning": a.method == "full",
        "use_gradient_checkpointing": gc,
        "random_state": int(cfg.train.seed),
    }
    targets = (
        ALL_LINEAR
        if isinstance(a.targets, str) and a.targets == "all-linear"
        else ([str(a.targets)] if isinstance(a.targets, str) else [str(t) for t in a.targets])
    )
    peft: dict[str, Any] = {
        "r": int(a.r),
        "lora_alpha": float(a.alpha),
        "lora_dropout": float(a.dropout),
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": bool(a.use_rslora),
        "use_gradient_checkpointing": gc,
        "random_state": int(cfg.train.seed),
    }
    if a.use_dora:
        peft["use_dora"] = True
    return load, peft


def load_with_unsloth(cfg: DictConfig, path: Any) -> tuple[Any, Any]:
    """Load through ``unsloth.FastLanguageModel`` with our quant/adapter/checkpointing knobs.

    Returns:
        ``(model, tokenizer)``: a PEFT model for LoRA adapters, the base model for ``adapter=full``.
        ``model.vramsweep_unsloth`` holds the translated kwargs (for ``meta.build``).
    """
    check_unsloth(cfg)
    if path is None:
        raise UnsupportedError(
            f"kernels=unsloth loads weights from disk: model={cfg.model.name} has no weights folder "
            "(the build writes one for source=arch)",
            key="kernels",
            allowed=["none", "liger"],
        )
    try:
        from unsloth import FastLanguageModel
    except ImportError as exc:
        raise UnsupportedError(
            f"kernels=unsloth needs unsloth (make unsloth): {exc}", key="kernels", allowed=["none", "liger"]
        ) from exc
    load, peft = unsloth_kwargs(cfg)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(path), **load)
    if cfg.adapter.method == "lora":
        model = FastLanguageModel.get_peft_model(model, **peft)
    try:
        model.vramsweep_unsloth = unsloth_notes(cfg)
    except Exception:  # some wrappers refuse new attributes; the notes are also rebuilt by the caller
        pass
    return model, tokenizer


def unsloth_notes(cfg: DictConfig) -> dict[str, Any]:
    """The translated kwargs as JSON-safe values, for ``meta.build``."""
    load, peft = unsloth_kwargs(cfg)
    load = {k: (str(v) if not isinstance(v, bool | int | float | str) else v) for k, v in load.items()}
    return {
        "from_pretrained": load,
        "get_peft_model": peft if cfg.adapter.method == "lora" else None,
        "attention": "chosen by Unsloth",
    }


# ------------------------------------------------------------------------------------------- provider
def _patch(cfg: DictConfig, b: Any) -> dict[str, Any]:
    if cfg.kernels.unsloth:
        return {}  # recorded by its loader
    return {"kernels": apply_liger(cfg) if cfg.kernels.liger else "none"}


def _load(cfg: DictConfig, b: Any) -> dict[str, Any]:
    """``kernels=unsloth``: Unsloth's loader builds the whole trial model (quant, adapter, checkpointing)."""
    if not cfg.kernels.unsloth:
        return {}

    notes: dict[str, Any] = {}
    path = b.path
    if path is None and cfg.model.source == "arch":  # Unsloth loads from disk: random weights, cached
        from vramsweep.knobs.arch_weights import ensure_arch_weights

        path, notes["arch_weights"] = ensure_arch_weights(cfg)
    b.model, tok = load_with_unsloth(cfg, path)
    b.tokenizer = tok or b.tokenizer
    b.done = True
    notes["kernels"] = "unsloth.FastLanguageModel"
    notes["unsloth"] = unsloth_notes(cfg)
    notes["quantised_layers"] = count_quantised_layers(b.model)
    return notes


def _build(cfg: DictConfig, b: Any) -> dict[str, Any]:
    return {"kernels_instance": apply_liger_to_instance(cfg, b.model)} if cfg.kernels.liger else {}


#: Liger's per-kernel flags (conf/kernels/liger.yaml) and how the estimator's notes name them.
_LIGER_FLAGS = (
    ("liger_fused_linear_cross_entropy", "fused linear cross-entropy"),
    ("liger_rms_norm", "RMSNorm"),
    ("liger_swiglu", "SwiGLU"),
)


def _estimate(cfg: DictConfig, e: Any) -> dict[str, Any]:
    kern = cfg.kernels
    liger, unsloth = bool(kern.liger), bool(kern.unsloth)
    # read with defaults so older configs (before the per-kernel flags) still load
    on = {
        flag: liger and bool(kern.get(flag, True)) for flag in (*(f for f, _ in _LIGER_FLAGS), "liger_rope")
    }
    if liger:
        names_on = [n for f, n in _LIGER_FLAGS if on[f]]
        names_off = [n for f, n in _LIGER_FLAGS if not on[f]]
        e.note(
            f"Liger kernels on: {', '.join(names_on) or 'none'}"
            + (f"; off (HF modules): {', '.join(names_off)}" if names_off else "")
            + ": RMSNorm saves its compute-dtype input + fp32 rstd, SwiGLU saves only its two inputs, fused "
            "linear cross-entropy keeps one logits chunk; RoPE changes no saved tensor"
        )
    if unsloth:
        e.note(
            "Unsloth: fused RMSNorm/SwiGLU; its fused chunked cross-entropy computes the loss "
            "gradient inside the forward, one chunk of the logits at a time (unsloth_zoo "
            "UnslothFusedLoss); with checkpointing the layer inputs are offloaded to host memory"
        )
    return {
        "liger": liger,
        "liger_flce": on["liger_fused_linear_cross_entropy"],
        "unsloth": unsloth,
        "fused_rms_norm": on["liger_rms_norm"] or unsloth,
        "fused_swiglu": on["liger_swiglu"] or unsloth,
        "fused_rope": on["liger_rope"] or unsloth,
    }


def liger_sync_point(cfg: DictConfig, model, clock: Any):
    """With Liger's fused linear cross-entropy, which calls ``.item()`` as its forward starts (liger-kernel
    0.8.5: a host sync each micro-batch), mark that point on ``clock`` after each decoder forward, so the
    host's wait there is counted as ``loss_sync`` (a wait for the device) instead of forward work; and
    one as each backward starts (its backward's ``torch.equal`` on the incoming gradient: ``backward_sync``).
    Returns the hook's handle, or None."""
    k = cfg.kernels
    if not (bool(k.get("liger", False)) and bool(k.get("liger_fused_linear_cross_entropy", False))):
        return None
    lm = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get_decoder = getattr(lm, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None:
        return None
    from vramsweep.measure.steps import install_sync_point  # the measure package imports torch

    clock.backward_sync_point = True
    return install_sync_point(clock, decoder)


def _measure(cfg: DictConfig, m: Any) -> None:
    if m.phase == "train_start":  # Liger's host syncs: counted as loss_sync/backward_sync, not forward work
        liger_sync_point(cfg, m.model, m.clock)


register(
    KnobHooks(
        name="kernels",
        patch=_patch,
        load=_load,
        build=_build,
        measure=_measure,
        estimate=_estimate,
        groups=("kernels",),
        notes_in="build",
    )
)
