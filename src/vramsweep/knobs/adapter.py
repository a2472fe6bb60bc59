"""``adapter``: what trains, as a provider (:mod:`vramsweep.knobs.registry`).

Build: PEFT ``LoraConfig`` (``use_rslora``, ``use_dora``) on the loaded model, its adapters in fp32 (PEFT's
``autocast_adapter_dtype``) or in the compute dtype (``adapter.dtype=compute``); or every weight trainable
(``adapter=full``). Recorded as ``meta.build.adapter``. Estimate: method, rank, dropout, DoRA, the adapted
projections, the adapters' bytes and the fp32 master copies the optimizer then steps
(:class:`vramsweep.knobs.optim.Fp32Master`).
"""

from __future__ import annotations

from typing import Any

from vramsweep.config.modules import ATTN_PROJ, MLP_PROJ
from vramsweep.knobs.registry import KnobHooks, register

#: The projections of one decoder layer (what ``adapter.targets=all-linear`` adapts; not lm_head).
LINEARS = ATTN_PROJ + MLP_PROJ


def resolve_targets(targets: Any, notes: list[str]) -> frozenset[str]:
    """PEFT ``target_modules``: ``all-linear`` = every projection of the decoder layers (not lm_head)."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return frozenset(LINEARS)
        targets = [targets]
    names = [str(t).split(".")[-1] for t in targets]
    unknown = sorted(set(names) - set(LINEARS))
    if unknown:
        notes.append(f"adapter.targets {unknown} are not decoder projections: counted as no adapter")
    return frozenset(n for n in names if n in LINEARS)


def _lora(cfg: Any, b: Any) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    a = cfg.adapter
    lcfg = LoraConfig(
        r=int(a.r),
        lora_alpha=float(a.alpha),
        lora_dropout=float(a.dropout),
        target_modules=a.targets if isinstance(a.targets, str) else list(a.targets),
        use_rslora=bool(a.use_rslora),
        use_dora=bool(a.use_dora),
        task_type="CAUSAL_LM",
    )
    # adapter.dtype=compute: adapters in the compute dtype, so PEFT keeps no fp32 copy of each adapted
    # projection's input for backward (autocast_adapter_dtype=True upcasts adapters to fp32)
    fp32_adapters = str(a.get("dtype", "fp32")) == "fp32"
    b.model = get_peft_model(b.model, lcfg, autocast_adapter_dtype=fp32_adapters)
    if not fp32_adapters:
        for n, p in b.model.named_parameters():
            if p.requires_grad and "lora_" in n:
                p.data = p.data.to(b.dtype)
    if b.device.type == "cuda":
        b.model.to(b.device)
    return {
        "type": "lora",
        "rslora": bool(a.use_rslora),
        "dora": bool(a.use_dora),
        "dtype": "float32" if fp32_adapters else str(b.dtype).replace("torch.", ""),
    }


def _build(cfg: Any, b: Any) -> dict[str, Any]:
    if cfg.adapter.method == "lora":
        return {"adapter": _lora(cfg, b)}
    for p in b.model.parameters():
        p.requires_grad_(True)
    return {"adapter": {"type": "full"}}


def _estimate(cfg: Any, e: Any) -> dict[str, Any]:
    a = cfg.adapter
    method, c = str(a.method), e.fields["c"]
    targets = resolve_targets(a.targets, e.notes) if method == "lora" else frozenset()
    if method == "lora" and cfg.quant.bits == 16 and c == 2:
        e.note(
            "LoRA adapters in fp32 (PEFT autocast_adapter_dtype): each adapted projection keeps an "
            "fp32 copy of its input for backward"
        )
    return {
        "method": method,
        "r": int(a.r),
        "dropout": float(a.dropout),
        "dora": bool(a.use_dora),
        "targets": targets,
        "adapter_bytes": c if str(a.get("dtype", "fp32")) == "compute" else 4,
        "fp32_master": method == "lora" and a.get("dtype") == "compute" and bool(a.get("fp32_master", True)),
    }


register(
    KnobHooks(
        name="adapter",
        build=_build,
        estimate=_estimate,
        groups=("adapter",),
        notes_in="build",
    )
)
