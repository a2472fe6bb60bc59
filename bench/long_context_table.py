"""Re-derive docs/LONG_CONTEXT.md's predicted max-context table (estimator only, no GPU, seconds).

    .venv/bin/python bench/long_context_table.py            # markdown table + the 65,536-token breakdown

For each knob stack: the longest context.max_tokens whose *required* bytes fit hardware=rtx4080_16gb's
15 GiB (vramsweep.estimate.max_context), the host (pinned) bytes at that length, the peak phase, and the
estimate's extrapolated terms (the terms no GPU run has measured). Then, for the full stack at 65,536 tokens,
what the peak is made of.
"""

from __future__ import annotations

from vramsweep.config import compose
from vramsweep.estimate import analytic as A
from vramsweep.estimate import estimate, knobs_from_cfg, max_context
from vramsweep.record.units import GIB

BASE = [
    "model=qwen3_8b",
    "rope=yarn",
    "rope.factor=4",
    "rope.original_max_position_embeddings=32768",
    "quant=nf4_dq",
    "train.micro_batch=1",
    "hardware=rtx4080_16gb",
]
ROWS = [
    "checkpointing=on",
    "kernels=liger checkpointing=on",
    "checkpointing=on tiling=on",
    "kernels=liger checkpointing=on adapter.dtype=compute",
    "kernels=unsloth rope=none checkpointing=on",
    "kernels=liger checkpointing=offload",
    "checkpointing=offload tiling=on",
    "kernels=liger checkpointing=offload tiling=mlp",
    "kernels=liger checkpointing=offload adapter.dtype=compute",
    "checkpointing=offload tiling=on adapter.dtype=compute",
    "kernels=liger checkpointing=offload tiling=mlp adapter.dtype=compute",
    "kernels=liger checkpointing=offload tiling=mlp adapter.dtype=compute tiling.attention_heads=4",
]
TARGET = 65_536
#: The seed's whole stack, one addition at a time (cumulative; fp32 masters kept with adapter.dtype=compute)
SEED_STACK = [
    "checkpointing=on",
    "kernels=liger",
    "adapter.dtype=compute",
    "checkpointing=offload",
    "tiling=mlp",
    "optimizer=paged_adamw_8bit",
    "vocab=sliced vocab.rows=100000",
    "tiling.attention_heads=4",
]


def _cfg(knobs: str, tokens: int | None = None):
    over = [*BASE, *knobs.split()]
    if "rope=none" in over:  # Unsloth sets its own RoPE: no rope knob, the positions are the model's
        over = [o for o in over if not o.startswith("rope")]
        over.append("model.max_position_embeddings=131072")
    if tokens:
        over.append(f"context.max_tokens={tokens}")
    return compose(over, rules="none")


def seed_stack() -> None:
    """--max-context after each addition of the seed's stack, in turn."""
    print("| + addition | predicted max tokens | required at 65,536 (GiB) | host pinned at max (GiB) |")
    print("|---|---|---|---|")
    knobs = ""
    for add in SEED_STACK:
        knobs = f"{knobs} {add}".strip()
        res = max_context(_cfg(knobs), calibration=False)
        at = estimate(_cfg(knobs, TARGET), calibration=False)
        print(
            f"| `{add}` | {res['max_tokens']:,} | {at['required_bytes'] / GIB:.2f} | "
            f"{res['estimate']['host_bytes'] / GIB:.2f} |"
        )
    print()


def main() -> None:
    seed_stack()
    print(
        "| knobs | predicted max tokens | required at max (GiB) | host pinned at max (GiB) | required at 65,536 (GiB) |"
    )
    print("|---|---|---|---|---|")
    for knobs in ROWS:
        res = max_context(_cfg(knobs), calibration=False)
        e = res["estimate"]
        at = estimate(_cfg(knobs, TARGET), calibration=False)
        shown = knobs.replace(" rope=none", "")
        print(
            f"| `{shown}` | {res['max_tokens']:,} | {e['required_bytes'] / GIB:.2f} | "
            f"{e['host_bytes'] / GIB:.2f} | {at['required_bytes'] / GIB:.2f} |"
        )
    full = ROWS[-2]
    cfg = _cfg(full, TARGET)
    est = estimate(cfg, calibration=False)
    k = knobs_from_cfg(cfg)
    T, c, h = k.tokens, k.c, k.dims.hidden_size
    at_attn = A._layer_saved(k, in_rg=True, int8=False, upto_attention=True).total
    prefetch = c * h  # the prefetched next input (the layer's own input is its saved "x")
    ws = A.attention_backward_bytes_per_token(k)
    print(
        f"\n`{full}` at {TARGET:,} tokens: required {est['required_bytes'] / GIB:.2f} GiB, "
        f"reserved peak {est['peak_memory_bytes'] / GIB:.2f} GiB, host {est['host_bytes'] / GIB:.2f} GiB"
    )
    for name, v in est["breakdown_bytes"].items():
        print(f"  {name:<12} {v / GIB:6.2f} GiB")
    print("  activations at the peak (the recomputed layer's attention backward):")
    print(
        f"    layer tensors up to its attention output   {at_attn * T / GIB:6.2f} GiB ({at_attn:,.0f} B/token)"
    )
    print(f"    attention backward workspace (FA2 mha_bwd) {ws * T / GIB:6.2f} GiB ({ws:,.0f} B/token)")
    print(f"    prefetched next layer input                 {prefetch * T / GIB:6.2f} GiB")
    print("  extrapolated:", "; ".join(est["extrapolated_terms"]))


if __name__ == "__main__":
    main()
