"""Long-context exactness on the device: ``checkpointing=on`` vs ``offload`` vs ``offload`` + ``tiling=mlp``.

    python scripts/gpu_longctx_check.py --device cuda     # on the GPU machine (the smoke's "exact" phase)
    python scripts/gpu_longctx_check.py --device cpu      # the same checks on CPU (tests/project/test_gpu_scripts.py)

On the embedded tiny model with NF4 base weights (bitsandbytes ``Linear4bit``) and fp32 compute (the 4-bit
matmuls' ``quant.compute_dtype`` too), one
forward + backward per mode from the same weights and seed:

* the loss and every LoRA gradient of ``offload`` equal ``checkpointing=on``'s, and ``offload + tiling``'s
  equal ``on + tiling``'s (LoRA dropout 0.1: the recompute replays the forward's masks; a tiled MLP draws
  its masks tile by tile, in the same order in every pass); without dropout ``offload + tiling`` equals
  plain ``on``;
* every call of an MLP projection sees at most ``--tile`` positions — forward, recompute and an evaluation
  under ``no_grad``;
* on CUDA the offload pool is page-locked (``is_pinned()``) and exactly layers x batch x tokens x hidden x
  4 bytes (no power-of-two rounding).

Prints one JSON line per check and ``verdict: PASS|FAIL``; exit 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--tokens", type=int, default=256, help="sequence length (default 256)")
    ap.add_argument("--tile", type=int, default=64, help="tiling.mlp_tile_tokens (default 64)")
    ap.add_argument("--quant", default="nf4", help="quant option (default nf4)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    import torch

    from vramsweep.config import compose
    from vramsweep.knobs import build_model
    from vramsweep.longctx.loss import causal_lm_of
    from vramsweep.measure.eval import evaluate

    hardware = "h200_141gb" if args.device == "cuda" else "cpu"
    # fp32 matmuls throughout (quant.compute_dtype too): on CUDA a bf16 GEMM over a 64-row tile may take
    # another kernel than over 256 rows and round an output 1 bf16 ulp apart (2026-12-04, H200: tiled vs
    # untiled gradients 3.5e-3 apart with the default bf16 compute dtype) - a fact of the GEMM, not of tiling
    base = [f"hardware={hardware}", f"quant={args.quant}", "train.dtype=fp32", "quant.compute_dtype=fp32",
            "attention=sdpa"]  # fmt: skip
    tiled = ["tiling=mlp", f"tiling.mlp_tile_tokens={args.tile}"]
    # (name, overrides); with LoRA dropout 0.1 a tiled MLP draws its masks tile by tile, so the tiled
    # modes are compared with tiled checkpointing=on, and without dropout with the untiled one
    modes = {
        "on": ["checkpointing=on", "adapter.dropout=0.1"],
        "offload": ["checkpointing=offload", "adapter.dropout=0.1"],
        "on+tiling": ["checkpointing=on", "adapter.dropout=0.1", *tiled],
        "offload+tiling": ["checkpointing=offload", "adapter.dropout=0.1", *tiled],
        "on, no dropout": ["checkpointing=on", "adapter.dropout=0.0"],
        "offload+tiling, no dropout": ["checkpointing=offload", "adapter.dropout=0.0", *tiled],
    }
    pairs = [
        ("offload", "on"),
        ("offload+tiling", "on+tiling"),
        ("offload+tiling, no dropout", "on, no dropout"),
    ]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 3000, (1, args.tokens), generator=g)
    labels = ids.clone()
    labels[:, : args.tokens // 4] = -100
    checks: list[dict] = []
    results: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    state = None
    for name, over in modes.items():
        built = build_model(compose([*base, *over], rules="config"))
        model, dev = built.model, built.device
        if state is None:
            with torch.no_grad():  # non-zero LoRA B: dropout shapes the loss, not only B's gradient
                gen = torch.Generator().manual_seed(7)
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.device, p.dtype))
            state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        else:
            model.load_state_dict(state, strict=False)
        model.train()
        seen: list[int] = []
        hooks = [
            m.register_forward_pre_hook(lambda _m, a, seen=seen: seen.append(int(a[0].shape[-2])))
            for n, m in model.named_modules()
            if n.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
        ]
        torch.manual_seed(123)
        if dev.type == "cuda":
            torch.cuda.manual_seed_all(123)
        loss = model(input_ids=ids.to(dev), labels=labels.to(dev)).loss
        loss.backward()
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (loss.item(), grads)
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": labels,
            "fact_spans": [[]],
        }
        evaluate(model, [batch], dev, causal_lm=causal_lm_of)
        for h in hooks:
            h.remove()
        if "tiling" in name and "dropout" not in name:
            checks.append(
                {
                    "check": f"{name}: MLP inputs <= {args.tile} positions in forward, recompute and eval",
                    "ok": bool(seen) and max(seen) <= args.tile,
                    "calls": len(seen),
                    "max_positions": max(seen) if seen else None,
                }
            )
        mgr = getattr(model, "_vramsweep_offload", None)
        if mgr is not None and "dropout" not in name:
            hidden = causal_lm_of(model).config.hidden_size
            layers = causal_lm_of(model).config.num_hidden_layers
            exact = layers * args.tokens * hidden * 4
            pinned = bool(mgr.pool.buf is not None and mgr.pool.buf.is_pinned())
            checks.append(
                {
                    "check": f"{name}: host pool exact size"
                    + (" and page-locked" if dev.type == "cuda" else ""),
                    "ok": mgr.pool_bytes == exact and (pinned or dev.type != "cuda"),
                    "pool_bytes": mgr.pool_bytes,
                    "expected_bytes": exact,
                    "pinned": pinned,
                }
            )
        del model, built, loss
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for name, against in pairs:
        loss, got = results[name]
        ref_loss, ref = results[against]
        worst = max(
            (float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref),
            default=1.0,
        )
        checks.append(
            {
                "check": f"{name} == {against} (loss, every LoRA gradient)",
                "ok": got.keys() == ref.keys()
                and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
                and worst <= 1e-4,
                "loss": loss,
                "loss_ref": ref_loss,
                "max_rel_grad_diff": worst,
                "n_grads": len(got),
            }
        )
    for c in checks:
        print(json.dumps(c), flush=True)
    ok = all(c["ok"] for c in checks)
    print(f"verdict: {'PASS' if ok else 'FAIL'} ({args.device}, {time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
