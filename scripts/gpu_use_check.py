"""``vramsweep generate`` and ``vramsweep export --merge`` on an NF4 production run, on the device (the
smoke's opt-in "nf4_use" phase, issue 53).

    python scripts/gpu_use_check.py --device cuda     # on the GPU machine
    python scripts/gpu_use_check.py --device cpu      # the dry run (tests/project/test_gpu_scripts.py)

In one interpreter: a production run (embedded tiny model, ``quant=nf4``, LoRA, :data:`STEPS` steps) with
its run folder; the run's model loaded as ``generate`` loads it (where its weights are: on CUDA a 4-bit base
lands on ``cuda:0`` with no hooks that move inputs, so the prompt must be put there); ``vramsweep generate``
(the CLI, greedy, :data:`NEW_TOKENS` tokens); ``vramsweep export --merge`` and the merged-vs-trained logit
difference it reports (``vramsweep_export.json``: max / mean |Δlogit|, the share of positions with the same
argmax, on the run's held-out records).

Prints one JSON line per check and ``verdict: PASS|FAIL``. PASS: the run trained; the model is on the
device asked for (``cuda:0`` on CUDA); generate and export exit 0; the merge check was measured, finite, and
at least :data:`MIN_ARGMAX` of its positions keep the trained model's argmax (measured on CPU, 2026-12-06,
rslora: 96.5 %; a merge that lost the adapter or the base would fall far below).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

STEPS = 4
NEW_TOKENS = 16
#: The least share of held-out positions whose argmax the merged model keeps (a sanity bound, see above).
MIN_ARGMAX = 0.9
PROMPT = "Write the next section of this grant report"
STACK = ["model=tiny", "quant=nf4", "adapter=lora", "attention=sdpa", f"train.steps={STEPS}",
         "train.warmup_steps=0", "train.measure_warmup_steps=1", "train.eval_batches=1", "data.num_docs=4",
         "data.num_eval_docs=2"]  # fmt: skip
DEVICE = {
    "cuda": ["hardware=rtx4080_16gb", "context.max_tokens=256"],
    "cpu": ["hardware=cpu", "context.max_tokens=128"],
}


def _cli(argv: list[str]) -> tuple[int, str]:
    """``vramsweep <argv>`` in this process: (exit code, stdout + stderr)."""
    from vramsweep.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(argv)
    lines = re.split(r"[\r\n]+", buf.getvalue())  # transformers' weight-loading bar left out
    return int(rc), "\n".join(x for x in lines if x.strip() and not x.startswith("Loading weights"))


def train(device: str, run: Path) -> dict[str, Any]:
    from vramsweep.config import compose
    from vramsweep.trial import run_trial

    over = [*STACK, *DEVICE[device], f"results_dir={run.parent}", f"train.output_dir={run}"]
    return run_trial(compose(over), result_path=run / "result.json", overrides=over)


def placement(run: Path) -> dict[str, Any]:
    """Where ``generate``'s model is (its weights' device) and how many 4-bit layers it holds."""
    from vramsweep.production.use import load_run_model, model_device

    model, _, _ = load_run_model(run)
    n4 = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit")
    return {"device": str(model_device(model)), "linear4bit": n4}


def merge_ok(check: dict[str, Any] | None) -> bool:
    """The merge check was measured, its figures are finite and the argmax agreement is at least MIN_ARGMAX."""
    if not check or not check.get("measured"):
        return False
    figures = (check["max_abs_logit_diff"], check["mean_abs_logit_diff"], check["argmax_agreement"])
    return all(math.isfinite(x) for x in figures) and check["argmax_agreement"] >= MIN_ARGMAX


def checks(device: str, work: Path) -> list[dict[str, Any]]:
    run = work / "nf4_run"
    res = train(device, run)
    out = [{"check": "nf4 production run", "status": res["status"], "reason": res.get("reason"),
            "pass": res["status"] == "ok"}]  # fmt: skip
    if res["status"] != "ok":
        return out
    where = placement(run)
    want = "cuda:0" if device == "cuda" else "cpu"
    out.append({"check": "generate's model placement", **where, "want": want,
                "pass": where["device"] == want and where["linear4bit"] > 0})  # fmt: skip
    rc, text = _cli(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)])
    out.append({"check": "vramsweep generate (prompt on the model's device)", "exit": rc,
                "output": text.strip()[-200:], "pass": rc == 0})  # fmt: skip
    merged = work / "nf4_merged"
    rc, text = _cli(["export", str(run), "--merge", str(merged)])
    info = merged / "vramsweep_export.json"
    check = json.loads(info.read_text()).get("merged_vs_trained") if info.is_file() else None
    out.append({"check": "vramsweep export --merge: merged vs trained", "exit": rc, "line": text.strip()[-300:],
                "merged_vs_trained": check, "min_argmax": MIN_ARGMAX, "pass": rc == 0 and merge_ok(check)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--work", default=None, help="folder for the run (default: a temporary one)")
    args = ap.parse_args(argv)
    import tempfile

    t0 = time.perf_counter()
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_use_check_"))
    work.mkdir(parents=True, exist_ok=True)
    results = checks(args.device, work)
    for r in results:
        print(json.dumps({**r, "device": args.device}, default=str))
    ok = all(r["pass"] for r in results) and len(results) == 4
    print(f"verdict: {'PASS' if ok else 'FAIL'} (generate / export --merge of an NF4 run on {args.device}, "
          f"{time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
