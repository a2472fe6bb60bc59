"""Architecture-only models (``model.source=arch``) built in place on the target device.

An 8B model in bf16 is 16 GB: building it on the CPU, saving it and reloading it quantised (the old
``_arch_weights_dir`` route) writes 16 GB to disk and never fits a 16 GiB card on the way. Here the
model is built the way ``from_pretrained`` builds a quantised checkpoint, minus the checkpoint:

1. the skeleton is created on the ``meta`` device (no memory);
2. for ``quant != none`` transformers' own bitsandbytes quantiser swaps the linears for
   ``bnb.nn.Linear4bit`` / ``Linear8bitLt`` (``HfQuantizer.preprocess_model``: the same modules and
   skip list as a real quantised load);
3. every module is materialised one at a time on the device: quantised linears get random weights in
   the model dtype which are quantised at once (so at most one bf16 linear is alive at a time), other
   modules (embeddings, lm_head, norms, rotary buffers) get transformers' own ``_init_weights``;
4. ``HfQuantizer.postprocess_model`` sets what PEFT and transformers look for
   (``is_loaded_in_4bit``/``is_loaded_in_8bit``, ``config.quantization_config``, ``hf_quantizer``).

Qwen3-8B in NF4 appears in seconds on a GPU and peaks at ~6.1 GB + one bf16 linear (~100 MB),
well inside a 16 GiB cap; the same code runs on the CPU for tests with a tiny config.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from omegaconf import DictConfig

from vramsweep.hfmodel import hf_config
from vramsweep.knobs.common import bnb_config, torch_dtype
from vramsweep.knobs.rope import apply_rope

_QUANT_CLASSES = ("Linear4bit", "Linear8bitLt")


def _device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def meta_skeleton(cfg: DictConfig) -> torch.nn.Module:
    """The model for ``cfg.model`` on the meta device (no storage), with ``cfg.attention`` and ``cfg.rope``
    set.

    Liger class patches applied before this call take effect (the modules are instantiated here).
    """
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg.model)
    if "rope" in cfg:
        apply_rope(config, cfg)  # rope scaling is part of the architecture the skeleton is built from
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=torch_dtype(cfg.train.dtype),
            attn_implementation=str(cfg.attention.implementation),
        )
    return model


def _quantiser(cfg: DictConfig) -> Any:
    """transformers' bitsandbytes quantiser for ``cfg.quant`` (None for 16-bit)."""

    qconf = bnb_config(cfg)
    if qconf is None:
        return None
    from transformers.quantizers import AutoHfQuantizer

    return AutoHfQuantizer.from_config(qconf, pre_quantized=False)


def _random_quantised_weight(module: torch.nn.Module, device: torch.device, dtype: torch.dtype, std: float):
    """A quantised ``Params4bit``/``Int8Params`` for a meta bnb linear, from N(0, std) weights made on
    ``device`` in ``dtype`` (the bf16 copy is dropped as soon as it is quantised)."""
    import bitsandbytes as bnb

    old = module.weight
    w = torch.empty(tuple(old.shape), dtype=dtype, device=device)
    w.normal_(mean=0.0, std=std)
    if isinstance(module, bnb.nn.Linear4bit):
        new = bnb.nn.Params4bit(
            w,
            requires_grad=False,
            blocksize=old.blocksize,
            compress_statistics=old.compress_statistics,
            quant_type=old.quant_type,
            quant_storage=old.quant_storage,
            module=module,
        )
        return new.to(device)  # Params4bit.to() quantises when not yet quantised
    new = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=bool(old.has_fp16_weights))
    if new.has_fp16_weights:
        return new
    if hasattr(new, "_quantize"):  # bitsandbytes >= 0.45: quantise where the weight already is
        return new._quantize(device)
    return bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False).to(device)


def _materialise_quantised(
    module: torch.nn.Module,
    dev: torch.device,
    dtype: torch.dtype,
    std: float,
    memo: dict[int, torch.nn.Parameter],
    counts: dict[str, int],
) -> None:
    """A meta bnb linear's weight made a random quantised one (:func:`_random_quantised_weight`, once per
    tied weight through ``memo``; counted in ``counts``), and its meta bias zeros in ``dtype``."""
    w = module._parameters.get("weight")
    if w is not None and w.is_meta:
        if id(w) not in memo:
            memo[id(w)] = _random_quantised_weight(module, dev, dtype, std)
            counts["quantised"] += 1
            counts["bytes"] += memo[id(w)].data.nbytes
        module._parameters["weight"] = memo[id(w)]
    b = module._parameters.get("bias")
    if b is not None and b.is_meta:
        module._parameters["bias"] = torch.nn.Parameter(
            torch.zeros(tuple(b.shape), dtype=dtype, device=dev), requires_grad=b.requires_grad
        )


def _materialise_storage(
    module: torch.nn.Module,
    dev: torch.device,
    memo: dict[int, torch.nn.Parameter],
    counts: dict[str, int],
) -> bool:
    """Uninitialised storage on ``dev`` for the meta parameters (once per tied parameter through ``memo``)
    and meta buffers ``module`` holds itself, its bytes added to ``counts``.

    Returns:
        whether anything was created (a parameter already made for a tied module does not count), i.e.
        whether the module needs initialising.
    """
    fresh = False
    for name, p in list(module._parameters.items()):
        if p is None or not p.is_meta:
            continue
        if id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(
                torch.empty(tuple(p.shape), dtype=p.dtype, device=dev), requires_grad=p.requires_grad
            )
            counts["bytes"] += memo[id(p)].nbytes
            fresh = True
        module._parameters[name] = memo[id(p)]
    for name, buf in list(module._buffers.items()):
        if buf is not None and buf.is_meta:
            module._buffers[name] = torch.empty(tuple(buf.shape), dtype=buf.dtype, device=dev)
            counts["bytes"] += module._buffers[name].nbytes
            fresh = True
    return fresh


@torch.no_grad()
def materialise(
    model: torch.nn.Module, device: torch.device | str, *, std: float | None = None
) -> dict[str, int]:
    """Give every meta parameter and buffer of ``model`` real storage on ``device``, module by module.

    Quantised bitsandbytes linears get random N(0, ``std``) weights quantised on the spot; every
    other module is initialised by the model's own ``_init_weights`` (normal linears/embeddings,
    ones for norms, recomputed rotary frequencies). Tied parameters stay tied.

    Returns:
        counts: ``quantised`` linears, ``initialised`` modules, ``bytes`` of storage created.
    """
    dev = _device(device)
    std = float(std if std is not None else getattr(model.config, "initializer_range", 0.02))
    dtype = getattr(model.config, "dtype", None) or next(model.parameters()).dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    memo: dict[int, torch.nn.Parameter] = {}  # id(meta param) -> its materialised parameter (tied weights)
    counts = {"quantised": 0, "initialised": 0, "bytes": 0}
    init_fn = getattr(model, "_init_weights", None)
    for module in model.modules():
        if type(module).__name__ in _QUANT_CLASSES:
            _materialise_quantised(module, dev, dtype, std, memo, counts)
            continue
        if _materialise_storage(module, dev, memo, counts):
            if init_fn is None:
                raise RuntimeError(
                    f"{type(model).__name__} has no _init_weights to initialise {type(module).__name__}"
                )
            init_fn(module)
            counts["initialised"] += 1
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"materialise: still on the meta device: {', '.join(left[:8])}")
    return counts


def build_arch_model(cfg: DictConfig, device: torch.device | str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build ``cfg.model`` (``source=arch``) with random weights directly on ``device``.

    Applies ``cfg.quant`` (bitsandbytes NF4/FP4/int8 through transformers' quantiser, ``lm_head`` and
    embeddings kept in ``train.dtype``) and ``cfg.attention``; seeded by ``train.seed``. Kernel patches
    (Liger) must be applied before the call. This is what ``build_model`` calls for ``source=arch``.

    Returns:
        ``(model, notes)``: the model in eval mode with ``use_cache=False``, and what was done.
    """

    t0 = time.perf_counter()
    dev = _device(device)
    dtype = torch_dtype(cfg.train.dtype)
    model = meta_skeleton(cfg)
    hfq = _quantiser(cfg)
    if hfq is not None:
        hfq.validate_environment(device_map={"": dev.index if dev.type == "cuda" else "cpu"})
        hfq.preprocess_model(
            model=model,
            dtype=dtype,
            device_map={"": dev.index if dev.type == "cuda" else "cpu"},
            checkpoint_files=None,
            use_kernels=False,
        )
    torch.manual_seed(int(cfg.train.seed))
    counts = materialise(model, dev)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if hfq is not None:
        model.hf_quantizer = hfq
        hfq.postprocess_model(model)
    model.config.use_cache = False
    model.eval()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    notes = {
        "route": "meta skeleton -> per-module random init on the device"
        + (" -> bitsandbytes quantisation" if hfq is not None else ""),
        "device": str(dev),
        "dtype": str(cfg.train.dtype),
        "quant": str(cfg.quant.name),
        "quantised_linears": counts["quantised"],
        "initialised_modules": counts["initialised"],
        "materialised_bytes": counts["bytes"],
        "init_std": float(getattr(model.config, "initializer_range", 0.02)),
        "seed": int(cfg.train.seed),
        "build_s": round(time.perf_counter() - t0, 3),
    }
    return model, notes
