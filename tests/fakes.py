"""Fake trial functions (a test double): the injection point for fault tests and the efficiency bench.

Use with ``hydra.sweeper.trial_fn=fakes:fake_trial``. The fake reads the knob values
from the overrides (no model, no compose: milliseconds per trial) and returns a result (docs/CONTRACTS.md)
from a deterministic landscape: memory grows with precision, rank, micro-batch and context and shrinks
with checkpointing; loss depends on the learning rate, rank and optimizer; throughput on precision and
checkpointing. Training runs ``train.steps`` simulated steps and calls ``reporter`` every
``train.eval_every`` steps, so pruning works as with the real trial.

Faults and timing come from the ``VRAMSWEEP_FAKE`` environment variable (JSON), e.g.
``{"sleep_s": 0.2, "faults": {"1": "oom", "2": "nan", "3": "kill"}, "marker_dir": "/tmp/m"}``:

* ``faults``: by trial number (or by an override such as ``"adapter.r=8"``: every trial of that point):
  ``oom`` (raises ``torch.cuda.OutOfMemoryError``), ``nan`` (NaN loss),
  ``kill`` (SIGKILL to itself), ``raise`` (a RuntimeError), ``hang`` (sleeps until killed),
  ``unsupported`` (raises ``UnsupportedError``), ``none_metric`` (returns without ``eval_loss``),
  ``bad_metric`` (returns ``eval_loss="x"``: a result that breaks the contract);
  ``<fault>_once`` (e.g. ``kill_once``, ``hang_once``): only the point's first run (a flag file in
  ``marker_dir``), so its retry runs clean.
* ``sleep_s``: real seconds per trial (spread over the steps); ``marker_dir``: the trial touches
  ``<dir>/start-<n>`` when it starts and ``<dir>/end-<n>`` when it returns.
* ``step_s``: *simulated* seconds per step at the reference config (reported as ``meta.wall_s``).
* ``landscape``: how quality relates to memory (:data:`LANDSCAPES`): ``rank_helps`` (the default: a higher
  rank lowers the loss, so the best feasible config is the highest-memory one), ``rank_hurts`` (a higher rank
  raises it: the best is not the highest-memory one), ``unrelated`` (loss from the learning rate and a
  per-config draw only: memory and quality unrelated).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vramsweep.record.result import new_result

GROUP_DEFAULTS: dict[str, str] = {
    "quant": "none",
    "adapter": "lora",
    "optimizer": "adamw",
    "attention": "sdpa",
    "kernels": "none",
    "checkpointing": "off",
    "vocab": "full",
    "hardware": "cpu",
}
VALUE_DEFAULTS: dict[str, float] = {
    "adapter.r": 16,
    "train.lr": 1e-3,
    "train.micro_batch": 2,
    "train.grad_accum": 1,
    "train.steps": 30,
    "train.eval_every": 0,
    "train.seed": 0,
    "context.max_tokens": 512,
    "hardware.budget_gib": 0.0,
}
BITS = {"none": 16, "int8": 8, "nf4": 4.5, "nf4_dq": 4.127, "fp4": 4.5}
OPT_BYTES = {
    "adamw": 8,
    "adamw_8bit": 2.03,
    "paged_adamw_8bit": 2.03,
    "paged_adamw_32bit": 8,
    "adafactor": 0.5,
}
BASE_PARAMS = 7.3e6


def parse_overrides(overrides: Sequence[str]) -> dict[str, str]:
    """``["quant=nf4", "+x=1"]`` -> ``{"quant": "nf4", "x": "1"}`` (later wins)."""
    out: dict[str, str] = {}
    for ov in overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        out[key.strip()] = value.strip()
    return out


def _num(knobs: dict[str, str], key: str) -> float:
    try:
        return float(knobs[key])
    except (KeyError, ValueError):
        return float(VALUE_DEFAULTS.get(key, 0.0))


def _group(knobs: dict[str, str], key: str) -> str:
    return knobs.get(key, GROUP_DEFAULTS.get(key, ""))


#: Overrides that are not knobs of the landscape: the noise must not depend on where results go or on
#: the budget (the same config measures the same under /tmp/a and /tmp/b).
NOT_KNOBS = ("results_dir", "hardware.budget_gib", "train.eval_every")


def _noise(knobs: dict[str, str], scale: float) -> float:
    """Deterministic seed noise: same config and seed -> same value."""
    key = json.dumps(sorted((k, v) for k, v in knobs.items() if k not in NOT_KNOBS)).encode()
    h = zlib.crc32(key) / 2**32
    return (h - 0.5) * 2 * scale


#: The fake's quality landscapes (``VRAMSWEEP_FAKE={"landscape": ...}``): rank's and precision's loss terms.
LANDSCAPES = ("rank_helps", "rank_hurts", "unrelated")


def _quality_terms(shape: str, r: float, bits: int) -> float:
    """The loss terms of rank and precision on landscape ``shape``."""
    if shape == "rank_hurts":
        return 0.02 * math.log2(max(r, 1)) + (0.03 if bits < 8 else 0.0)
    if shape == "unrelated":
        return 0.0
    if shape != "rank_helps":
        raise ValueError(f"landscape={shape!r} (allowed: {', '.join(LANDSCAPES)})")
    return 0.25 / math.sqrt(r) + (0.03 if bits < 8 else 0.0)


def landscape(knobs: dict[str, str]) -> dict[str, float]:
    """Deterministic metrics of a config (the fake's ground truth)."""
    shape = str(_env().get("landscape", "rank_helps"))
    quant = _group(knobs, "quant")
    bits = BITS.get(quant, 16)
    r = _num(knobs, "adapter.r")
    lr = _num(knobs, "train.lr")
    mb = _num(knobs, "train.micro_batch")
    seq = _num(knobs, "context.max_tokens")
    ckpt = _group(knobs, "checkpointing") == "on"
    opt = _group(knobs, "optimizer")
    adapter = _group(knobs, "adapter")
    trainable = BASE_PARAMS if adapter == "full" else 4 * 2 * 256 * r * 4 * 7 / 4
    params_b = BASE_PARAMS * bits / 8
    grads_b = trainable * 4
    opt_b = trainable * OPT_BYTES.get(opt, 8)
    act_b = (
        mb * seq * 256 * 4 * (34 if not ckpt else 6) * (0.6 if _group(knobs, "attention") != "eager" else 1.0)
    )
    logits_b = mb * seq * 4096 * 6
    peak = params_b + grads_b + opt_b + act_b + logits_b
    # loss: best lr ~ 1e-3 (log-quadratic), rank helps a little, 4-bit costs a little, adafactor worse
    lr_term = 0.35 * (math.log10(max(lr, 1e-8)) + 3.0) ** 2
    loss = 2.0 + lr_term + _quality_terms(shape, r, bits) + (0.05 if opt == "adafactor" else 0.0)
    loss += _noise(knobs, 0.05 if shape == "unrelated" else 0.004)
    if adapter == "rslora":
        loss -= 0.02 * math.log2(max(r, 1) / 8 + 1)
    tok_s = 700.0 * (16 / bits if bits >= 8 else 0.65) * (0.75 if ckpt else 1.0) / (1 + r / 512)
    step_cost = (mb * seq) / tok_s
    return {
        "peak_memory_bytes": float(peak),
        "eval_loss": float(loss),
        "tokens_per_s": float(tok_s),
        "step_time_s": float(step_cost),
        "params": params_b,
        "grads": grads_b,
        "optimizer": opt_b,
        "activations": act_b + logits_b,
    }


def _env() -> dict[str, Any]:
    raw = os.environ.get("VRAMSWEEP_FAKE")
    return json.loads(raw) if raw else {}


def _touch(env: dict[str, Any], what: str, trial: int | None) -> None:
    if env.get("marker_dir"):
        Path(env["marker_dir"]).mkdir(parents=True, exist_ok=True)
        Path(env["marker_dir"], f"{what}-{trial}").write_text(str(os.getpid()))


def fake_trial(
    overrides: Sequence[str],
    *,
    sweep: str | None = None,
    trial: int | None = None,
    reporter: Callable[[int, float], bool] | None = None,
    result_path: str | None = None,
    **_: Any,
) -> dict[str, Any]:
    """A result dict with the shape of the real trial's, from :func:`landscape` (see module doc)."""
    env = _env()
    knobs = parse_overrides(overrides)
    faults = env.get("faults") or {}
    fault = faults.get(str(trial))
    if fault is None:  # faults keyed by an override hit the same point whatever its trial number
        fault = next((v for k, v in faults.items() if "=" in k and k in overrides), None)
    if fault and fault.endswith("_once"):  # the first run of the point only (a retry runs clean)
        flag = Path(env.get("marker_dir") or ".", f"once-{zlib.crc32(repr(sorted(overrides)).encode())}")
        if flag.exists():
            fault = None
        else:
            flag.parent.mkdir(parents=True, exist_ok=True)
            flag.write_text(f"{os.getpid()} {os.environ.get('SLURM_JOB_ID', '')}")  # pid, SLURM job id
            fault = fault[: -len("_once")]
    _touch(env, "start", trial)
    steps = int(_num(knobs, "train.steps"))
    eval_every = int(_num(knobs, "train.eval_every"))
    truth = landscape(knobs)
    budget = _num(knobs, "hardware.budget_gib")
    res = new_result(
        sweep=sweep,
        trial=trial,
        overrides=list(overrides),
        config={"hardware": {"budget_gib": budget}, "train": {"steps": steps}},
    )
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "raise":
        raise RuntimeError("injected failure")
    if fault == "unsupported":
        from vramsweep.config.rules import UnsupportedError

        raise UnsupportedError("injected: this machine cannot run it", key="attention", allowed=["sdpa"])
    if fault == "oom":
        import torch

        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    sleep_per_step = float(env.get("sleep_s", 0.0)) / max(steps, 1)
    if fault == "hang":
        time.sleep(3600)
    init_loss = truth["eval_loss"] + 1.5
    ran = steps
    status = "ok"
    for step in range(1, steps + 1):
        if sleep_per_step:
            time.sleep(sleep_per_step)
        if eval_every and step % eval_every == 0 and step < steps and reporter is not None:
            frac = step / steps
            partial = truth["eval_loss"] + (init_loss - truth["eval_loss"]) * math.exp(-4 * frac)
            if reporter(step, partial):
                ran = step
                status = "pruned"
                break
    frac = ran / steps
    eval_loss = truth["eval_loss"] + (init_loss - truth["eval_loss"]) * (
        math.exp(-4 * frac) if ran < steps else 0.0
    )
    if fault == "nan":
        eval_loss = float("nan")
    res["status"] = status
    if status == "pruned":
        res["reason"] = f"pruned at step {ran}/{steps}"
    res["metrics"].update(
        {
            "peak_memory_bytes": truth["peak_memory_bytes"],
            "memory_kind": "cpu_tracked",
            "memory_breakdown_bytes": {k: truth[k] for k in ("params", "grads", "optimizer", "activations")}
            | {"other": 0.0},
            "tokens_per_s": truth["tokens_per_s"],
            "step_time_s": truth["step_time_s"],
            "mfu": None,
            "train_loss": eval_loss - 0.05,
            "initial_eval_loss": init_loss,
            "eval_loss": eval_loss,
            "eval_ppl": math.exp(eval_loss) if math.isfinite(eval_loss) else eval_loss,
            "task_score": None,
        }
    )
    if fault == "none_metric":
        res["metrics"]["eval_loss"] = None
    if fault == "bad_metric":
        res["metrics"]["eval_loss"] = "x"
    sim = float(env.get("step_s", 0.0))
    res["meta"] = {
        "device": "fake",
        "seed": int(_num(knobs, "train.seed")),
        "wall_s": (sim * truth["step_time_s"] / 1.46 * ran) if sim else None,
        "steps_run": ran,
        "fake": True,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # the GPU the sweeper gave it
    }
    _touch(env, "end", trial)
    return res
