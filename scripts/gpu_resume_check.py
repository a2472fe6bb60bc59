"""A production run's resume on the device, with and without ``train.deterministic`` (the smoke's opt-in
"resume" phase, issue 53).

    python scripts/gpu_resume_check.py --device cuda     # on the GPU machine
    python scripts/gpu_resume_check.py --device cpu      # the dry run (tests/project/test_gpu_scripts.py)

For ``train.deterministic=false`` and then ``=true``, one fresh interpreter each (``--child``: the cuBLAS
workspace is sized once per process, before CUDA is first used: vramsweep.determinism) runs, in-process,
the same production run (embedded tiny model, NF4 base, paged 8-bit AdamW, LoRA dropout 0.1 so the RNG
state matters, :data:`STEPS` optimizer steps, a checkpoint every :data:`STOP_AT`):

1. ``whole_a``: uninterrupted;
2. ``whole_b``: uninterrupted again (the run-to-run spread);
3. ``cut``: stopped by an injected error before step :data:`STOP_AT` + 1 (``VRAMSWEEP_FAULT``; the
   checkpoint after step :data:`STOP_AT` is complete), then resumed with ``train.resume=auto`` to the end.

It prints one JSON line per setting (``RESUME {...}``: max |Δ| of the adapters whole_b vs whole_a and
resumed vs whole_a, bitwise or not, the per-step losses equal or not, ``meta.deterministic``, the mean
step times) and the cost of determinism: ``metrics.step_time_s`` deterministic / not, paired by run
(whole_a with whole_a, whole_b with whole_b; the two processes run one after the other).

Verdict: PASS when every run ended as planned (the cut one by the injected error, the resumed one from
step :data:`STOP_AT`) and the adapters are bitwise equal where that is promised: with
``train.deterministic=true`` on CUDA, and on CPU for both settings (CPU runs repeat bitwise). Without
determinism on CUDA the differences are recorded, not judged (``within_spread`` says whether the
resumed run's difference is at most the run-to-run one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: The run's length and where the cut run stops (a checkpoint every STOP_AT steps; resumed from it).
STEPS, STOP_AT = 6, 3
#: The production stack of the check (fp32 LoRA masters on an NF4 base, paged 8-bit AdamW: the
#: optimizer state that is re-paged on resume), short data, one eval batch.
STACK = [
    "model=tiny",
    "quant=nf4",
    "optimizer=paged_adamw_8bit",
    "attention=sdpa",
    "adapter.dropout=0.1",
    f"train.steps={STEPS}",
    "train.warmup_steps=1",
    "train.measure_warmup_steps=2",
    "train.eval_batches=1",
    f"train.save_every={STOP_AT}",
    "train.keep_checkpoints=1",
    "data.num_docs=4",
    "data.num_eval_docs=1",
]
#: Per device: the hardware profile (CUDA: the 16 GB card's cap) and the context length.
DEVICE = {
    "cuda": ["hardware=rtx4080_16gb", "context.max_tokens=256"],
    "cpu": ["hardware=cpu", "context.max_tokens=128", "train.threads=1"],
}


def overrides(device: str, deterministic: bool, out: Path, *extra: str) -> list[str]:
    """The run's overrides: :data:`STACK` on ``device``, ``train.deterministic``, its folder."""
    return [*STACK, *DEVICE[device], f"train.deterministic={str(deterministic).lower()}",
            f"results_dir={out.parent}", f"train.output_dir={out}", *extra]  # fmt: skip


def _run(over: list[str], out: Path) -> dict[str, Any]:
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    return run_trial(compose(over), result_path=out / "result.json", overrides=over)


def adapter_diff(a: Path, b: Path) -> dict[str, Any]:
    """Max |Δ| over the adapter tensors of two run folders and whether every tensor is bitwise equal."""
    import torch
    from safetensors.torch import load_file

    ta = load_file(str(a / "adapter" / "adapter_model.safetensors"))
    tb = load_file(str(b / "adapter" / "adapter_model.safetensors"))
    if ta.keys() != tb.keys():
        return {"bitwise": False, "max_abs": None, "why": "different tensor names"}
    diff = max(((ta[k].float() - tb[k].float()).abs().max().item() for k in ta), default=0.0)
    return {"bitwise": all(torch.equal(ta[k], tb[k]) for k in ta), "max_abs": diff, "tensors": len(ta)}


def losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "losses.jsonl").read_text().splitlines()]


def child(device: str, deterministic: bool, work: Path) -> dict[str, Any]:
    """The three runs of one setting in this process; the comparison as a dict."""
    tag = "det" if deterministic else "nondet"
    dirs = {name: work / f"{tag}_{name}" for name in ("whole_a", "whole_b", "cut")}
    res = {n: _run(overrides(device, deterministic, d), d) for n, d in dirs.items() if n != "cut"}
    os.environ["VRAMSWEEP_FAULT"] = f"error@{STOP_AT + 1}"  # dies before step STOP_AT + 1 (0-based)
    try:
        res["cut"] = _run(overrides(device, deterministic, dirs["cut"]), dirs["cut"])
    finally:
        os.environ.pop("VRAMSWEEP_FAULT", None)
    res["resumed"] = _run(overrides(device, deterministic, dirs["cut"], "train.resume=auto"), dirs["cut"])
    resumed_from = (res["resumed"].get("meta") or {}).get("resumed_from") or {}
    rep = {
        "deterministic": deterministic,
        "device": device,
        "statuses": {n: r["status"] for n, r in res.items()},
        "cut_reason": str(res["cut"].get("reason") or "")[:120],
        "reasons": {
            n: str(r.get("reason"))[:300] for n, r in res.items() if r["status"] != "ok" and n != "cut"
        },
        "resumed_next_step": resumed_from.get("next_step"),
        "meta_deterministic": (res["whole_a"].get("meta") or {}).get("deterministic"),
        "step_time_s": {n: (res[n].get("metrics") or {}).get("step_time_s") for n in ("whole_a", "whole_b")},
    }
    planned = (
        rep["statuses"] == {"whole_a": "ok", "whole_b": "ok", "cut": "error", "resumed": "ok"}
        and "injected" in rep["cut_reason"]
        and rep["resumed_next_step"] == STOP_AT
    )
    rep["as_planned"] = planned
    if planned:
        rep["spread"] = adapter_diff(dirs["whole_b"], dirs["whole_a"])
        rep["resume"] = adapter_diff(dirs["cut"], dirs["whole_a"])
        rep["losses_equal"] = losses(dirs["cut"]) == losses(dirs["whole_a"])
        rep["within_spread"] = (rep["resume"]["max_abs"] or 0.0) <= (rep["spread"]["max_abs"] or 0.0)
    return rep


def judge(rep: dict[str, Any]) -> tuple[bool, str]:
    """PASS/FAIL of one setting: the runs went as planned; bitwise where promised (see the docstring)."""
    if not rep.get("as_planned"):
        why = f"runs not as planned: {rep.get('statuses')}, resumed from {rep.get('resumed_next_step')}"
        return False, why + "".join(f"; {n}: {r}" for n, r in (rep.get("reasons") or {}).items())
    promised = rep["device"] == "cpu" or rep["deterministic"]
    bitwise = rep["spread"]["bitwise"] and rep["resume"]["bitwise"] and rep["losses_equal"]
    what = (f"spread max |d| {rep['spread']['max_abs']:.3g}, resumed vs uninterrupted max |d| "
            f"{rep['resume']['max_abs']:.3g}{' (bitwise)' if bitwise else ''}")  # fmt: skip
    if promised and not bitwise:
        return False, what + ": bitwise promised, not met"
    return True, what + ("" if promised else f"; within the spread: {rep['within_spread']}")


def step_time_ratio(reps: dict[bool, dict[str, Any]]) -> dict[str, Any]:
    """``step_time_s`` deterministic / not, paired by run (whole_a, whole_b)."""
    pairs = {}
    for run in ("whole_a", "whole_b"):
        on, off = (reps[d].get("step_time_s", {}).get(run) for d in (True, False))
        pairs[run] = on / off if on and off else None
    got = [r for r in pairs.values() if r]
    return {"pairs": pairs, "mean": sum(got) / len(got) if got else None,
            "definition": "metrics.step_time_s (mean wall time of a timed step) with train.deterministic=true / false, "
            "the same run's repeat paired; two processes one after the other"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--work", default=None, help="folder for the run folders (default: a temporary one)")
    ap.add_argument("--child", choices=("det", "nondet"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        rep = child(args.device, args.child == "det", Path(args.work))
        print("RESUME " + json.dumps(rep), flush=True)
        return 0
    import tempfile

    t0 = time.perf_counter()
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_resume_check_"))
    reps: dict[bool, dict[str, Any]] = {}
    ok = True
    for det in (False, True):  # fresh interpreters: determinism is set before CUDA is first used
        cmd = [sys.executable, __file__, "--device", args.device, "--work", str(work),
               "--child", "det" if det else "nondet"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESUME ")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            print(json.dumps({"check": f"resume deterministic={det}", "pass": False,
                              "why": f"no report (exit {proc.returncode}): {' / '.join(tail)[:400]}"}))  # fmt: skip
            ok = False
            continue
        reps[det] = json.loads(line[len("RESUME ") :])
        passed, why = judge(reps[det])
        ok &= passed
        print(json.dumps({"check": f"resume deterministic={det}", "pass": passed, "why": why, **reps[det]}))
    if len(reps) == 2:
        print(json.dumps({"check": "cost of train.deterministic", **step_time_ratio(reps)}))
    print(f"verdict: {'PASS' if ok else 'FAIL'} (resume with and without train.deterministic on "
          f"{args.device}, {time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
