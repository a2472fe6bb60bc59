"""Analytic memory model of one fine-tuning step: pure arithmetic on the model dims and the knobs.

Every number is a count of real tensor bytes, derived from the code that the trial runs (transformers'
Qwen3/Llama modules, PEFT's LoRA/DoRA layers, bitsandbytes' quantised layers and optimizers, the
minimal loop in :mod:`vramsweep.trial`) and checked against the CPU tensor tracker
(:mod:`vramsweep.measure.cpu`) in ``tests/estimate/test_estimate.py``. Sources:

* Quantised weights: bitsandbytes ``Params4bit`` (uint8 ``[ceil(n/2), 1]``) + ``QuantState``
  (``absmax`` fp32 per 64-block; double quant: uint8 ``absmax`` + fp32 ``offset`` + ``state2.absmax`` fp32
  per 256 absmax + ``state2.code`` 256 x fp32; ``code`` 16 x fp32) -- QLoRA paper (Dettmers et al. 2023,
  arXiv 2305.14314) section 3: 4 + 32/64 = 4.5 bits, 4 + 8/64 + 32/(64*256) = 4.127 bits with double
  quantisation. ``Int8Params``: int8 weight + fp32 ``SCB`` per output row (LLM.int8(), arXiv 2208.07339).
* Adapters: PEFT keeps LoRA A (r x in), B (out x r) and DoRA's magnitude (out) in fp32
  (``autocast_adapter_dtype=True``); DoRA: Liu et al. 2024, arXiv 2402.09353.
* Optimizer state: ``torch.optim.AdamW`` (``exp_avg``, ``exp_avg_sq`` in the param dtype + fp32 ``step``);
  bitsandbytes ``Optimizer2State.init_state`` (8-bit: two uint8 states + two fp32 ``absmax`` per
  256-block, shared 256-entry ``qmap1``/``qmap2``; tensors under ``min_8bit_size`` get fp32 state;
  32-bit: two fp32 states); transformers ``Adafactor`` (``exp_avg_sq_row``/``exp_avg_sq_col`` fp32 for
  >=2-D params, a full fp32 ``exp_avg_sq`` for 1-D, fp32 ``RMS``; no first moment with ``beta1=None``) --
  Shazeer & Stern 2018, arXiv 1804.04235.
* Activations: the tensors autograd saves per decoder layer (enumerated from the HF forward, with the
  sharing PEFT's fp32 input casts break), the Korthikanti et al. 2022 (arXiv 2205.05198) decomposition
  s*b*h*(34 + 5*a*s/h) re-derived for SwiGLU/GQA/RMSNorm blocks: eager attention keeps the
  (b*heads*s*s) probabilities (fp32 softmax output + its cast); SDPA/FlashAttention keep only q, k, v,
  the output and the fp32 log-sum-exp; full checkpointing keeps the layer inputs (b*s*h) plus one layer
  recomputed in backward.
* Logits + loss: HF ``ForCausalLMLoss`` upcasts the logits to fp32 and ``cross_entropy`` saves the fp32
  log-softmax; at the peak (log-softmax backward) the saved log-softmax and its incoming and outgoing
  fp32 gradients are alive: 12 bytes per token x vocab entry (+ c when the loop keeps the model output,
  and with it the logits, through backward: :data:`LOOP_KEEPS_LOGITS`). Liger's fused linear cross-entropy
  (Hsu et al. 2024, arXiv 2410.10989) chunks it.
* Fused kernels, flag by flag: Liger's RMSNorm (``LigerRMSNormFunction``: saves the input and the fp32
  rstd), SwiGLU (``LigerSiLUMulFunction``: saves its two inputs, recomputes silu) and fused linear
  cross-entropy follow ``kernels.liger_rms_norm`` / ``liger_swiglu`` / ``liger_fused_linear_cross_entropy``
  (as the build does); Liger's RoPE changes no saved tensor. Unsloth patches the norm and SwiGLU alike,
  offloads each checkpointed layer's input to host memory (``use_gradient_checkpointing="unsloth"``) and
  computes the loss with unsloth_zoo's ``UnslothFusedLoss`` (:func:`unsloth_ce_chunk_tokens`).
* LLM.int8 on CUDA (bitsandbytes 0.50 ``MatMul8bitLt``): ``ctx.tensors = (CAt, subA, A)`` keeps every
  projection input through backward, checkpointing or not; backward dequantises ``CB.to(dtype) * SCB/127``.
* CUDA caching allocator: :func:`allocator_reserve` (reserved >= allocated); the CUDA context is outside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from vramsweep.estimate.dims import ModelDims
from vramsweep.record.units import GIB

ADAPTER_BYTES = 4  # PEFT autocasts adapter weights to fp32
BNB_4BIT_CODE_ENTRIES = 16  # QuantState.code (NF4/FP4 lookup table), fp32
BNB_NESTED_CODE_ENTRIES = 256  # state2.code (dynamic 8-bit map for the absmax), fp32
BNB_NESTED_BLOCKSIZE = 256  # second-level block size of double quantisation
BNB_OPTIM_BLOCKSIZE = 256  # blockwise 8-bit optimizer state
BNB_QMAP_ENTRIES = 256  # qmap1 (signed dynamic) and qmap2 (unsigned dynamic), shared by all params
BATCH_INT_BYTES_PER_TOKEN = 32  # int64 input_ids, attention_mask, labels + the padded shift of the labels
# vramsweep.trial keeps only ``.loss`` of the model output, so the compute-dtype logits are freed before
# backward; a loop that holds ``out`` pins them (c bytes per token x vocab entry) until it drops it.
LOOP_KEEPS_LOGITS = False


@dataclass
class TensorSpec:
    """One tensor of the model (or a group of identical ones: ``count``)."""

    name: str
    shape: tuple[int, ...]
    elem_bytes: float
    trainable: bool = False
    count: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return int(math.ceil(self.numel * self.elem_bytes)) * self.count


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per trainable tensor of n elements (``conf/optimizer/<name>.yaml``
    ``state:``; schema :class:`vramsweep.config.schema.OptimizerStateConfig` documents each field).

    Per tensor: ``moments`` state tensors of n elements (``factored``: rows + cols for a >=2-D tensor) at
    ``bytes`` each (0 = the dtype of the tensor stepped) + ``scalar_bytes``. 8-bit (``bytes=1``):
    + one fp32 absmax per ``block`` per moment, fp32 state below ``min_8bit_size`` elements, and
    ``moments`` x ``qmap`` fp32 map entries shared by all tensors (bitsandbytes ``Optimizer1State`` /
    ``Optimizer2State.init_state``).
    """

    moments: int = 2
    bytes: int = 0
    block: int = 256
    qmap: int = 256
    min_8bit_size: int = 4096
    factored: bool = False
    scalar_bytes: int = 0
    paged: bool = False
    temporaries: float = 0.0
    foreach_cuda: bool = False

    @classmethod
    def from_mapping(cls, m) -> OptimizerState:
        """From the config's ``optimizer.state`` (any mapping; missing keys take the defaults)."""
        f = cls.__dataclass_fields__
        return cls(**{k: type(f[k].default)(m[k]) for k in f if k in m and m[k] is not None})

    def eight_bit(self, n: int) -> bool:
        return self.bytes == 1 and n >= self.min_8bit_size

    def elem_bytes(self, n: int, stepped_bytes: float) -> float:
        """Bytes per state element of a tensor of n elements stepped in ``stepped_bytes``."""
        if self.bytes == 1:
            return 1 if self.eight_bit(n) else 4
        return self.bytes or stepped_bytes

    def moment_numel(self, shape: tuple[int, ...]) -> int:
        if self.factored and len(shape) >= 2:
            return math.prod(shape[:-1]) + shape[-1]
        return math.prod(shape)


@dataclass
class Knobs:
    """The config values the memory model depends on (resolved once from the composed config by the
    providers' estimate hooks: :func:`vramsweep.estimate.knobs_from_cfg`)."""

    dims: ModelDims
    vocab: int  # vocabulary rows after slicing
    c: int  # compute/activation dtype bytes (train.dtype)
    quant_bits: int
    quant_type: str | None
    double_quant: bool
    blocksize: int
    skip: frozenset[str]
    method: str  # lora | full
    r: int
    dropout: float
    dora: bool
    targets: frozenset[str]
    optimizer: str  # optimizer.name (messages); its memory comes from ``opt``
    opt: OptimizerState  # optimizer.state: what the optimizer keeps per trainable tensor
    attention: str
    liger: bool
    liger_flce: bool  # Liger fused linear cross-entropy (kernels.liger_fused_linear_cross_entropy)
    unsloth: bool
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    seq_len: int
    device: str
    overhead: int  # CUDA context outside the caching allocator (hardware.overhead_bytes); not in the peak
    padded_batches: bool
    notes: list[str] = field(default_factory=list)
    # fused kernels honoured one by one (Liger's per-kernel flags; Unsloth patches all of them)
    fused_rms_norm: bool = False
    fused_swiglu: bool = False
    fused_rope: bool = False
    budget: int | None = None  # hardware.budget_gib in bytes (Unsloth sizes its loss chunks from free memory)
    allocator: bool = False  # model the CUDA caching allocator's reserve (device == cuda)
    offload: bool = False  # checkpointing=offload (layer inputs in host memory; CUDA only saves memory)
    loss_chunk: int = 0  # tiling.loss_chunk_tokens: our chunked linear cross-entropy (0 = HF loss)
    mlp_tile: int = 0  # tiling.mlp_tile_tokens: sequence-tiled MLP (0 = untiled)
    adapter_bytes: int = 4  # adapter.dtype: fp32 (PEFT autocast, 4) or compute (= c)
    fp32_master: bool = False  # adapter.fp32_master with 16-bit adapters: the optimizer steps fp32 copies
    packed: bool = False  # data.packing: segment-wise attention, no 4-D mask (eager: no float causal mask)
    attn_groups: int = 1  # tiling.attention_heads: attention in that many head groups (0/1: one call)

    def __post_init__(self) -> None:
        if not isinstance(self.opt, OptimizerState):  # the optimizer provider gives the declared mapping
            self.opt = OptimizerState.from_mapping(self.opt)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    def quantised(self, linear: str) -> bool:
        return self.quant_bits in (4, 8) and linear not in self.skip


# --------------------------------------------------------------------------------------------------
# parameters


def _quantised_linear_specs(k: Knobs, name: str, fan_in: int, fan_out: int, count: int) -> list[TensorSpec]:
    n = fan_in * fan_out
    if k.quant_bits == 8:
        # Int8Params (int8 [out, in]) + SCB (fp32 per output row); CB aliases the weight storage.
        return [
            TensorSpec(f"{name}.weight[int8]", (fan_out, fan_in), 1, count=count),
            TensorSpec(f"{name}.SCB", (fan_out,), 4, count=count),
        ]
    blocks = -(-n // k.blocksize)
    specs = [
        TensorSpec(f"{name}.weight[4bit]", ((n + 1) // 2, 1), 1, count=count),
        TensorSpec(f"{name}.quant_state.code", (BNB_4BIT_CODE_ENTRIES,), 4, count=count),
    ]
    if k.double_quant:
        specs += [
            TensorSpec(f"{name}.quant_state.absmax[uint8]", (blocks,), 1, count=count),
            TensorSpec(f"{name}.quant_state.offset", (), 4, count=count),
            TensorSpec(f"{name}.state2.absmax", (-(-blocks // BNB_NESTED_BLOCKSIZE),), 4, count=count),
            TensorSpec(f"{name}.state2.code", (BNB_NESTED_CODE_ENTRIES,), 4, count=count),
        ]
    else:
        specs.append(TensorSpec(f"{name}.quant_state.absmax", (blocks,), 4, count=count))
    return specs


def model_tensors(k: Knobs) -> list[TensorSpec]:
    """Every parameter, buffer and quantisation-state tensor, with ``trainable`` set (the inventory
    ``vramsweep.measure.cpu.model_state_tensors`` counts)."""
    d, c, L = k.dims, k.c, k.dims.num_layers
    full = k.method == "full"
    out: list[TensorSpec] = [TensorSpec("embed_tokens", (k.vocab, d.hidden_size), c, trainable=full)]
    if not d.tie_word_embeddings:
        out.append(TensorSpec("lm_head", (k.vocab, d.hidden_size), c, trainable=full))
    out.append(TensorSpec("norm", (d.hidden_size,), c, trainable=full))
    out.append(TensorSpec("layers.*.layernorms", (d.hidden_size,), c, trainable=full, count=2 * L))
    if d.qk_norm:
        out.append(TensorSpec("layers.*.qk_norm", (d.head_dim,), c, trainable=full, count=2 * L))
    # rotary inv_freq + original_inv_freq buffers (fp32, head_dim/2 each)
    out.append(TensorSpec("rotary_emb.inv_freq", (d.head_dim // 2,), 4, count=2))
    for name, (fi, fo) in d.linear_shapes().items():
        if k.quantised(name):
            out.extend(_quantised_linear_specs(k, f"layers.*.{name}", fi, fo, L))
        else:
            out.append(TensorSpec(f"layers.*.{name}.weight", (fo, fi), c, trainable=full, count=L))
        if d.attention_bias and name in ("q_proj", "k_proj", "v_proj"):
            out.append(TensorSpec(f"layers.*.{name}.bias", (fo,), c, trainable=full, count=L))
        if k.method == "lora" and name in k.targets:
            out.append(
                TensorSpec(f"layers.*.{name}.lora_A", (k.r, fi), k.adapter_bytes, trainable=True, count=L)
            )
            out.append(
                TensorSpec(f"layers.*.{name}.lora_B", (fo, k.r), k.adapter_bytes, trainable=True, count=L)
            )
            if k.dora:
                out.append(
                    TensorSpec(
                        f"layers.*.{name}.lora_magnitude_vector",
                        (fo,),
                        k.adapter_bytes,
                        trainable=True,
                        count=L,
                    )
                )
    return out


def logical_param_count(k: Knobs) -> int:
    """Parameter count as a model card states it (quantised weights counted by their logical shape)."""
    d, L = k.dims, k.dims.num_layers
    n = k.vocab * d.hidden_size * (1 if d.tie_word_embeddings else 2) + d.hidden_size * (2 * L + 1)
    if d.qk_norm:
        n += 2 * L * d.head_dim
    for name, (fi, fo) in d.linear_shapes().items():
        n += L * fi * fo
        if d.attention_bias and name in ("q_proj", "k_proj", "v_proj"):
            n += L * fo
        if k.method == "lora" and name in k.targets:
            n += L * (k.r * (fi + fo) + (fo if k.dora else 0))
    return n


# --------------------------------------------------------------------------------------------------
# optimizer state


def _stepped_bytes(k: Knobs, t: TensorSpec) -> float:
    """Bytes per element of the tensor the optimizer steps: the fp32 master of a 16-bit one with
    ``fp32_master`` (``knobs.optim.Fp32Master``), else the tensor itself."""
    return 4 if k.fp32_master and t.elem_bytes < 4 else t.elem_bytes


def optimizer_state_bytes(k: Knobs, trainable: list[TensorSpec]) -> int:
    """Bytes of ``optimizer.state`` after the first step (distinct storages), from the option's state spec
    (:class:`OptimizerState`). With ``fp32_master`` a 16-bit trainable tensor is stepped as an fp32 copy
    that the state holds (``knobs.optim.Fp32Master``): +4 bytes per element, and the state is sized by the
    fp32 copy."""
    s = k.opt
    total = 0
    any_8bit = False
    for t in trainable:
        n = t.numel
        stepped = _stepped_bytes(k, t)
        each = s.moments * s.moment_numel(t.shape) * s.elem_bytes(n, stepped) + s.scalar_bytes
        if s.eight_bit(n):
            any_8bit = True
            each += s.moments * 4 * (-(-n // s.block))  # fp32 absmax per block, per moment
        master = 4 * n if stepped != t.elem_bytes else 0
        total += (int(each) + master) * t.count
    if any_8bit:
        total += s.moments * s.qmap * 4  # qmap1 (signed) [+ qmap2 (unsigned)], shared by every tensor
    return total


BNB_PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages state buffers of params with >= 1e5 elements


def paged_state_bytes(k: Knobs, trainable: list[TensorSpec]) -> int:
    """Optimizer state that bitsandbytes puts in CUDA unified memory (``get_state_buffer``: ``state.paged``
    optimizers, CUDA, params with >= 1e5 elements; the absmax stay ordinary tensors). The estimate
    counts it on the device; ``torch.cuda.max_memory_allocated`` does not see it."""
    s = k.opt
    if k.device != "cuda" or not s.paged:
        return 0
    total = 0
    for t in trainable:
        n = t.numel
        if n < BNB_PAGED_MIN_NUMEL:
            continue
        total += int(s.moments * s.moment_numel(t.shape) * s.elem_bytes(n, _stepped_bytes(k, t))) * t.count
    return total


def optimizer_step_workspace(k: Knobs, trainable: list[TensorSpec]) -> int:
    """Temporaries of ``optimizer.step()`` (tracker category ``other``), from the state spec.

    ``state.temporaries`` param-sized temporaries of the largest tensor in the state's dtype (torch AdamW's
    single-tensor CPU path: ``denom`` = sqrt / bias-correction, two at once; Adafactor: ~3 fp32 ones,
    ``grad**2``, the factored approximation, the update); ``state.foreach_cuda``: on CUDA one temporary
    for every tensor at once instead (torch's foreach path materialises ``sqrt(exp_avg_sq)``).
    bitsandbytes: fused kernels (no tracked temporaries). ``fp32_master``: the step runs on the fp32
    copies, and their fp32 grads replace the 16-bit grads while it runs (+(4 - elem_bytes) per element).
    """
    if not trainable:
        return 0
    s = k.opt

    def elem(t: TensorSpec) -> float:
        return s.elem_bytes(t.numel, _stepped_bytes(k, t))

    master_grads = sum((_stepped_bytes(k, t) - t.elem_bytes) * t.numel * t.count for t in trainable)
    if s.foreach_cuda and k.device == "cuda":
        return int(sum(t.numel * elem(t) * t.count for t in trainable) + master_grads)
    return int(s.temporaries * max(t.numel * elem(t) for t in trainable) + master_grads)


# --------------------------------------------------------------------------------------------------
# Unsloth's fused, chunked cross-entropy

UNSLOTH_CE_BUDGET_BYTES_PER_LOGIT = 16  # unsloth_zoo ``_CE_BYTES_PER_LOGIT``: what it budgets per logit entry
UNSLOTH_CE_TARGET_CAP = 4 * GIB  # unsloth_zoo ``_CE_TARGET_GB_CAP``: at most 4 GiB per chunk
# Bytes per (token x vocab) entry one chunk actually holds at once: the compute-dtype logits (2), their
# fp32 upcast (4) and the gradient in the logits dtype (2); the log-softmax and its fp32 gradient are
# fused by the compiled chunk function. Checked on the two Unsloth GPU fixtures
# (tests/estimate/test_estimate_gpu.py).
UNSLOTH_CE_BYTES_PER_LOGIT = 8


def unsloth_ce_chunk_tokens(k: Knobs, static: float = 0.0) -> int:
    """Tokens per chunk of ``UnslothFusedLoss`` (unsloth_zoo ``get_chunk_size``).

    ``target`` = min(4 GiB, half the free memory) less the chunk-independent ``grad_inputs``; the free
    memory is read at run time (``torch.cuda.mem_get_info``: the whole device, not a per-process cap), so
    here it is the budget less the params + optimizer state, and 4 GiB without a budget.
    """
    T, V = k.tokens, k.vocab
    target = float(UNSLOTH_CE_TARGET_CAP)
    if k.budget:
        target = min(target, max(0.5 * (k.budget - static), 1.0))
    fixed = T * k.dims.hidden_size * k.c
    if 0 < fixed < target:
        target -= fixed
    exact = T * V * UNSLOTH_CE_BUDGET_BYTES_PER_LOGIT / target
    n_chunks = 1 if exact <= 1.0 + 1e-9 else min(T, 4 * math.ceil(exact / 4 - 1e-9))
    return -(-T // n_chunks)


# --------------------------------------------------------------------------------------------------
# activations


class _Saved:
    """Bytes per token of tensors alive for backward, keyed so that shared tensors count once."""

    def __init__(self) -> None:
        self.items: dict[str, float] = {}

    def add(self, key: str, nbytes: float) -> None:
        self.items.setdefault(key, float(nbytes))

    @property
    def total(self) -> float:
        return sum(self.items.values())


def _norm(s: _Saved, k: Knobs, key: str, in_key: str, width: int, rows: int, in_rg: bool, w_rg: bool) -> bool:
    """HF RMSNorm: ``x.to(fp32)``; ``pow``/``mul`` save the fp32 copy (the input itself when it is
    already fp32) and ``rsqrt`` (fp32, one per row); ``weight * x.to(dtype)`` saves the normalised
    tensor when the weight trains. Liger's RMSNorm saves the input and the fp32 rstd. Returns whether
    the output requires grad."""
    if in_rg:
        if k.fused_rms_norm:
            s.add(in_key, k.c * width)
        else:
            s.add(in_key if k.c == 4 else f"{key}.x32", 4 * width)
        s.add(f"{key}.rstd", 4 * rows)
    if w_rg:
        s.add(f"{key}.normed", k.c * width)
    return in_rg or w_rg


def _linear(
    s: _Saved, k: Knobs, name: str, in_key: str, fan_in: int, fan_out: int, x_rg: bool, int8: bool = True
) -> bool:
    """One projection: base (dense / Linear4bit / Linear8bitLt) + optional LoRA/DoRA branch."""
    full = k.method == "full"
    if full:
        s.add(in_key, k.c * fan_in)  # weight grad needs the input
    elif int8 and k.quant_bits == 8 and k.quantised(name) and x_rg:
        s.add(in_key, k.c * fan_in)  # bitsandbytes MatMul8bit keeps ctx.A for the input gradient
    lora = k.method == "lora" and name in k.targets
    if lora:
        a = k.adapter_bytes
        if k.dropout > 0:
            # CPU dropout multiplies by a scaled Bernoulli noise tensor in the input dtype (saved only when
            # the input needs a gradient); CUDA's fused native_dropout keeps a bool mask
            if x_rg:
                s.add(f"{name}.dropout_mask", (a if k.device == "cpu" else 1) * fan_in)
            s.add(f"{name}.x_dropped", a * fan_in)
        else:
            s.add(in_key if a == k.c else f"{name}.x32", a * fan_in)  # PEFT casts x to the adapter dtype
        s.add(f"{name}.lora_A_out", a * k.r)
        if k.dora:
            s.add(f"{name}.base_result", k.c * fan_out)
            s.add(f"{name}.lora_result", a * fan_out)
    return x_rg or full or lora


def _layer_saved(
    k: Knobs,
    in_rg: bool,
    int8: bool = True,
    mlp: bool | None = None,
    upto_attention: bool = False,
    upto_norm2: bool = False,
) -> _Saved:
    """Tensors one decoder layer keeps for backward (``int8=False``: without the LLM.int8 inputs, which
    a checkpointed recompute does not re-create: backward uses the original nodes' ``ctx.A``).
    ``mlp=False`` (default when ``tiling.mlp_tile_tokens`` > 0): the tiled MLP keeps only its input.
    ``upto_attention``: only what is saved up to the attention output, i.e. what is still alive when the
    layer's backward reaches its attention (the o_proj, norm and MLP tensors after it are freed by then).
    ``upto_norm2``: what is saved up to the second norm's output, i.e. what is alive while that norm runs
    backward (the MLP's tensors are freed by then)."""
    if mlp is None:
        mlp = k.mlp_tile <= 0
    d, c = k.dims, k.c
    full = k.method == "full"
    shapes = d.linear_shapes()
    H, K, hd = d.num_heads, d.num_kv_heads, d.head_dim
    s = _Saved()
    ln1 = _norm(s, k, "ln1", "x", d.hidden_size, 1, in_rg, full)
    rg = {n: _linear(s, k, n, "ln1_out", *shapes[n], ln1, int8) for n in ("q_proj", "k_proj", "v_proj")}
    q_rg, k_rg, v_rg = rg["q_proj"], rg["k_proj"], rg["v_proj"]
    if d.qk_norm:
        q_rg = _norm(s, k, "q_norm", "q_out", H * hd, H, q_rg, full)
        k_rg = _norm(s, k, "k_norm", "k_out", K * hd, K, k_rg, full)
    att_rg = q_rg or k_rg or v_rg
    if att_rg:
        if k.attention == "eager":
            # q, repeat_kv(k)^T, repeat_kv(v) (bmm inputs), fp32 softmax output, its cast to the dtype
            s.add("q_rot", c * H * hd)
            s.add("k_rep", c * H * hd)
            s.add("v_rep", c * H * hd)
        else:
            # with a padding mask transformers cannot use SDPA's native GQA (``use_gqa_in_sdpa``) and
            # passes repeat_kv copies of k and v (heads instead of kv heads)
            kv_heads = H if (k.padded_batches and k.attention == "sdpa") else K
            s.add("q_rot", c * H * hd)
            s.add("k_rot", c * kv_heads * hd)
            s.add("v", c * kv_heads * hd)
            s.add("attn_out", c * H * hd)
            s.add("lse", 4 * H)
    if upto_attention:
        return s
    o_in = "attn_out" if k.attention != "eager" else "attn_out_t"
    _linear(s, k, "o_proj", o_in, *shapes["o_proj"], att_rg, int8)
    ln2 = _norm(s, k, "ln2", "x2", d.hidden_size, 1, True, full)
    if upto_norm2:
        return s
    if not mlp:  # vramsweep.longctx.mlp: the tiled MLP's Function saves only its input (ln2_out)
        s.add("ln2_out", c * d.hidden_size)
        return s
    gate_rg = _linear(s, k, "gate_proj", "ln2_out", *shapes["gate_proj"], ln2, int8)
    up_rg = _linear(s, k, "up_proj", "ln2_out", *shapes["up_proj"], ln2, int8)
    inter = d.intermediate_size
    if gate_rg or up_rg:
        s.add("gate_out", c * inter)  # silu input (Liger/Unsloth SwiGLU: a and b only, silu recomputed)
        if not k.fused_swiglu:
            s.add("silu_out", c * inter)
        s.add("up_out", c * inter)
    _linear(s, k, "down_proj", "act_out", *shapes["down_proj"], gate_rg or up_rg, int8)
    return s


def _int8_inputs(k: Knobs) -> float:
    """Bytes per token of the distinct inputs of a layer's LLM.int8 projections (kept via ``ctx.A``)."""
    if k.quant_bits != 8 or k.method == "full":
        return 0.0
    d = k.dims
    inputs = {
        "q_proj": ("ln1_out", d.hidden_size),
        "k_proj": ("ln1_out", d.hidden_size),
        "v_proj": ("ln1_out", d.hidden_size),
        "o_proj": ("attn_out", d.num_heads * d.head_dim),
        "gate_proj": ("ln2_out", d.hidden_size),
        "up_proj": ("ln2_out", d.hidden_size),
        "down_proj": ("act_out", d.intermediate_size),
    }
    seen = {key: width for name, (key, width) in inputs.items() if k.quantised(name)}
    extra = INT8_CUDA_UNATTRIBUTED_WIDTHS * d.hidden_size if (seen and k.device == "cuda") else 0
    return float(k.c * (sum(seen.values()) + extra))


# CUDA (``MatMul8bitLt``; CPU runs ``MatMul8bitFp``): measured on the 2026-12-01 GPU run (Qwen3-8B, int8,
# 1,024 tokens, checkpointing; tests/fixtures/gpu_2026-12-01) the allocated peak is 0.84 GiB above the
# inputs ``ctx.tensors`` keeps -- 24 KiB per token per layer, i.e. three more hidden-width (or, for
# Qwen3-8B, one intermediate-width) compute-dtype tensors per layer that stay alive through backward
# like ``ctx.A``. Not attributed to a tensor yet (the outlier columns ``subA`` are ~empty for these
# activations); one data point, so its scaling with tokens is an assumption.
INT8_CUDA_UNATTRIBUTED_WIDTHS = 3
# HF RMSNorm's backward (``x.to(fp32)``, ``pow(2).mean``, ``rsqrt``): fp32 tensors of the norm's input
# shape alive at once (CPU tracker: offloaded and plain checkpoints with a tiled MLP, both adapter dtypes)
HF_NORM_BACKWARD_FP32_TEMPS = 5


def eager_bytes_per_token(k: Knobs) -> float:
    """Eager attention's saved probabilities per token per layer: heads * s * (fp32 + cast)."""
    if k.attention != "eager":
        return 0.0
    per_elem = 4 + (k.c if k.c != 4 else 0)
    return k.dims.num_heads * k.seq_len * per_elem


def attention_backward_bytes_per_token(k: Knobs) -> float:
    """Transient workspace of SDPA's flash (FlashAttention-2 ``mha_bwd``) / memory-efficient backward on
    CUDA, per token, while one layer's attention runs backward: ``dq`` (heads x head_dim, compute dtype)
    and its fp32 accumulator ``dq_accum``; ``dk``/``dv`` for every *query* head before GQA reduces them to
    the kv heads (``dk_expanded``/``dv_expanded``) plus the reduced ``dk``/``dv``; ``softmax_d`` (fp32 per
    head). Qwen3-8B (32 heads, 8 kv heads, head_dim 128, bf16): 45,184 B per token (2.8 GiB at 65,536
    tokens). Allocation sizes from the kernel source; not yet measured on a GPU (``extrapolated_terms``).
    CPU (PyTorch's CPU flash kernel) and eager attention: 0 (eager's score gradients are in its terms).

    In G head groups (``tiling.attention_heads``, :mod:`vramsweep.longctx.attention`) the per-call block
    (``dq_accum``, the expanded dk/dv, ``softmax_d``: heads x (2·head_dim + 1) x 4 B in bf16, 32,896 B for
    Qwen3-8B) is 1/G; the groups' dq/dk/dv outputs all stay alive until the last group is done, and
    ``split``'s backward then concatenates the query gradient (one more heads x head_dim x c block): the
    workspace is ``outputs + max(block / G, heads x head_dim x c)`` (Qwen3-8B, G = 4: 20,512 B/token)."""
    if k.device != "cuda" or k.attention not in ("sdpa", "flash_attention_2"):
        return 0.0
    d, c = k.dims, k.c
    q = d.num_heads * d.head_dim
    kv = d.num_kv_heads * d.head_dim
    expanded = 2 * q * c if d.num_kv_heads != d.num_heads else 0
    block = q * 4 + expanded + 4 * d.num_heads  # the per-call fp32 block: 1/G in head groups
    outputs = q * c + 2 * kv * c  # dq, dk, dv in the compute dtype
    groups = max(1, int(k.attn_groups or 1))
    if groups == 1:
        return float(block + outputs)
    return float(outputs + max(block / groups, q * c))


@dataclass
class ActivationTerms:
    """Per-step activation features (bytes) the calibration scales, and the phase peaks."""

    layers: float  # saved per-layer tensors (all layers, or stored inputs + one layer with checkpointing)
    attention: float  # eager (b*heads*s*s) probabilities of all layers kept for backward
    logits: float  # logits + loss at the peak
    fixed: float  # cos/sin, batch tensors, masks, final norm
    phases: dict[str, float]
    peak_phase: str
    working: float = 0.0  # one layer's backward working set (what the allocator cycles layer by layer)
    loss_transient: float = 0.0  # blocks of the loss freed before its peak (HF: the compute-dtype logits)
    after_mlp: bool = False  # the recompute peak comes after the layer's MLP backward (its grads exist)


@dataclass(frozen=True)
class _LayerTerms:
    """Per-token bytes of the decoder layers, before the calibration factor (``mlp_transient``: bytes)."""

    stored: float  # alive for backward: every layer's saved tensors, or with checkpointing what stays stored
    attention: float  # eager probabilities of every layer kept for backward (0 with checkpointing)
    per_layer_attn: float  # eager probabilities of one layer
    rest: float  # one layer's saved tensors (any layer but the first)
    one_layer: float = 0.0  # checkpointing: the recomputed layer's saved tensors + probabilities + prefetch
    prefetch: float = 0.0  # offloaded checkpoints: input copies back on the device for the recompute
    kept_out: float = 0.0  # offloaded checkpoints: the recomputed layer's output held by the Function
    mlp_transient: float = 0.0  # tiled MLP: one tile's MLP tensors while it is recomputed in backward


def _layer_terms(k: Knobs) -> _LayerTerms:
    """What the decoder layers keep for backward. Without checkpointing every layer's saved tensors (LoRA:
    layer 0's input, the embedding output, needs no grad) and eager probabilities; with checkpointing the
    stored inputs (:func:`_stored_inputs`) + one layer recomputed in backward (:func:`_recomputed_layer`)."""
    rest = _layer_saved(k, in_rg=True).total
    per_layer_attn = eager_bytes_per_token(k)
    mlp_transient = _mlp_tile_transient(k)
    if k.checkpointing:
        one_layer, prefetch, kept_out = _recomputed_layer(k, per_layer_attn)
        return _LayerTerms(
            stored=_stored_inputs(k),
            attention=0.0,
            per_layer_attn=per_layer_attn,
            rest=rest,
            one_layer=one_layer,
            prefetch=prefetch,
            kept_out=kept_out,
            mlp_transient=mlp_transient,
        )
    L = k.dims.num_layers
    first = _layer_saved(k, in_rg=k.method == "full").total
    return _LayerTerms(
        stored=first + (L - 1) * rest,
        attention=L * per_layer_attn,
        per_layer_attn=per_layer_attn,
        rest=rest,
        mlp_transient=mlp_transient,
    )


def _mlp_tile_transient(k: Knobs) -> float:
    """Tiled MLP (vramsweep.longctx.mlp): one tile's MLP tensors exist while it is recomputed in backward."""
    if k.mlp_tile <= 0:
        return 0.0
    mlp_tok = (
        _layer_saved(k, in_rg=True, int8=False, mlp=True).total
        - _layer_saved(k, in_rg=True, int8=False, mlp=False).total
    )
    return mlp_tok * min(k.seq_len, k.mlp_tile) * k.micro_batch


def _stored_inputs(k: Knobs) -> float:
    """Checkpointing: per token, what every layer keeps on the device between forward and backward.

    Unsloth and checkpointing=offload (vramsweep.longctx.offload) keep the layer inputs in host memory; on
    a CPU device the offloaded copies are in the same memory. With offload the embedding output (the first
    layer's input) stays alive beside its host copy through the whole backward: the CPU tracker and the GPU
    allocator trace (docs/gpu-runs/2026-12-04) both hold its block at the peak. bitsandbytes' 8-bit matmul
    keeps its input as ``ctx.A`` (a plain attribute, not a saved tensor), so checkpointing cannot drop it:
    every layer's int8 inputs stay alive."""
    d, c, L = k.dims, k.c, k.dims.num_layers
    offloaded = k.unsloth or (k.offload and k.device == "cuda")
    stored = 0.0 if offloaded else L * c * d.hidden_size
    if k.offload:
        stored += c * d.hidden_size
    stored += L * _int8_inputs(k)
    return stored


def _recomputed_layer(k: Knobs, per_layer_attn: float) -> tuple[float, float, float]:
    """Checkpointing: ``(one_layer, prefetch, kept_out)`` per token of the layer recomputed in backward.

    ``one_layer``: its saved tensors (without the LLM.int8 inputs, which the recompute does not re-create),
    eager probabilities and ``prefetch``: with offload on CUDA the prefetched input of the next layer to
    recompute, and the recomputed layer's own input unless its first norm saves that very tensor (key "x":
    Liger's RMSNorm, or fp32 compute). ``kept_out``: _OffloadedCheckpoint.backward holds the recomputed
    layer's output while it back-propagates it."""
    c, h = k.c, k.dims.hidden_size
    saved_one = _layer_saved(k, in_rg=True, int8=False)
    prefetch = 0.0
    if k.offload and k.device == "cuda":
        prefetch = c * h * (1 if "x" in saved_one.items else 2)
    one_layer = saved_one.total + per_layer_attn + prefetch
    kept_out = c * h if k.offload else 0.0
    return one_layer, prefetch, kept_out


@dataclass(frozen=True)
class _FixedTerms:
    """Bytes outside the decoder layers, alive through forward and backward."""

    total: float  # cos/sin, batch tensors, the final norm's saved tensors, 4-D masks
    final_saved: float  # the final norm's saved tensors (freed before any layer's backward)
    eager_mask: float  # eager attention's float causal mask (in ``total`` with checkpointing)


def _fixed_terms(k: Knobs) -> _FixedTerms:
    """cos/sin (b, s, head_dim) in the dtype, batch int64 tensors, final norm (+ lm_head input).

    The final norm's backward runs before any layer's: its saved tensors are gone when a recomputed layer
    runs backward (neither the CPU tracker nor the GPU allocator trace holds them there). 4-D masks: SDPA
    with padding gets the bool (b,1,s,s) mask and its float (dtype) version, saved for backward;
    FlashAttention-2 unpads instead. Eager's float causal mask lives through the forward, and through
    backward too with checkpointing (it is an input of every checkpointed layer); packed rows
    (segment-wise attention, knobs/packed_attention.py) build no 4-D mask at all."""
    d, c, T = k.dims, k.c, k.tokens
    b, s_len = k.micro_batch, k.seq_len
    fixed_tok = 2 * c * d.head_dim + BATCH_INT_BYTES_PER_TOKEN
    final = _Saved()
    _norm(final, k, "final_norm", "xf", d.hidden_size, 1, True, k.method == "full")
    if k.method == "full":
        final.add("final_out", c * d.hidden_size)
    fixed_tok += final.total
    fixed = fixed_tok * T
    if k.padded_batches and k.attention == "sdpa":
        fixed += b * s_len * s_len * (1 + c)
    eager_mask = b * s_len * s_len * c if k.attention == "eager" and not k.packed else 0.0
    if k.checkpointing:
        fixed += eager_mask
    return _FixedTerms(total=fixed, final_saved=final.total * T, eager_mask=eager_mask)


# --------------------------------------------------------------------------------------------------
# logits + loss, by loss kind: bytes at the loss peak before the calibration factor


@dataclass(frozen=True)
class _LossTerms:
    """The loss's bytes: ``logits`` at its peak; ``kept_logits`` held through backward (the loop's model
    output); ``freed_logits``: blocks freed at the end of the forward, idle at the peak (HF: the
    compute-dtype logits, with eager attention also the last layer's score buffers)."""

    logits: float
    kept_logits: float = 0.0
    freed_logits: float = 0.0


def _loss_kind(k: Knobs) -> str:
    """The loss the trial computes: Liger's fused linear CE, Unsloth's, our chunked one, or HF's."""
    if k.liger_flce:
        return "liger_flce"
    if k.unsloth:
        return "unsloth"
    return "chunked" if k.loss_chunk > 0 else "hf"


def _liger_flce_loss(k: Knobs, static: float) -> _LossTerms:
    """Liger's fused linear cross-entropy: one chunk's fp32 logits + their gradient, and grad_input (T x h);
    full fine-tuning adds the fp32 grad_weight accumulated across chunks."""
    d, T, V = k.dims, k.tokens, k.vocab
    chunk = 2 ** math.ceil(math.log2(max(1, -(-T // max(1, -(-V // d.hidden_size))))))
    logits = chunk * V * (4 + 4) + T * d.hidden_size * k.c
    if k.method == "full":
        logits += V * d.hidden_size * 4
    return _LossTerms(logits=logits)


def _unsloth_loss(k: Knobs, static: float) -> _LossTerms:
    """unsloth_zoo ``UnslothFusedLoss`` (fused_losses/cross_entropy_loss.py): the model forward never
    returns logits; the loss and its gradient are computed chunk by chunk inside the forward
    (``torch.func.grad_and_value`` per chunk), into a preallocated ``grad_inputs`` (T x h, compute dtype).
    ``get_chunk_size``: n_chunks = ceil(T*V*16 B / target / 4) * 4 (1 when it fits), target = min(4 GiB,
    half the free memory) minus grad_inputs. One chunk alive at a time: its compute-dtype logits, their
    fp32 upcast and the gradient in the logits dtype (UNSLOTH_CE_BYTES_PER_LOGIT)."""
    chunk = unsloth_ce_chunk_tokens(k, static)
    grad_inputs = k.tokens * k.dims.hidden_size * k.c
    return _LossTerms(logits=chunk * k.vocab * UNSLOTH_CE_BYTES_PER_LOGIT + grad_inputs)


def _chunked_loss(k: Knobs, static: float) -> _LossTerms:
    """vramsweep.longctx.loss: per chunk the fp32 logits + logsumexp's fp32 temporary (then softmax and
    gradient in place, cast to the compute dtype); d(hidden) (T x h) kept into backward, plus the decoder
    output and its shifted copy; full fine-tuning adds the fp32 weight gradient accumulated across chunks."""
    T, V, h = k.tokens, k.vocab, k.dims.hidden_size
    chunk = min(T, k.loss_chunk)
    grad_inputs = T * h * k.c
    logits = chunk * V * 8 + 3 * grad_inputs
    if k.method == "full":
        logits += V * h * 4
    return _LossTerms(logits=logits)


def _hf_loss(k: Knobs, static: float) -> _LossTerms:
    """HF ``ForCausalLMLoss``: at log-softmax backward the saved fp32 log-softmax + two fp32 grads (+ the
    logits when the loop holds them: LOOP_KEEPS_LOGITS); the forward's peak at log-softmax is the logits
    (c) + their fp32 upcast (4, none when c == 4) + the output (4). The compute-dtype logits are freed at
    the end of the forward."""
    T, V, c = k.tokens, k.vocab, k.c
    kept_logits = T * V * c if LOOP_KEEPS_LOGITS else 0.0
    fwd_loss = (c + (4 if c != 4 else 0) + 4) * T * V
    logits = max(T * V * 12 + kept_logits, fwd_loss)
    return _LossTerms(logits=logits, kept_logits=kept_logits, freed_logits=T * V * c)


LOSS_TERMS: Mapping[str, Callable[[Knobs, float], _LossTerms]] = MappingProxyType(
    {"liger_flce": _liger_flce_loss, "unsloth": _unsloth_loss, "chunked": _chunked_loss, "hf": _hf_loss}
)


# --------------------------------------------------------------------------------------------------
# the phases of one micro-batch: forward, loss, and the backward's moments


def _forward_transient(k: Knobs, eager_mask: float, dora: float) -> float:
    """The ``forward`` phase ends with every layer's saved tensors + these, the last layer's transients
    (eager: the float causal mask unless checkpointing keeps it anyway, the scores and masked scores;
    DoRA's weight-norm pass)."""
    fwd_transient = 0.0
    if k.attention == "eager":
        if not k.checkpointing:
            fwd_transient += eager_mask
        fwd_transient += 2 * k.micro_batch * k.dims.num_heads * k.seq_len * k.seq_len * k.c
    fwd_transient += dora
    return fwd_transient


def _dora_transient(k: Knobs) -> float:
    """DoRA's weight-norm pass per target: eye(in) -> lora_weight (in x out), fp32 weight copy, W + s*BA."""
    if not (k.dora and k.method == "lora" and k.targets):
        return 0.0
    return max(
        4 * (fi * fi + fi * k.r + 3 * fi * fo)
        for n, (fi, fo) in k.dims.linear_shapes().items()
        if n in k.targets
    )


def _mlp_lora(k: Knobs) -> bool:
    """fp32 LoRA branches on the MLP of a 16-bit model: they double the gradients in flight."""
    return (
        k.method == "lora"
        and k.adapter_bytes != k.c
        and bool(k.targets & {"gate_proj", "up_proj", "down_proj"})
    )


def _grad_flow(k: Knobs) -> float:
    """Gradients in flight per token in a layer's backward: residual stream and SwiGLU branches."""
    d, c = k.dims, k.c
    if _mlp_lora(k):
        return c * (2 * d.hidden_size + 2 * d.intermediate_size)
    return c * (d.hidden_size + d.intermediate_size / 2)


def _mlp_flow(k: Knobs, grad_flow: float) -> float:
    """Gradients in flight during the MLP's backward (bytes): with a tiled MLP its intermediate-width
    gradients exist for one tile only."""
    if k.mlp_tile <= 0:
        return grad_flow * k.tokens
    inter_flow = k.c * (2 if _mlp_lora(k) else 0.5) * k.dims.intermediate_size
    return (grad_flow - inter_flow) * k.tokens + inter_flow * min(k.seq_len, k.mlp_tile) * k.micro_batch


def _largest_dequantised(k: Knobs, names: tuple[str, ...] | None = None) -> int:
    """The largest quantised projection (among ``names``) dequantised to the compute dtype (bytes)."""
    shapes = k.dims.linear_shapes().items()
    return k.c * max(
        (fi * fo for n, (fi, fo) in shapes if (names is None or n in names) and k.quantised(n)), default=0
    )


def _dequant_bytes(k: Knobs) -> float:
    """bitsandbytes backward dequantises the frozen weight (compute dtype) to get the input gradient (4-bit:
    ``dequantize_4bit``; LLM.int8: ``CB.to(dtype) * SCB / 127``). LLM.int8 on CUDA adds the forward
    temporaries of the largest projection, alive while the recomputed layer runs (bitsandbytes 0.50 CUDA
    ops): ``A.to(fp16)`` (2/in), ``A.abs() >= threshold`` (2 + 1 /in) and the int8 ``CA`` (1/in) during
    quantisation; then fp16 A + CA + the int32 product (4/out) + its dequantised output (c/out)."""
    d, c = k.dims, k.c
    dequant = 0.0
    if k.quant_bits in (4, 8):
        dequant = _largest_dequantised(k)
    if k.quant_bits == 8 and k.device == "cuda":
        dequant += k.tokens * max(
            (
                max(6 * fi, 3 * fi + (4 + c) * fo)
                for n, (fi, fo) in d.linear_shapes().items()
                if k.quantised(n)
            ),
            default=0,
        )
    return dequant


def _attention_moment(k: Knobs, lt: _LayerTerms, grad_flow: float, attn_ws: float) -> float:
    """The recomputed layer at its attention backward (bytes): the MLP's saved tensors are freed by then.

    One attention projection's weight dequantised by bitsandbytes is alive there (GPU allocator trace,
    2026-12-04: one 4096 x 4096 bf16 block from ``_dequant_linear_fallback`` at the peak). Gradients in
    flight with offloaded checkpoints: the gradient the Function's backward received (its frame holds it),
    the residual gradient summed from it and the MLP branch (a new tensor, since the first is still
    referenced) and the attention output's gradient, each T x h (GPU allocator trace at 49,152 tokens: 3
    such blocks beside the kernel's dq/dk/dv and workspace); without offload the generic gradients in
    flight (grad_flow)."""
    at_attn = (
        _layer_saved(k, in_rg=True, int8=False, upto_attention=True).total + lt.per_layer_attn + lt.prefetch
    )
    attn_dequant = 0.0
    if k.quant_bits in (4, 8):
        attn_dequant = _largest_dequantised(k, ("q_proj", "k_proj", "v_proj", "o_proj"))
    attn_flow = 3 * k.c * k.dims.hidden_size if k.offload else grad_flow
    return (attn_flow + at_attn + lt.kept_out) * k.tokens + attn_ws + attn_dequant


def _norm_moment(k: Knobs, lt: _LayerTerms) -> float:
    """The second norm's backward (HF RMSNorm, unfused; checkpointing only): the layer's tensors saved up to
    that norm, the incoming gradient and the norm backward's fp32 temporaries (CPU tracker: pow, its x2, the
    product with the gradient, the mean's division and the rsqrt product, all T x h fp32, alive together
    when the two branches of the input gradient are summed) -- the peak on CPU with a tiled MLP, offloaded
    or not."""
    if not k.checkpointing or k.fused_rms_norm:
        return 0.0
    h, T = k.dims.hidden_size, k.tokens
    upto_norm2 = _layer_saved(k, in_rg=True, int8=False, upto_norm2=True).total
    return (
        upto_norm2 + lt.per_layer_attn + lt.prefetch + lt.kept_out + k.c * h
    ) * T + HF_NORM_BACKWARD_FP32_TEMPS * 4 * h * T


@dataclass(frozen=True)
class _Backward:
    """One layer's backward (bytes) and the gradients in flight the phases reuse."""

    layer: float  # the largest of the layer's backward moments
    after_mlp: bool  # that peak comes after the layer's MLP backward (its grads exist)
    grad_flow: float  # gradients in flight per token (:func:`_grad_flow`)
    attn_ws: float  # SDPA's flash / memory-efficient backward workspace (bytes)


def _layer_backward(k: Knobs, lt: _LayerTerms) -> _Backward:
    """One layer's backward. SDPA's flash / memory-efficient backward (CUDA) needs a transient workspace
    while one layer's attention runs backward; the MLP's recompute and the dequantised weights are gone by
    then (the MLP comes first in a layer's backward), so the layer holds the largest of its moments: the
    MLP's, the attention's (:func:`_attention_moment`), the second norm's (:func:`_norm_moment`)."""
    grad_flow = _grad_flow(k)
    attn_ws = attention_backward_bytes_per_token(k) * k.tokens
    mlp_moment = (
        _mlp_flow(k, grad_flow)
        + (lt.one_layer + lt.kept_out) * k.tokens
        + _dequant_bytes(k)
        + lt.mlp_transient
    )
    layer_bwd = max(mlp_moment, _attention_moment(k, lt, grad_flow, attn_ws), _norm_moment(k, lt))
    return _Backward(layer=layer_bwd, after_mlp=layer_bwd > mlp_moment, grad_flow=grad_flow, attn_ws=attn_ws)


@dataclass(frozen=True)
class _Parts:
    """The step's calibrated parts that every phase adds up."""

    fixed: _FixedTerms
    layers: float  # the layers' stored tensors x tokens x the "layers" factor
    attention: float  # eager probabilities x tokens x the "attention" factor
    logits: float  # the loss's peak x the "logits" factor
    f_layers: float  # the "layers" factor, which also scales the per-layer transients

    @property
    def base(self) -> float:
        """Alive until the backward starts freeing: fixed + layers + attention."""
        return self.fixed.total + self.layers + self.attention


def _recompute_phase(k: Knobs, p: _Parts, loss: _LossTerms, bwd: _Backward, dora: float) -> float:
    """Backward of one recomputed layer (checkpointing): the stored inputs + its saved tensors + the
    gradients in flight (residual stream, SwiGLU branches; fp32 LoRA branches in a 16-bit model double
    them) + DoRA's weight-norm pass, which the recompute runs again; the final norm's saved tensors are
    gone by then. Measured on CPU (tests/estimate/test_estimate.py): within ~3 % when this phase is the
    peak (small vocabularies, fused cross-entropy); the loss phase is exact. Full fine-tuning with tied
    embeddings: lm_head's weight gradient waits in autograd's input buffer until the embedding's backward
    adds to it (it only becomes ``.grad`` at the very end)."""
    d = k.dims
    tied_grad = k.vocab * d.hidden_size * k.c if (k.method == "full" and d.tie_word_embeddings) else 0.0
    fx = p.fixed
    return (
        fx.total - fx.final_saved + p.layers + (bwd.layer + dora) * p.f_layers + loss.kept_logits + tied_grad
    )


def _backward_phases(
    k: Knobs, lt: _LayerTerms, p: _Parts, loss: _LossTerms, bwd: _Backward, dora: float
) -> dict:
    """The backward's phases: ``recompute`` (checkpointing, :func:`_recompute_phase`); else
    ``attn_backward`` when the attention backward needs a workspace: the first attention backward (last
    layer), every layer's saved tensors + the kernel's workspace; ``mlp_tile`` (tiled MLP, no
    checkpointing): backward of a layer's tiled MLP, every layer's saved tensors + one tile's recompute +
    gradients in flight (the intermediate-width ones for one tile only)."""
    phases: dict[str, float] = {}
    if k.checkpointing:
        phases["recompute"] = _recompute_phase(k, p, loss, bwd, dora)
    elif bwd.attn_ws > 0:
        phases["attn_backward"] = p.base + (bwd.grad_flow * k.tokens + bwd.attn_ws) * p.f_layers
    if k.mlp_tile > 0 and not k.checkpointing:
        phases["mlp_tile"] = p.base + (_mlp_flow(k, bwd.grad_flow) + lt.mlp_transient) * p.f_layers
    return phases


def activation_terms(k: Knobs, calib: dict | None = None, static: float = 0.0) -> ActivationTerms:
    """Activation bytes at the peak of one micro-batch's forward + backward (``static``: bytes of the
    params + optimizer state, which Unsloth's loss subtracts from the free memory it sizes chunks by).

    The sum of the layers' terms (:func:`_layer_terms`), the fixed ones (:func:`_fixed_terms`) and the
    loss's (:data:`LOSS_TERMS`, by :func:`_loss_kind`), scaled by the calibration factors, at each phase:
    ``loss``, ``forward``, and the backward's (:func:`_backward_phases`); the peak is the largest.
    ``working``: one layer's backward working set: with checkpointing the recomputed layer's saved tensors
    + the gradients in flight; without, one layer's saved tensors (freed layer by layer in backward).
    ``loss_transient``: the blocks the loss frees at the end of the forward and reuses only after its peak."""
    calib = calib or {}
    f_layers = float(calib.get("layers", 1.0))
    f_attn = float(calib.get("attention", 1.0))
    f_logits = float(calib.get("logits", 1.0))
    T = k.tokens
    lt, fx = _layer_terms(k), _fixed_terms(k)
    loss = LOSS_TERMS[_loss_kind(k)](k, static)
    p = _Parts(
        fixed=fx,
        layers=lt.stored * T * f_layers,
        attention=lt.attention * T * f_attn,
        logits=loss.logits * f_logits,
        f_layers=f_layers,
    )
    dora = _dora_transient(k)
    fwd_transient = _forward_transient(k, fx.eager_mask, dora)
    phases: dict[str, float] = {"loss": p.base + p.logits, "forward": p.base + fwd_transient * f_layers}
    bwd = _layer_backward(k, lt)
    phases.update(_backward_phases(k, lt, p, loss, bwd, dora))
    if k.checkpointing:
        working = bwd.layer
    else:
        working = lt.rest * T + lt.per_layer_attn * T + bwd.attn_ws
    loss_transient = 0.0
    if loss.freed_logits:
        loss_transient = loss.freed_logits + (fwd_transient if k.attention == "eager" else 0.0)
    return ActivationTerms(
        layers=p.layers,
        attention=p.attention,
        logits=p.logits,
        fixed=fx.total,
        phases=phases,
        peak_phase=max(phases, key=phases.get),
        working=working,
        loss_transient=loss_transient,
        after_mlp=bwd.after_mlp,
    )


# --------------------------------------------------------------------------------------------------
# the CUDA caching allocator: reserved >= allocated
#
# What the budget (and ``hardware.emulate_cap``'s ``set_per_process_memory_fraction``) limits is the
# caching allocator's *reserved* memory: the segments it got from ``cudaMalloc``, used or cached. PyTorch's
# allocator (c10/cuda/CUDACachingAllocator.cpp) serves requests <= 1 MiB (kSmallSize) from 2 MiB segments
# (kSmallBuffer), 1-10 MiB from 20 MiB segments (kLargeBuffer) and larger ones from their own segment
# rounded up to 2 MiB (kRoundLarge); a freed block stays in the cache and is reused by a later request
# that fits it (best fit, split), never merged across segments. So at the peak moment, reserved =
# allocated + the cached blocks that the requests around the peak cannot use. Three terms, each tied to a
# mechanism; the two fractions are fitted to the 2026-12-01 GPU run (tests/estimate/test_estimate_gpu.py)
# and are the same for every config:
#
# * ``idle_loss``: HF cross-entropy frees the compute-dtype logits (T x V x c) at the end of the forward
#   and the fp32 log-softmax backward needs a new T x V x 4 block, so the logits' block sits idle at the
#   peak (eager attention: also the last layer's score buffers). Fused losses keep no such block.
# * ``layer_cycle``: the backward walks the layers with one layer's working set (recomputed saved
#   tensors, gradients in flight, dequantised weights), each shape a different size; the segments it
#   leaves cannot hold the loss's T x V requests, so at an HF-loss peak (a later step) the whole set is
#   idle; at a peak inside the backward (fused losses) about a third of it is (LAYER_CYCLE_IDLE).
# * ``small_pool``: parameters, gradients and optimizer state under 1 MiB (LoRA A/B: r x in, out x r in
#   fp32) live in 2 MiB small-pool segments filled in allocation order, interleaved with transient small
#   tensors: about half a segment's worth of holes per segment's worth of live bytes (SMALL_POOL_SLACK).

ALLOC_SMALL_SIZE = 1024**2  # kSmallSize: requests up to 1 MiB come from the small pool
LAYER_CYCLE_IDLE = 0.3  # fitted: idle share of one layer's working set at a peak inside the backward
SMALL_POOL_SLACK = 0.5  # fitted: small-pool holes per live small-pool byte


def allocator_reserve(k: Knobs, acts: ActivationTerms, phase: str, trainable: list[TensorSpec]) -> dict:
    """Bytes the caching allocator holds beyond the live tensors at the peak (see the note above)."""
    hf_loss_peak = phase == "loss" and acts.loss_transient > 0
    small = [t for t in trainable if t.numel * t.elem_bytes < ALLOC_SMALL_SIZE]
    small_live = sum(t.nbytes for t in small) * 2 + optimizer_state_bytes(k, small)  # weight + grad + state
    return {
        "idle_loss": acts.loss_transient if hf_loss_peak else 0.0,
        "layer_cycle": acts.working * (1.0 if hf_loss_peak else LAYER_CYCLE_IDLE),
        "small_pool": SMALL_POOL_SLACK * small_live,
    }


# --------------------------------------------------------------------------------------------------
# the whole step


@dataclass
class Estimate:
    peak: int
    required: int  # what must fit under a hard cap: allocated + the reserve the allocator cannot release
    at_peak: dict[str, int]  # breakdown at the peak moment (sums to peak)
    components: dict[str, int]  # steady sizes: params, grads, optimizer, activation/logit peaks
    phases: dict[str, int]
    peak_phase: str
    features: dict[str, float]  # calibration features (bytes at scale 1)
    host: dict[str, int] = field(default_factory=dict)  # host-memory terms (offloaded layer inputs)
    extrapolated: list[str] = field(default_factory=list)  # terms used beyond what a GPU run measured


def host_bytes(k: Knobs) -> dict[str, int]:
    """Host memory the step needs beside the device: the offloaded layer inputs of one pass.

    ``checkpointing=offload`` (CUDA): one exact-size pool, page-locked (``vramsweep.longctx.offload``):
    layers x tokens x hidden x c. Unsloth's offloaded checkpointing keeps the same inputs in host memory
    (its own buffers). On a CPU device the "host" copies are in the memory the peak already counts."""
    d = k.dims
    inputs = d.num_layers * k.tokens * d.hidden_size * k.c
    if k.device == "cuda" and k.checkpointing and k.offload:
        return {"pinned_layer_inputs": int(inputs)}
    if k.device == "cuda" and k.checkpointing and k.unsloth:
        return {"unsloth_offloaded_layer_inputs": int(inputs)}
    return {}


#: The longest sequence of a trial that ran on a GPU and was compared with the estimate (2026-12-01, H200
#: capped at 15 GiB: Qwen3-8B nf4_dq + Liger + checkpointing at 12,288 tokens;
#: tests/estimate/test_estimate_gpu.py).
GPU_MEASURED_MAX_TOKENS = 12_288


def extrapolated_terms(k: Knobs, acts: ActivationTerms | None = None) -> list[str]:
    """The terms of a CUDA estimate that no GPU measurement has checked yet (empty on CPU, where every
    term is compared with the tensor tracker in tests/estimate/test_estimate.py)."""
    if k.device != "cuda":
        return []
    out: list[str] = []
    if k.tokens > GPU_MEASURED_MAX_TOKENS:
        out.append(
            f"every per-token term and the allocator reserve (LAYER_CYCLE_IDLE, SMALL_POOL_SLACK fitted at "
            f"<= {GPU_MEASURED_MAX_TOKENS:,} tokens): {k.tokens:,} tokens"
        )
    if attention_backward_bytes_per_token(k) > 0:
        out.append("attention backward workspace (FlashAttention-2 mha_bwd allocations, from its source)")
        if k.attn_groups > 1:
            out.append(f"tiling.attention_heads={k.attn_groups}: the workspace of one head group + the split")
    if k.offload:
        out.append("checkpointing=offload: the prefetched input on the device and the pinned host pool")
    if k.mlp_tile > 0:
        out.append("tiling.mlp_tile_tokens: one tile's recompute")
    if k.loss_chunk > 0:
        out.append("tiling.loss_chunk_tokens: the chunked loss")
    if k.adapter_bytes != 4:
        out.append("adapter.dtype=compute (16-bit adapters, fp32 masters in the optimizer)")
    if k.opt.paged:
        out.append("paged optimizer state (bitsandbytes unified memory, outside the caching allocator)")
    if k.vocab < k.dims.vocab_size:
        out.append(f"vocabulary slice ({k.vocab:,} of {k.dims.vocab_size:,} rows)")
    return out


def _grads_alive(k: Knobs, phase: str, grads: int, mlp_grads: int, after_mlp: bool) -> int:
    """The gradient bytes alive at an activation phase's peak."""
    if k.grad_accum > 1:
        return grads  # accumulated grads of the earlier micro-batches
    if phase == "recompute":  # backward reached the first layers: the later layers' grads exist
        # (+ the recomputed layer's MLP adapter grads when the peak comes after its MLP backward)
        L = k.dims.num_layers
        return grads * (L - 1) // L + (mlp_grads // L if after_mlp else 0)
    return 0  # zero_grad(set_to_none=True): no grads before backward


def _at_peak(
    k: Knobs, acts: ActivationTerms, trainable: list, params: int, opt: int, workspace: int
) -> tuple[dict[str, float], str]:
    """What is alive at the step's peak, by kind, and the phase it falls in: the largest activation phase
    (with the gradients alive then) or the optimizer step (activations freed, its workspace allocated)."""
    grads = sum(t.nbytes for t in trainable)
    mlp_names = ("gate_proj", "up_proj", "down_proj")
    mlp_grads = sum(t.nbytes for t in trainable if any(f".{n}." in t.name for n in mlp_names))
    alive = {p: _grads_alive(k, p, grads, mlp_grads, acts.after_mlp) for p in acts.phases}
    totals = {p: v + alive[p] for p, v in acts.phases.items()}
    act_phase = max(totals, key=totals.get)
    if params + opt + totals[act_phase] >= params + opt + grads + workspace:
        logits_at_peak = acts.logits if act_phase == "loss" else 0.0
        return {
            "params": params,
            "grads": alive[act_phase],
            "optimizer": opt,
            "activations": int(round(acts.phases[act_phase] - logits_at_peak)),
            "logits": int(round(logits_at_peak)),
        }, act_phase
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt + workspace,
        "activations": 0,
        "logits": 0,
    }, "optimizer_step"


def estimate_knobs(k: Knobs, calib: dict | None = None) -> Estimate:
    tensors = model_tensors(k)
    params = sum(t.nbytes for t in tensors)
    trainable = [t for t in tensors if t.trainable]
    grads = sum(t.nbytes for t in trainable)
    opt = optimizer_state_bytes(k, trainable)
    workspace = optimizer_step_workspace(k, trainable)
    acts = activation_terms(k, calib, static=params + opt)
    at_peak, peak_phase = _at_peak(k, acts, trainable, params, opt, workspace)
    allocated_peak = sum(at_peak.values())
    reserve = allocator_reserve(k, acts, peak_phase, trainable) if k.allocator else {}
    at_peak["overhead"] = int(round(sum(reserve.values())))
    peak = sum(at_peak.values())
    no_calib = activation_terms(k, None, static=params + opt) if calib else acts
    # Under a cap (a full card, or set_per_process_memory_fraction) a failed cudaMalloc makes the allocator
    # release its cached free segments and retry before it raises OOM; the idle loss blocks and the
    # layer-cycle segments are such free segments, the small-pool holes sit in segments with live blocks.
    required = allocated_peak + int(round(reserve.get("small_pool", 0.0)))
    return Estimate(
        peak=int(peak),
        required=int(required),
        at_peak={kk: int(v) for kk, v in at_peak.items()},
        components={
            "params": params,
            "grads": grads,
            "optimizer": opt,
            "optimizer_workspace": workspace,
            "optimizer_paged": paged_state_bytes(k, trainable),
            "activations_peak": int(round(max(acts.phases.values()))),
            "logits": int(round(acts.logits)),
            "trainable_params": sum(t.numel * t.count for t in trainable),
            "allocated_peak": int(allocated_peak),
            **{f"reserve_{n}": int(round(v)) for n, v in reserve.items()},
            "cuda_context": k.overhead,
            "model_params": logical_param_count(k),
        },
        phases={kk: int(round(v)) for kk, v in acts.phases.items()},
        peak_phase=peak_phase,
        features={
            "layers": no_calib.layers,
            "attention": no_calib.attention,
            "logits": no_calib.logits,
            "fixed": no_calib.fixed,
        },
        host=host_bytes(k),
        extrapolated=extrapolated_terms(k, acts),
    )
