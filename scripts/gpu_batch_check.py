"""Batching exactness on the device: token-weighted gradient accumulation and packing (the smoke's
"batching" phase).

    python scripts/gpu_batch_check.py --device cuda     # on the GPU machine
    python scripts/gpu_batch_check.py --device cpu      # the same checks on CPU (tests/project/test_gpu_scripts.py)

The device twin of tests/training/test_accumulation.py::test_accumulation_equals_the_bigger_batch and
tests/data/test_packing.py::test_a_packed_step_equals_its_examples_unpacked, on the embedded tiny model in
fp32 (lr 0, eval mode: the compared steps see the same function):

* ``micro_batch=1 x grad_accum=4`` over four examples of very different trained-token counts gives the
  loss and LoRA gradients of ``micro_batch=4 x grad_accum=1`` (each micro-batch's mean weighted by its
  share of the step's trained tokens);
* the same examples packed into rows (positions restarting, attention per example) give the loss and
  gradients of the unpacked batch.

Prints one JSON line per check and ``verdict: PASS|FAIL``; exit 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

#: (length, trained tokens): very different counts (the mean-of-means bug weighs a short one's token more).
LENGTHS_TARGETS = [(70, 58), (250, 239), (40, 9), (180, 120)]
#: Relative gradient / loss tolerance (fp32; the CPU tests hold 1e-5, CUDA's reductions reorder sums).
TOL = 1e-4


def _examples(vocab: int = 3000, seed: int = 5) -> list:
    import torch

    from vramsweep.data.examples import IGNORE_INDEX, Example

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, t) in enumerate(LENGTHS_TARGETS):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (n - t) + ids[n - t :]
        out.append(Example(ids, labels, doc_id=f"d{i}", target_section=1, n_context_tokens=n - t))
    return out


def _step(base: list[str], batches: list, grad_accum: int, device, packing: bool = False):
    """Loss and LoRA gradients of one optimizer step over ``batches`` (lr 0: nothing is updated)."""
    import torch

    from vramsweep.config import compose
    from vramsweep.knobs import build_model
    from vramsweep.knobs.registry import loss_fn
    from vramsweep.loop import Callback, Loop, fit

    cfg = compose([*base, f"data.packing={str(packing).lower()}"])
    torch.manual_seed(0)
    model = build_model(cfg).model.to(device).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grads: list = []

    class Keep(Callback):
        def on_grads(self, step: int) -> None:
            grads[:] = [p.grad.detach().float().cpu().clone() for p in params]

    loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn(cfg, model),
                device=device, steps=1, grad_accum=grad_accum, params=params)  # fmt: skip
    return float(fit(loop, [Keep()])[0]), grads


def _rel(a: list, b: list) -> float:
    import torch

    num = torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True)))
    return float(num / torch.sqrt(sum((y**2).sum() for y in b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    from vramsweep.data.packing import pack_examples
    from vramsweep.data.prep import collate_batch, micro_batches

    device = torch.device(args.device)
    hardware = "h200_141gb" if args.device == "cuda" else "cpu"
    base = [f"hardware={hardware}", "model=tiny", "quant=none", "train.dtype=fp32", "attention=sdpa"]
    ex = _examples()
    n = len(ex)

    def split(mb: int, ga: int) -> list:
        return [collate_batch(b, 0) for b in micro_batches(ex, mb, ga, 1, seed=0)]

    big_loss, big = _step(base, split(n, 1), 1, device)
    checks = []
    acc_loss, acc = _step(base, split(1, n), n, device)
    checks.append(("accumulation 1x4 == 4x1", _rel(acc, big), abs(acc_loss - big_loss) / abs(big_loss)))
    rows = pack_examples(ex, 320, seed=0)
    packed_loss, packed = _step(base, [collate_batch(rows, 0, 320)], 1, device, packing=True)
    checks.append(("packed == unpacked", _rel(packed, big), abs(packed_loss - big_loss) / abs(big_loss)))
    ok = True
    for name, grad_rel, loss_rel in checks:
        passed = grad_rel < TOL and loss_rel < TOL
        ok &= passed
        print(json.dumps({"check": name, "device": args.device, "grad_rel": grad_rel, "loss_rel": loss_rel,
                          "tol": TOL, "pass": passed}))  # fmt: skip
    print(f"verdict: {'PASS' if ok else 'FAIL'} ({len(checks)} checks on {args.device}, "
          f"{time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
