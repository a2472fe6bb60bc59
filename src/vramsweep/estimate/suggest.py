"""``vramsweep estimate ... --suggest``: the cheapest sets of knob changes that make a config fit its budget.

Torch-free and weight-free: one ``compose`` of the user's config, the other options of each knob are read from
the packaged option files (``conf/<group>/<option>.yaml`` over the group's schema) and swapped into a copy of
the composed config, and every candidate is re-estimated with :func:`vramsweep.estimate.estimate` (the public
entry; no formula is duplicated here). Candidates are visited in the order of their predicted speed cost
(:data:`COSTS`, a relative step-time model); a candidate is skipped without an estimate when it is a superset
of a set that already fits (dearer, no better) or saves no more memory on any knob than a set that already did
not fit (the estimator's terms only shrink along each knob's chain, :data:`CHAINS`).

For a config that fits: its headroom and what the spare memory could buy (the largest ``train.micro_batch``,
``adapter.r`` and ``context.max_tokens`` that still fit, one knob at a time).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from vramsweep.config import ConfigError
from vramsweep.config.paths import _PACKAGED
from vramsweep.config.rope import plan as rope_plan
from vramsweep.config.rules import validate
from vramsweep.config.schema import _SCHEMAS
from vramsweep.estimate import estimate, model_dims
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.status import Status
from vramsweep.record.units import GIB

#: A knob's options from "saves least" to "saves most" (only moves up the chain are suggested). ``tiling`` is
#: two flags (loss, mlp); ``quant`` lists the 16-bit -> 4-bit steps the estimator knows.
CHAINS: dict[str, tuple[str, ...]] = {
    "checkpointing": ("off", "on", "offload"),
    "kernels": ("none", "liger"),
    "quant": ("none", "int8", "nf4", "nf4_dq"),
    "optimizer": ("adamw", "adamw_8bit"),
    "adapter_dtype": ("fp32", "compute"),
    "attention": ("eager", "sdpa"),
    "vocab": ("full", "sliced"),
}
TILING = {"off": (0, 0), "loss": (1, 0), "mlp": (0, 1), "on": (1, 1)}


@dataclass(frozen=True)
class Cost:
    """A relative step-time factor with where it comes from."""

    factor: float
    source: str


#: Relative step time of one change against the same config without it (assumed, unless calibrated).
COSTS: dict[str, Cost] = {
    "checkpointing=on": Cost(
        4 / 3,
        "recompute = one more forward: (F + 2F + F) / (F + 2F), Chen et al. 2016; Korthikanti et al. 2022 §4",
    ),
    "checkpointing=offload": Cost(
        4 / 3, "as checkpointing=on, plus 2 x layers x tokens x hidden x dtype bytes over PCIe (below)"
    ),
    "tiling=loss": Cost(
        1.02, "chunked loss: one more pass over the lm_head per chunk boundary, ~2 % (assumed)"
    ),
    "tiling=mlp": Cost(
        1.05, "tiled MLP: smaller GEMMs, ~5 % (assumed; Arctic Long Sequence Training reports small)"
    ),
    "kernels=liger": Cost(0.83, "Liger Kernel paper (Hsu et al. 2024): ~20 % more throughput -> x0.83"),
    "quant=int8": Cost(
        1.6, "LLM.int8 mixed-precision matmuls, x1.6 (assumed; Dettmers et al. 2022 report slower)"
    ),
    "quant=nf4": Cost(1.3, "4-bit dequantisation per matmul, x1.3 (assumed; QLoRA trains slower than LoRA)"),
    "quant=nf4_dq": Cost(1.32, "as nf4 + the second dequantisation of the absmax, x1.32 (assumed)"),
    "optimizer=adamw_8bit": Cost(
        1.01, "8-bit state dequantise/requantise per step: ~1 % (Dettmers et al. 2021)"
    ),
    "adapter.dtype=compute": Cost(1.0, "no fp32 copy of the adapted inputs: no slower (assumed)"),
    "attention=sdpa": Cost(0.9, "fused SDPA instead of eager attention: ~10 % faster (assumed)"),
    "vocab=sliced": Cost(0.98, "smaller embedding/logits: slightly faster (assumed)"),
    "train.micro_batch/2": Cost(
        1.05,
        "half the micro-batch, twice the accumulation (same tokens per step): ~5 % per halving (assumed)",
    ),
}

#: Host-to-device bandwidth assumed when the hardware profile gives none: PCIe 4.0 x16, 31.5 GB/s per
#: direction.
DEFAULT_PCIE = 31.5e9
#: Fraction of the card's peak FLOP/s a training step reaches (to turn FLOPs into seconds for the PCIe term).
ASSUMED_MFU = 0.4
#: Default number of suggestions and the estimate budget of the search.
TOP = 5
MAX_ESTIMATES = 120


@dataclass
class Candidate:
    """One set of changes (a value per knob) and what it predicts."""

    choice: dict[str, Any]
    overrides: list[str]
    cost: float
    est: dict[str, Any] | None = None
    max_tokens: int | None = None
    notes: list[str] = field(default_factory=list)


def _option_node(group: str, option: str) -> DictConfig:
    """``conf/<group>/<option>.yaml`` over the group's schema (what Hydra composes for ``group=option``)."""

    raw = yaml.safe_load((Path(_PACKAGED) / group / f"{option}.yaml").read_text()) or {}
    raw.pop("defaults", None)
    node = OmegaConf.merge(OmegaConf.structured(_SCHEMAS[group]), raw)
    assert isinstance(node, DictConfig)
    return node


def _module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _base_choice(cfg: DictConfig) -> dict[str, Any]:
    tiling = (int(int(cfg.tiling.loss_chunk_tokens) > 0), int(int(cfg.tiling.mlp_tile_tokens) > 0))
    return {
        "checkpointing": str(cfg.checkpointing.name),
        "tiling": tiling,
        "kernels": "liger" if cfg.kernels.liger else ("unsloth" if cfg.kernels.unsloth else "none"),
        "quant": str(cfg.quant.name),
        "optimizer": str(cfg.optimizer.name),
        "adapter_dtype": str(cfg.adapter.get("dtype", "fp32")),
        "attention": str(cfg.attention.name),
        "vocab": str(cfg.vocab.name),
        "micro_batch": int(cfg.train.micro_batch),
    }


def search_space(cfg: DictConfig, *, any_install: bool = False) -> tuple[dict[str, list[Any]], list[str]]:
    """Per knob the values a suggestion may take (the user's first), and the options left out with why.

    The target card's rules (Liger needs a CUDA profile) and this machine's packages (liger-kernel,
    bitsandbytes; ``any_install`` searches options whose package is missing here too, for a card elsewhere)
    decide what is searched; rule-level combinations are checked per candidate.
    """
    have = (lambda name: True) if any_install else _module
    base = _base_choice(cfg)
    cuda = cfg.hardware.device == "cuda"
    left: list[str] = []
    space: dict[str, list[Any]] = {}
    for knob, chain in CHAINS.items():
        cur = base[knob]
        if cur not in chain:  # an option outside the chain (unsloth, fp4, adafactor, paged...): kept as is
            space[knob] = [cur]
            continue
        vals = list(chain[chain.index(cur) :])
        if knob == "kernels" and "liger" in vals:
            if not cuda:
                vals.remove("liger")
                left.append(f"kernels=liger (needs a CUDA hardware profile, hardware={cfg.hardware.name})")
            elif not have("liger_kernel"):
                vals.remove("liger")
                left.append("kernels=liger (liger-kernel is not installed here: pip install -e '.[gpu]')")
        if knob == "quant" and len(vals) > 1 and not have("bitsandbytes"):
            left += [f"quant={v} (needs bitsandbytes, not installed here)" for v in vals[1:]]
            vals = vals[:1]
        if knob == "quant" and cfg.adapter.method == "full":
            vals = vals[:1]  # quantised weights are frozen: full fine-tuning stays 16-bit
        if knob == "optimizer" and len(vals) > 1 and not have("bitsandbytes"):
            left.append("optimizer=adamw_8bit (needs bitsandbytes, not installed here)")
            vals = vals[:1]
        if knob == "adapter_dtype" and cfg.adapter.method == "full":
            vals = vals[:1]
        if knob == "vocab" and str(cfg.model.source) == "arch":
            vals = vals[
                :1
            ]  # slicing needs a tokenizer and corpus (rules: not for an architecture-only model)
        space[knob] = vals
    if base["kernels"] == "unsloth":
        space["tiling"] = [base["tiling"]]
    else:
        space["tiling"] = [
            t for t in TILING.values() if t[0] >= base["tiling"][0] and t[1] >= base["tiling"][1]
        ]
    mb = base["micro_batch"]
    space["micro_batch"] = [mb >> k for k in range(0, 8) if mb >> k >= 1]
    return space, left


def _tiling_name(t: tuple[int, int]) -> str:
    return next(k for k, v in TILING.items() if v == t)


def overrides_for(base: dict[str, Any], choice: dict[str, Any], cfg: DictConfig) -> list[str]:
    """The overrides to paste for ``choice`` (only what differs from the user's config)."""
    out = []
    for knob in ("checkpointing", "tiling", "kernels", "quant", "optimizer", "attention", "vocab"):
        if choice[knob] != base[knob]:
            val = _tiling_name(choice[knob]) if knob == "tiling" else choice[knob]
            out.append(f"{knob}={val}")
    if choice["adapter_dtype"] != base["adapter_dtype"]:
        out.append(f"adapter.dtype={choice['adapter_dtype']}")
    if choice["micro_batch"] != base["micro_batch"]:
        ga = int(cfg.train.grad_accum) * base["micro_batch"] // choice["micro_batch"]
        out += [f"train.micro_batch={choice['micro_batch']}", f"train.grad_accum={ga}"]
    return out


class Workspace:
    """A plain (unstructured) copy of the user's config that candidates are swapped into and out of in place:
    assigning a group's node costs well under a millisecond, copying the whole config tens of milliseconds."""

    GROUPS = ("checkpointing", "kernels", "quant", "optimizer", "attention", "vocab", "tiling")

    def __init__(self, cfg: DictConfig, base: dict[str, Any]) -> None:
        self.cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        self.base = base
        self.saved = {g: OmegaConf.to_container(self.cfg[g]) for g in self.GROUPS}
        self.saved_train = (int(cfg.train.micro_batch), int(cfg.train.grad_accum))
        self.saved_dtype = self.cfg.adapter.get("dtype")
        self._nodes: dict[tuple[str, str], Any] = {}

    def node(self, group: str, option: str) -> Any:
        key = (group, option)
        if key not in self._nodes:
            self._nodes[key] = OmegaConf.to_container(_option_node(group, option))
        return self._nodes[key]

    def apply(self, choice: dict[str, Any]) -> DictConfig:
        """Put ``choice`` into the workspace (undo with :meth:`reset`) and return the config."""
        base, c = self.base, self.cfg
        for knob in self.GROUPS:
            if choice[knob] != base[knob]:
                opt = _tiling_name(choice[knob]) if knob == "tiling" else choice[knob]
                c[knob] = self.node(knob, opt)
        if choice["adapter_dtype"] != base["adapter_dtype"]:
            c.adapter.dtype = choice["adapter_dtype"]
        if choice["micro_batch"] != base["micro_batch"]:
            mb, ga = self.saved_train
            c.train.grad_accum = ga * mb // choice["micro_batch"]
            c.train.micro_batch = choice["micro_batch"]
        return c

    def reset(self) -> None:
        c = self.cfg
        for g, v in self.saved.items():
            c[g] = v
        c.train.micro_batch, c.train.grad_accum = self.saved_train
        if self.saved_dtype is not None:
            c.adapter.dtype = self.saved_dtype


def apply_choice(cfg: DictConfig, base: dict[str, Any], choice: dict[str, Any]) -> DictConfig:
    """A separate config with ``choice`` applied (what composing the suggestion's overrides gives)."""
    ws = Workspace(cfg, base)
    return ws.apply(choice)


def offload_seconds(cfg: DictConfig, seq_tokens: int) -> tuple[float, float, str]:
    """Extra step-time factor of ``checkpointing=offload`` from its PCIe traffic, and the figures behind it.

    Traffic per micro-batch: each layer's input (tokens x hidden x dtype bytes) to host in the forward and
    back in the backward. Compute time: 4 x params x tokens FLOPs (6 with adapter=full: weight gradients too)
    at :data:`ASSUMED_MFU` of the card's peak. The copy runs on a side stream: the factor counts only the
    part not hidden behind the compute.
    """

    d = model_dims(cfg)
    c = 4 if str(cfg.train.dtype) == "fp32" else 2
    tokens = seq_tokens * int(cfg.train.micro_batch)
    traffic = 2.0 * d.num_layers * tokens * d.hidden_size * c
    pcie = float(cfg.hardware.get("pcie_bytes_per_s", 0.0) or 0.0)
    src = "hardware.pcie_bytes_per_s" if pcie > 0 else "assumed PCIe 4.0 x16"
    pcie = pcie if pcie > 0 else DEFAULT_PCIE
    shapes = d.linear_shapes()
    n_params = d.num_layers * sum(i * o for i, o in shapes.values()) + d.vocab_size * d.hidden_size
    per = (
        6.0 if cfg.adapter.method == "full" else 4.0
    )  # frozen base: no weight gradients, input gradients only
    flops = per * n_params * tokens
    peak = float(cfg.hardware.peak_bf16_flops or 0.0) or 1e14
    compute = flops / (peak * ASSUMED_MFU)
    transfer = traffic / pcie
    extra = max(0.0, transfer - compute) / compute if compute else 0.0
    note = (
        f"offload: {traffic / GIB:.2f} GiB over PCIe per micro-batch at {pcie / 1e9:.1f} GB/s ({src}) = "
        f"{transfer * 1e3:.0f} ms vs ~{compute * 1e3:.0f} ms of compute ({per:.0f} x params x tokens at "
        f"{ASSUMED_MFU:.0%} of {peak / 1e12:.1f} TFLOP/s): +{100 * extra:.0f} % not hidden by the side stream"
    )
    return 1.0 + extra, transfer, note


def change_keys(base: dict[str, Any], choice: dict[str, Any]) -> list[str]:
    """The :data:`COSTS` keys a choice applies, each once per step (micro-batch halvings repeat)."""
    keys: list[str] = []
    b, c = base["checkpointing"], choice["checkpointing"]
    if c != b:
        keys.append("checkpointing=offload" if c == "offload" and b == "off" else f"checkpointing={c}")
        if c == "offload" and b == "on":
            keys[-1] = "checkpointing=offload-after-on"
    bt, ct = base["tiling"], choice["tiling"]
    if ct[0] > bt[0]:
        keys.append("tiling=loss")
    if ct[1] > bt[1]:
        keys.append("tiling=mlp")
    for knob in ("kernels", "quant", "optimizer", "attention", "vocab"):
        if choice[knob] != base[knob]:
            keys.append(f"{knob}={choice[knob]}")
    if choice["adapter_dtype"] != base["adapter_dtype"]:
        keys.append("adapter.dtype=compute")
    halvings = int(round(math.log2(base["micro_batch"] / choice["micro_batch"])))
    keys += ["train.micro_batch/2"] * halvings
    return keys


class CostModel:
    """Relative step time of a change set: the product of its changes' factors (:data:`COSTS`), the quant step
    taken from the user's quant, offload's PCIe term from the hardware profile; factors fitted from a sweep
    (:func:`fit_costs`) replace the assumed ones and are marked calibrated."""

    def __init__(self, cfg: DictConfig, seq_tokens: int, fitted: dict[str, float] | None = None) -> None:
        self.fitted = dict(fitted or {})
        self.offload_factor, _, self.offload_note = offload_seconds(cfg, seq_tokens)
        self.base_quant = COSTS.get(f"quant={cfg.quant.name}", Cost(1.0, "")).factor

    def factor(self, key: str) -> float:
        if key in self.fitted:
            return self.fitted[key]
        if key == "checkpointing=offload":
            return COSTS["checkpointing=offload"].factor * self.offload_factor
        if key == "checkpointing=offload-after-on":
            return self.offload_factor
        if key.startswith("quant="):
            return COSTS[key].factor / self.base_quant
        return COSTS[key].factor

    def cost(self, keys: list[str]) -> float:
        return math.prod(self.factor(k) for k in keys)

    def lines(self, used: set[str]) -> list[str]:
        """One line per factor used: value, calibrated or assumed, source."""
        out = []
        for key in sorted(used):
            if key in self.fitted:
                out.append(f"{key}: x{self.fitted[key]:.2f} calibrated from the sweep's measured tokens/s")
                continue
            base = "checkpointing=offload" if key.startswith("checkpointing=offload") else key
            extra = f"; {self.offload_note}" if base == "checkpointing=offload" else ""
            out.append(f"{key}: x{self.factor(key):.2f} assumed -- {COSTS[base].source}{extra}")
        return out


def _features(cfg: dict[str, Any]) -> dict[str, float]:
    """Indicator features of a trial config (plain dict) for the speed fit, named as :data:`COSTS` keys."""
    ck = cfg.get("checkpointing", {}).get("name", "off")
    tl = cfg.get("tiling", {})
    kn = cfg.get("kernels", {})
    q = cfg.get("quant", {}).get("name", "none")
    opt = str(cfg.get("optimizer", {}).get("name", "adamw"))
    f = {
        "checkpointing=on": float(ck in ("on", "offload")),
        "checkpointing=offload-after-on": float(ck == "offload"),
        "tiling=loss": float(int(tl.get("loss_chunk_tokens", 0) or 0) > 0),
        "tiling=mlp": float(int(tl.get("mlp_tile_tokens", 0) or 0) > 0),
        "kernels=liger": float(bool(kn.get("liger"))),
        "quant=nf4": float(q in ("nf4", "nf4_dq", "fp4", "fp4_dq")),
        "quant=int8": float(q == "int8"),
        "optimizer=adamw_8bit": float("8bit" in opt),
        "adapter.dtype=compute": float(cfg.get("adapter", {}).get("dtype") == "compute"),
        "attention=sdpa": float(cfg.get("attention", {}).get("name") != "eager"),
        "vocab=sliced": float(cfg.get("vocab", {}).get("name") == "sliced"),
        "train.micro_batch/2": -math.log2(max(1, int(cfg.get("train", {}).get("micro_batch", 1)))),
    }
    return f


def fit_costs(results: list[dict]) -> tuple[dict[str, float], int]:
    """Step-time factors from a sweep's ok trials: least squares of log(1 / tokens_per_s) on the knob features
    (one coefficient per feature that varies across at least two trials each way). Returns the factors and the
    number of trials used."""
    import numpy as np

    rows, ys = [], []
    for r in results:
        tps = (r.get("metrics") or {}).get(M.TOKENS_PER_S)
        if r.get("status") != Status.OK or not tps or not r.get("config"):
            continue
        rows.append(_features(r["config"]))
        ys.append(-math.log(float(tps)))
    if len(rows) < 3:
        return {}, len(rows)
    keys = [k for k in rows[0] if len({row[k] for row in rows}) > 1]
    keys = [k for k in keys if min(sum(row[k] != v for row in rows) for v in {row[k] for row in rows}) >= 2]
    if not keys:
        return {}, len(rows)
    x = np.array([[1.0] + [row[k] for k in keys] for row in rows])
    coef, *_ = np.linalg.lstsq(x, np.array(ys), rcond=None)
    fitted = {k: float(math.exp(c)) for k, c in zip(keys, coef[1:])}
    if "quant=nf4" in fitted:
        fitted["quant=nf4_dq"] = fitted["quant=nf4"]
    if "optimizer=adamw_8bit" in fitted:
        fitted["optimizer=adamw_8bit"] = fitted["optimizer=adamw_8bit"]
    return fitted, len(rows)


def _rank(choice: dict[str, Any], space: dict[str, list[Any]]) -> tuple[int, ...]:
    """Position of each knob along its saving chain (tiling: two flags; micro_batch: halvings)."""
    out = [space[k].index(choice[k]) for k in CHAINS]
    out += list(choice["tiling"])
    out.append(space["micro_batch"].index(choice["micro_batch"]))
    return tuple(out)


def probes(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The all-out set (every knob at its most saving value), then the same with one knob lowered to each of
    its other values (liger's fused loss and a chunked loss are one owner of the loss: liger drops loss
    tiling)."""
    top = {k: v[-1] for k, v in space.items()}

    def fix(c: dict[str, Any]) -> dict[str, Any]:
        if _fast_invalid(c):
            c = dict(c, tiling=(0, c["tiling"][1]))
        return c

    out = [fix(dict(top))]
    for k, vals in space.items():
        for v in vals[:-1]:
            out.append(fix(dict(top, **{k: v})))
    if "liger" in space.get("kernels", []):
        out.insert(1, dict(top, kernels=space["kernels"][0]))
    return out


def _le(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(x <= y for x, y in zip(a, b))


def _valid(cfg: DictConfig) -> str | None:

    try:
        validate(cfg, machine=False)
    except ConfigError as exc:
        return str(exc)
    return None


def _fast_invalid(c: dict[str, Any]) -> bool:
    """The combination rules checked without building the config (validate still runs on what is
    estimated)."""
    return c["kernels"] == "liger" and c["tiling"][0] == 1


def max_tokens(cfg: DictConfig, calibration: Any, *, step: int = 256, hi: int | None = None) -> int:
    """Longest ``context.max_tokens`` (to ``step`` tokens) whose estimate fits: bisection on the estimator."""

    hi = hi or int(rope_plan(cfg)["positions"] or 0) or (1 << 20)

    def fits(t: int) -> bool:
        return bool(estimate(cfg, seq_len=t, calibration=calibration)["fits"])

    if fits(hi):
        return hi
    lo, up = 0, hi // step + 1  # fits(lo*step) assumed for 0
    while up - lo > 1:
        mid = (lo + up) // 2
        if fits(mid * step):
            lo = mid
        else:
            up = mid
    return lo * step


#: What each override changes, by the prefix it starts with (the first that matches): the breakdown component
#: it attacks (its size fills the ``{}`` of the words) or None, and the words.
REASON_WORDS: tuple[tuple[str, str | None, str], ...] = (
    ("checkpointing=offload", "activations", "{}: offload the layer inputs to host"),
    ("checkpointing=on", "activations", "{}: keep only layer inputs, recompute the rest"),
    ("tiling=loss", "logits", "{}: compute the loss in chunks"),
    ("tiling=mlp", None, "the recomputed layer's MLP dominates the backward: tile it"),
    ("tiling=on", "logits", "{} and the MLP working set: tile both"),
    ("kernels=liger", "logits", "{}: fused linear cross-entropy never holds the logits"),
    ("quant=", "params", "{}: fewer bits per frozen weight"),
    ("optimizer=", "optimizer", "{}: 8-bit optimizer state"),
    ("adapter.dtype", None, "adapters in the compute dtype: no fp32 copy of each adapted input"),
    ("attention=", None, "no materialised attention scores"),
    ("vocab=", None, "only the corpus' tokens in the embeddings and logits"),
    ("train.micro_batch", None, "fewer tokens per micro-batch, the same per optimizer step"),
)


def _override_words(ov: str, part: Callable[[str], str]) -> str | None:
    """The :data:`REASON_WORDS` of the first prefix ``ov`` starts with, the component's size from ``part``
    filled in; None for an override none of them names."""
    for prefix, component, words in REASON_WORDS:
        if ov.startswith(prefix):
            return words.format(part(component)) if component else words
    return None


def reason(base_est: dict[str, Any], cand: Candidate, cfg: DictConfig) -> str:
    """Why this set: the component of the user's peak each change attacks, in words with its size."""
    bd = base_est["breakdown_bytes"]
    peak = base_est[M.PEAK_MEMORY_BYTES] or 1
    top = max(bd, key=lambda k: bd[k])

    def part(k: str) -> str:
        return f"{k} {bd.get(k, 0) / GIB:.1f} GiB ({100 * bd.get(k, 0) / peak:.0f} %)"

    words = [w for ov in cand.overrides if (w := _override_words(ov, part)) is not None]
    saved = (base_est["required_bytes"] - (cand.est or base_est)["required_bytes"]) / GIB
    lead = f"{top} dominate" if top != "overhead" else "the allocator reserve dominates"
    return f"{lead}; " + "; ".join(words) + f" (-{saved:.1f} GiB)"


def suggest(
    cfg: DictConfig,
    *,
    top: int = TOP,
    with_max_context: bool = False,
    calibration: Any = None,
    speed: dict[str, float] | None = None,
    max_estimates: int = MAX_ESTIMATES,
    any_install: bool = False,
) -> dict[str, Any]:
    """The cheapest change sets that fit ``hardware.budget_gib`` (or, if the config fits, what its spare
    buys).

    Returns ``{"fits", "budget_bytes", "estimate" (the user's), "suggestions": [{"overrides", "peak_bytes",
    "required_bytes", "headroom_bytes", "speed_factor", "reason", "max_tokens"?}], "speed_model" (one line per
    factor used, calibrated or assumed), "left_out", "searched", "estimates", "seconds"}``; with a config that
    fits, ``"spare"`` instead of suggestions (largest micro-batch, adapter rank, context that still fit).
    Raises ``ValueError`` without a budget.
    """

    t0 = time.perf_counter()
    base_est = estimate(cfg, calibration=calibration)
    budget = base_est["budget_bytes"]
    if budget is None:
        raise ValueError("hardware.budget_gib=0 means no budget: choose a hardware profile with a budget")
    base = _base_choice(cfg)
    space, left = search_space(cfg, any_install=any_install)
    model = CostModel(cfg, int(base_est["seq_len"]), speed)
    out: dict[str, Any] = {
        "fits": bool(base_est["fits"]),
        "budget_bytes": budget,
        "required_bytes": base_est["required_bytes"],
        "peak_bytes": base_est[M.PEAK_MEMORY_BYTES],
        "headroom_bytes": budget - base_est["required_bytes"],
        "breakdown_bytes": base_est["breakdown_bytes"],
        "left_out": left,
        "calibrated_memory": bool(base_est.get("calibration")),
    }
    n_est = 1
    if base_est["fits"]:
        out["spare"] = spare(Workspace(cfg, base).cfg, calibration)
        out["speed_model"] = []
        out["estimates"], out["seconds"] = n_est, round(time.perf_counter() - t0, 3)
        return out
    ws = Workspace(cfg, base)
    cands = _candidates(space, base, model)
    nofit, n_probes = _probe(space, ws, calibration)
    found, used, rejected, n_est = _search(
        cands,
        space,
        ws,
        base,
        cfg,
        calibration,
        nofit,
        n_est + n_probes,
        top=top,
        max_estimates=max_estimates,
        with_max_context=with_max_context,
    )
    out["suggestions"] = _suggestion_rows(found, base_est, cfg, with_max_context)
    out["speed_model"] = model.lines(used)
    out["searched"] = len(cands)
    out["rejected_by_rules"] = rejected
    out["estimates"], out["seconds"] = n_est, round(time.perf_counter() - t0, 3)
    out["complete"] = n_est < max_estimates
    return out


def _candidates(space: dict[str, list], base: dict[str, Any], model: CostModel) -> list[tuple]:
    """Every change set of the search space other than the user's own (less those invalid at a glance), as
    ``(cost, number of changed keys, choice, changed keys)``, cheapest first (fewer changes on a tie)."""
    knobs = list(space)
    cands = []
    for vals in itertools.product(*(space[k] for k in knobs)):
        choice = dict(zip(knobs, vals))
        if choice == base or _fast_invalid(choice):
            continue
        keys = change_keys(base, choice)
        cands.append((model.cost(keys), len(keys), choice, keys))
    cands.sort(key=lambda x: (x[0], x[1]))
    return cands


def _probe(space: dict[str, list], ws: Workspace, calibration: Any) -> tuple[list[tuple[int, ...]], int]:
    """Estimate the probes (:func:`probes`: the most saving set with one knob held at each of its values);
    returns the ranks of those that do not fit (every set below one does not fit either) and the number of
    estimates made. The all-out set comes first: if it does not fit, nothing does and probing stops."""
    nofit: list[tuple[int, ...]] = []
    n_est = 0
    for i, choice in enumerate(probes(space)):
        r = _rank(choice, space)
        if any(_le(r, n) for n in nofit):
            continue
        try:
            est = estimate(ws.apply(choice), calibration=calibration)
        finally:
            ws.reset()
        n_est += 1
        if not est["fits"]:
            nofit.append(r)
            if i == 0:
                break  # the all-out set does not fit: no set does
    return nofit, n_est


def _search(
    cands: list[tuple],
    space: dict[str, list],
    ws: Workspace,
    base: dict[str, Any],
    cfg: DictConfig,
    calibration: Any,
    nofit: list[tuple[int, ...]],
    n_est: int,
    *,
    top: int,
    max_estimates: int,
    with_max_context: bool,
) -> tuple[list[Candidate], set[str], int, int]:
    """Estimate the candidates cheapest first, skipping those a fitting set below them or a set above them
    that does not fit (``nofit``, extended here) rules out, until ``top`` fitting sets are found or
    ``max_estimates`` estimates are made (``n_est`` so far). Returns the fitting valid sets (cheapest
    first), the keys they change, how many fitting sets the rules rejected, and the estimates made in all."""
    fits_sets: list[tuple[int, ...]] = []
    found: list[Candidate] = []
    used: set[str] = set()
    rejected = 0
    for cost, _n, choice, keys in cands:
        if len(found) >= top or n_est >= max_estimates:
            break
        r = _rank(choice, space)
        if any(_le(f, r) and f != r for f in fits_sets) or any(_le(r, n) for n in nofit):
            continue
        if any(_le(f, r) for f in fits_sets):
            continue
        new = ws.apply(choice)
        try:
            est = estimate(new, calibration=calibration)
            n_est += 1
            if not est["fits"]:
                nofit.append(r)  # its memory is what it is, valid or not: its subsets do not fit either
                continue
            if _valid(new):
                rejected += 1
                continue
            fits_sets.append(r)
            cand = Candidate(choice, overrides_for(base, choice, cfg), cost, est)
            if with_max_context:
                cand.max_tokens = max_tokens(new, calibration)
        finally:
            ws.reset()
        found.append(cand)
        used.update(keys)
    found.sort(key=lambda c: (c.cost, len(c.overrides)))
    return found, used, rejected, n_est


def _suggestion_rows(
    found: list[Candidate], base_est: dict[str, Any], cfg: DictConfig, with_max_context: bool
) -> list[dict[str, Any]]:
    """The ``suggestions`` of :func:`suggest`: one row per estimated candidate."""
    budget = base_est["budget_bytes"]
    return [
        {
            "overrides": c.overrides,
            "peak_bytes": c.est[M.PEAK_MEMORY_BYTES],
            "required_bytes": c.est["required_bytes"],
            "headroom_bytes": budget - c.est["required_bytes"],
            "speed_factor": round(c.cost, 3),
            "reason": reason(base_est, c, cfg),
            **({"max_tokens": c.max_tokens} if with_max_context else {}),
        }
        for c in found
        if c.est is not None
    ]


def spare(cfg: DictConfig, calibration: Any) -> dict[str, Any]:
    """What a config that fits could afford (``cfg`` is changed and put back): the largest micro-batch
    (doubling), adapter rank (doubling, not for ``adapter=full``) and context (bisection) that still fit, each
    changed alone."""

    def grow(key: str, start: int, cap: int) -> int:
        best, v = start, start * 2
        while v <= cap:
            OmegaConf.update(cfg, key, v)
            ok = estimate(cfg, calibration=calibration)["fits"]
            OmegaConf.update(cfg, key, start)
            if not ok:
                break
            best, v = v, v * 2
        return best

    out = {"train.micro_batch": grow("train.micro_batch", int(cfg.train.micro_batch), 1024)}
    if cfg.adapter.method != "full":
        out["adapter.r"] = grow("adapter.r", int(cfg.adapter.r), 4096)
    out["context.max_tokens"] = max_tokens(cfg, calibration)
    return out


def format_suggest(res: dict[str, Any], title: str = "") -> str:
    """The person's view: verdict, one table (<= 100 columns), reasons, speed-model lines."""
    budget = res["budget_bytes"]
    lines = [title] if title else []
    verdict = "fits" if res["fits"] else "does NOT fit"
    lines.append(
        f"your config: required {res['required_bytes'] / GIB:.2f} GiB of {budget / GIB:.2f} GiB: {verdict} "
        f"(headroom {res['headroom_bytes'] / GIB:+.2f} GiB)"
    )
    mem = "calibrated (results/calibration)" if res.get("calibrated_memory") else "analytic (not calibrated)"
    if res["fits"]:
        sp = res["spare"]
        lines.append("the spare memory could buy (each alone, still fitting):")
        for k, v in sp.items():
            lines.append(f"  {k}={v}")
        lines.append(f"memory figures: {mem}; {res['estimates']} estimates, {res['seconds']:.2f} s")
        return "\n".join(lines)
    sug = res["suggestions"]
    if not sug:
        lines.append(
            "no set of the searched changes fits: shorten context.max_tokens (--max-context gives "
            "the longest)"
        )
    else:
        mc = "max_tokens" in sug[0]
        head = f"{'#':>2} {'required':>8} {'headroom':>8} {'speed':>6}" + (f" {'max ctx':>8}" if mc else "")
        head += "  overrides"
        lines += [head, "-" * min(100, max(len(head), 60))]
        for i, s in enumerate(sug, 1):
            row = (
                f"{i:>2} {s['required_bytes'] / GIB:>7.2f}G {s['headroom_bytes'] / GIB:>+7.2f}G "
                f"{s['speed_factor']:>5.2f}x" + (f" {s['max_tokens']:>8,}" if mc else "")
            )
            pad = " " * len(row)
            ovs, cur = s["overrides"], ""
            for ov in ovs:
                if cur and len(row) + 2 + len(cur) + 1 + len(ov) > 100:
                    lines.append(f"{row}  {cur}")
                    row, cur = pad, ""
                cur = f"{cur} {ov}".strip()
            lines.append(f"{row}  {cur}")
        lines.append(
            "speed: predicted step time relative to your config (1.00x = as fast; tokens per step kept)"
        )
        lines.append("why:")
        for i, s in enumerate(sug, 1):
            lines += _wrap(f"{i:>2} {s['reason']}", 100, "   ")
    lines.append("speed model (x = step-time factor of each change used above):")
    for ln in res["speed_model"]:
        lines += _wrap(f"  - {ln}", 100, "    ")
    lines.append(f"memory figures: {mem}")
    for ln in res["left_out"]:
        lines.append(f"not searched: {ln}")
    more = "" if res.get("complete", True) else " (estimate budget spent: the list may miss cheaper sets)"
    lines.append(
        f"searched {res['searched']} change sets, {res['estimates']} estimates, {res['seconds']:.2f} s{more}"
    )
    return "\n".join(lines)


def _wrap(text: str, width: int, indent: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width, subsequent_indent=indent) or [text]
