"""Typed schema for every config group.

Each YAML option under ``conf/<group>/`` starts with ``defaults: [base_<group>, _self_]`` so that
OmegaConf rejects unknown keys and wrong types at compose time. Range checks and cross-knob rules
live in :mod:`vramsweep.config.rules` (OmegaConf does not run ``__post_init__`` on merge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

# Groups whose options are checked by name: an option's ``name`` must be one of the group's option files
# (``conf/<group>/*.yaml`` across the search path, :func:`vramsweep.config.paths.list_options`). There
# is no hand-written list of options: a new option file is a new option.
NAMED_GROUPS: tuple[str, ...] = (
    "quant",
    "adapter",
    "optimizer",
    "attention",
    "kernels",
    "checkpointing",
    "tiling",
    "vocab",
    "logger",
    "rope",
)

DTYPES = ("fp32", "bf16", "fp16")
TRUNCATIONS = ("none", "head", "tail", "exp_decay")
SCHEDULES = ("constant", "linear", "cosine", "constant_with_warmup")
MODEL_SOURCES = ("embedded", "path", "arch")
MODEL_FAMILIES = ("qwen3", "llama")


#: A trial's measurement settings, declared once: how long and how a sweep trial measures (and its seed
#: repeat), not what the recipe trains. ``vramsweep pick`` writes the recipe without them, so a production
#: run gets the defaults or its own ``train.epochs`` (docs/RUNS.md).
MEASUREMENT_KEYS = (
    "train.steps",
    "train.epochs",
    "train.measure_warmup_steps",
    "train.eval_every",
    "train.eval_batches",
    "train.seed",
    "train.threads",
    "train.save_adapter",
    "train.output_dir",
    "train.save_every",
    "train.keep_checkpoints",
    "train.resume",
    "train.resume_on_changed_data",
    "train.progress_every_steps",
    "train.progress_every_s",
    "data.num_docs",
    "data.num_eval_docs",
)


@dataclass
class ModelConfig:
    name: str = "tiny"
    source: str = "embedded"  # embedded | path | arch
    path: Optional[str] = None  # local HF folder when source=path (never downloaded)
    family: str = "qwen3"  # qwen3 | llama (architecture used for source=embedded/arch)
    vocab_size: int = 3072
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    # Embedded model only: pre-training budget for the base model (recipe: vramsweep.embedded).
    pretrain_drill_steps: int = 2200  # copy-drill steps before the documents
    pretrain_steps: int = 300  # document steps
    pretrain_task_steps: int = 150  # then steps on documents or their task-format rows
    pretrain_seq_len: int = 3400  # tokens kept per document row
    pretrain_batch: int = 1  # documents per step


@dataclass
class QuantConfig:
    name: str = "none"
    bits: int = 16  # 16 (none), 8 (int8 LLM.int8), 4 (nf4/fp4)
    quant_type: Optional[str] = None  # nf4 | fp4 (4-bit only)
    double_quant: bool = False  # quantise the absmax constants: 4.5 -> ~4.127 bits/param
    compute_dtype: str = "bf16"  # dtype the 4-bit matmuls dequantise to
    blocksize: int = 64  # bitsandbytes' fixed 4-bit block size (informational; used by the estimator)
    skip_modules: list[str] = field(default_factory=lambda: ["lm_head"])


@dataclass
class AdapterConfig:
    name: str = "lora"
    method: str = "lora"  # lora | full
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: Any = "all-linear"  # "all-linear" or a list of module names
    use_rslora: bool = False  # scaling alpha/sqrt(r) instead of alpha/r
    use_dora: bool = False  # weight-decomposed LoRA: + one magnitude vector per adapted layer
    dtype: str = (
        "fp32"  # adapter weights: fp32 (PEFT's autocast) | compute (train.dtype: no fp32 input copies)
    )
    fp32_master: bool = True  # dtype=compute: the optimizer steps fp32 master copies (no lost small updates)


@dataclass
class OptimizerStateConfig:
    """What ``optimizer.state`` holds per trainable tensor of n elements: the estimator counts memory from it
    (:func:`vramsweep.estimate.analytic.optimizer_state_bytes`), nothing else knows an optimizer by name."""

    moments: int = 2  # param-sized state tensors per trainable tensor (AdamW: exp_avg + exp_avg_sq; Lion: 1)
    bytes: int = 0  # per state element: 0 = as the tensor stepped (torch), 4 = fp32, 1 = 8-bit blockwise
    block: int = 256  # 8-bit: one fp32 absmax per block of this many elements, per moment
    qmap: int = 256  # 8-bit: fp32 entries of the quantisation map per moment, shared by all tensors
    min_8bit_size: int = 4096  # 8-bit: fp32 state below this many elements (the class's default; kwargs win)
    factored: bool = False  # each moment of a >=2-D tensor is a row + a column vector (Adafactor)
    scalar_bytes: int = 0  # 0-d tensors per trainable tensor (torch's fp32 step: 4; Adafactor's RMS: 4)
    paged: bool = False  # state of tensors >= 1e5 elements in CUDA unified memory (bitsandbytes paged)
    temporaries: float = 0.0  # param-sized temporaries of step() on the largest tensor (torch AdamW: 2)
    foreach_cuda: bool = False  # CUDA: step() makes one temporary for every tensor at once (torch foreach)


@dataclass
class OptimizerConfig:
    """An optimizer is declared, not coded: ``_target_`` names the class, ``kwargs`` its constructor keywords
    besides the params and ``lr`` (``train.lr``; override one with ``optimizer.kwargs.weight_decay=0.1``),
    ``state`` what it keeps (the estimator's memory model)."""

    name: str = "adamw"
    _target_: str = "torch.optim.AdamW"  # the optimizer class, imported at build
    kwargs: dict[str, Any] = field(default_factory=dict)  # constructor keywords (not params, lr)
    state: OptimizerStateConfig = field(default_factory=OptimizerStateConfig)


@dataclass
class AttentionConfig:
    name: str = "sdpa"
    implementation: str = "sdpa"  # passed as attn_implementation


@dataclass
class KernelsConfig:
    name: str = "none"
    liger: bool = False
    unsloth: bool = False
    liger_fused_linear_cross_entropy: bool = True
    liger_rms_norm: bool = True
    liger_swiglu: bool = True
    liger_rope: bool = True


@dataclass
class CheckpointingConfig:
    name: str = "off"
    enabled: bool = False
    use_reentrant: bool = False


@dataclass
class TilingConfig:
    name: str = "off"
    loss_chunk_tokens: int = 0  # >0: chunked linear cross-entropy, no full logits (vramsweep.longctx.loss)
    mlp_tile_tokens: int = 0  # >0: sequence-tiled MLP, recomputed per tile (vramsweep.longctx.mlp)
    attention_heads: int = (
        0  # >1: attention in that many GQA-aligned head groups (vramsweep.longctx.attention)
    )


@dataclass
class ContextConfig:
    max_tokens: int = 512
    truncation: str = "tail"  # none | head | tail | exp_decay
    decay: float = 0.5  # exp_decay: each older section gets `decay` x the budget of the next newer one
    min_tokens_per_section: int = 16  # exp_decay: floor below which an old section is dropped


@dataclass
class RopeConfig:
    name: str = "none"
    type: str = "none"  # none | yarn | linear | dynamic (transformers' rope_parameters["rope_type"])
    factor: float = 1.0  # positions = original_max_position_embeddings x factor (no memory change)
    original_max_position_embeddings: Optional[int] = None  # None = the model's positions


@dataclass
class VocabConfig:
    name: str = "full"
    mode: str = "full"  # full | corpus | top_k
    top_k: int = 0
    reserve: int = 0
    fallback: str = "error"  # error | unk: what to do with tokens outside the kept set
    rows: int = 0  # >0: the rows a slice keeps, for `vramsweep estimate` without a corpus (0: the corpus's)


@dataclass
class DataConfig:
    name: str = "synthetic"
    # embedded (synthetic documents) | embedded_chat (the shipped chat set) | file | jsonl (data.path) |
    # random
    source: str = "embedded"
    path: Optional[str] = None  # .jsonl / .json / .parquet / datasets folder when source=file|jsonl
    eval_path: Optional[str] = None  # held-out file; else a folder's test split, else the last 10 %
    format: str = "auto"  # auto | messages | sharegpt | prompt_completion | alpaca | text | documents
    train_on: str = "auto"  # auto | assistant | last_assistant | completion | all (docs/DATA.md)
    chat_template: Optional[str] = None  # None: the tokenizer's own; chatml | embedded | <path to .jinja>
    enable_thinking: bool = False  # passed to the chat template (Qwen3's thinking switch)
    # a record (chat, prompt/completion, alpaca, text) longer than context.max_tokens: truncate (cut as
    # docs/DATA.md says; memory bounded by max_tokens) | drop (left out, counted) | error (exit 2 naming it)
    too_long: str = "truncate"
    num_docs: Optional[int] = (
        None  # generated training documents/chats (source=embedded|embedded_chat|random)
    )
    num_eval_docs: Optional[int] = None
    seed: int = 1234
    # sectioned documents only: the instruction placed first in every prompt (may be "")
    instructions: str = "Write the next section of this grant report."
    packing: bool = False  # training examples packed into rows of context.max_tokens (data/packing.py)
    # the sha256 the file must have (``vramsweep pick`` pins the sweep's); None: not checked
    path_sha256: Optional[str] = None
    eval_path_sha256: Optional[str] = None


@dataclass
class HardwareConfig:
    name: str = "cpu"
    device: str = "cpu"  # cpu | cuda
    memory_gib: float = 0.0  # nominal device memory; 0 = no budget
    budget_gib: float = 0.0  # usable budget for trials (sweeps treat larger peaks as infeasible)
    peak_bf16_flops: float = (
        0.0  # the profile card's dense tensor FLOP/s (MFU uses the physical GPU's, measure/flops.py)
    )
    bandwidth_bytes_per_s: float = 0.0
    pcie_bytes_per_s: float = (
        0.0  # host<->device link per direction (offload cost in `estimate --suggest`); 0 = unknown
    )
    overhead_bytes: int = (
        0  # CUDA context outside the allocator (estimator reports it; the cap does not cover it)
    )
    emulate_cap: bool = True  # on a larger GPU, cap this process at budget_gib


@dataclass
class TrainConfig:
    steps: int = 30  # optimizer steps
    micro_batch: int = 2
    grad_accum: int = 1
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: Optional[int] = None  # None: 2, at most half of steps (vramsweep.config.fit)
    max_grad_norm: float = 1.0
    dtype: str = "auto"  # auto (vramsweep.config.fit.auto_dtype) | fp32 | bf16 | fp16
    seed: int = 0
    eval_every: int = 0  # optimizer steps between intermediate evals (0 = only before/after)
    eval_batches: int = 4
    measure_warmup_steps: Optional[int] = None  # excluded from tokens/s; None: 2, at most steps - 1
    threads: str = "auto"  # torch CPU threads: auto (vramsweep.measure.threads) | 0 (torch's default) | N
    deterministic: bool = False  # CUDA: deterministic kernels + cuBLAS workspace (vramsweep.determinism)
    # Production run (docs/RUNS.md): length over the data, outputs, checkpoints, resume.
    epochs: float = 0.0  # > 0: run length in passes over the training examples (replaces steps)
    save_adapter: str = "auto"  # auto (a train run saves, a sweep trial does not) | always | never
    output_dir: Optional[str] = None  # the run folder (default <results_dir>/runs/<stamp>_<name>)
    save_every: int = 0  # optimizer steps between checkpoints (0 = only on SIGTERM/SIGUSR1)
    keep_checkpoints: int = 2  # the newest K complete checkpoints are kept
    resume: str = "never"  # never | auto (continue from the run folder's newest complete checkpoint)
    resume_on_changed_data: bool = False  # resume although a data file's sha256 changed (recorded)
    # progress lines of a train run whose output is not a terminal (0: that rule off)
    progress_every_steps: int = 0
    progress_every_s: float = 60.0


@dataclass
class LoggerConfig:
    name: str = "none"
    project: str = "vramsweep"
    mode: str = "auto"  # auto (online if a key is set, else offline) | offline | online
    dir: Optional[str] = None


@dataclass
class TrialConfig:
    """The composed config of one trial (``conf/train.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    tiling: TilingConfig = field(default_factory=TilingConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    rope: RopeConfig = field(default_factory=RopeConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    results_dir: str = "results"
    name: Optional[str] = None  # run name; default derived from the overrides
    sweep: Any = None  # sweep=<name> (sweeps/<name>.yaml): parsed by vramsweep.sweeper.settings.SweepConfig


_SCHEMAS = {
    "model": ModelConfig,
    "quant": QuantConfig,
    "adapter": AdapterConfig,
    "optimizer": OptimizerConfig,
    "attention": AttentionConfig,
    "kernels": KernelsConfig,
    "checkpointing": CheckpointingConfig,
    "tiling": TilingConfig,
    "context": ContextConfig,
    "rope": RopeConfig,
    "vocab": VocabConfig,
    "data": DataConfig,
    "hardware": HardwareConfig,
    "train": TrainConfig,
    "logger": LoggerConfig,
}


# Every config group of a trial, in defaults-list order (the CLI help and tests iterate over it).
CONFIG_GROUPS: tuple[str, ...] = tuple(_SCHEMAS)


def register_configs() -> None:
    """Register ``base_<group>`` schemas and the top-level ``trial_schema`` in Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    for group, schema in _SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    cs.store(name="trial_schema", node=TrialConfig)
