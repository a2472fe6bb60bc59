"""``vramsweep estimate [overrides] [--json] [--max-context]`` and
``vramsweep estimate --calibrate <sweep dir>``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from vramsweep.config import ConfigError, compose
from vramsweep.config.errors import error_line
from vramsweep.config.rules import check_fault_env, validate
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import read_json_file
from vramsweep.record.units import GIB, MIB

ROWS = ("params", "grads", "optimizer", "activations", "logits", "overhead")
LABELS = {
    "params": "params (weights + quant state + adapters)",
    "grads": "grads (alive at the peak)",
    "optimizer": "optimizer state",
    "activations": "activations (saved for backward)",
    "logits": "logits + loss",
    "overhead": "allocator reserve (reserved - allocated)",
}


def format_table(est: dict[str, Any], title: str = "") -> str:
    """Human-readable breakdown: component, GiB, % of total, % of the budget."""
    peak = est[M.PEAK_MEMORY_BYTES]
    budget = est.get("budget_bytes")
    lines = []
    if title:
        lines.append(title)
    head = f"{'component':<44}{'GiB':>10}{'% total':>10}{'% budget':>10}"
    lines += [head, "-" * len(head)]

    def row(label: str, v: int) -> str:
        pct = 100.0 * v / peak if peak else 0.0
        vb = f"{100.0 * v / budget:.1f}" if budget else "-"
        return f"{label:<44}{v / GIB:>10.3f}{pct:>10.1f}{vb:>10}"

    for k in ROWS:
        lines.append(row(LABELS[k], int(est["breakdown_bytes"].get(k, 0))))
    lines.append("-" * len(head))
    lines.append(row("peak", peak))
    if budget:
        verdict = "fits" if est["fits"] else "does NOT fit"
        req = est.get("required_bytes", peak)
        lines.append(
            f"budget {budget / GIB:.2f} GiB: {verdict} (required {req / GIB:.3f} GiB, headroom "
            f"{(budget - req) / GIB:+.2f} GiB; the reserve beyond it is released under pressure)"
        )
    else:
        lines.append("budget: none (hardware.budget_gib=0)")
    if est.get("host_bytes"):
        lines.append(
            f"host memory: {est['host_bytes'] / GIB:.3f} GiB beside the device ("
            + ", ".join(f"{n} {v / GIB:.3f} GiB" for n, v in (est.get("host_breakdown_bytes") or {}).items())
            + ")"
        )
    comp = est.get("components_bytes") or {}
    if comp:
        lines.append(
            "steady sizes: params {:.3f} GiB, grads {:.3f} GiB, optimizer {:.3f} GiB; trainable {:,} of {:,} "
            "params; peak phase: {}".format(
                comp.get("params", 0) / GIB,
                comp.get("grads", 0) / GIB,
                comp.get("optimizer", 0) / GIB,
                comp.get("trainable_params", 0),
                comp.get("model_params", 0),
                est.get("peak_phase"),
            )
        )
    if est.get("assumptions"):
        lines.append("assumptions:")
        lines += [f"  - {a}" for a in est["assumptions"]]
    return "\n".join(lines)


def format_max_context(res: dict[str, Any], title: str = "") -> str:
    """Human-readable answer of ``--max-context``."""
    e, nxt = res["estimate"], res["next_estimate"]
    budget = res["budget_bytes"]
    lines = [title] if title else []
    if res["max_tokens"] == 0:
        lines.append(
            f"max context: 0 tokens -- even 1 token needs {e['required_bytes'] / GIB:.2f} GiB "
            f"> budget {budget / GIB:.2f} GiB"
        )
        return "\n".join(lines)
    lines.append(
        f"max context: {res['max_tokens']:,} tokens (context.max_tokens) within budget {budget / GIB:.2f} GiB"
    )
    lines.append(
        f"  at {res['max_tokens']:,}: required {e['required_bytes'] / MIB:,.1f} MiB, reserved peak "
        f"{e[M.PEAK_MEMORY_BYTES] / MIB:,.1f} MiB (peak phase: {e['peak_phase']})"
    )
    if nxt is not None:
        lines.append(
            f"  at {res['max_tokens'] + 1:,}: required {nxt['required_bytes'] / MIB:,.1f} MiB: does not fit"
        )
    else:
        lines.append(
            f"  (the search stops at {res['upper_bound']:,} tokens: the model's positions x rope.factor)"
        )
    lines.append("  every micro-batch is taken to be max_tokens long (train.micro_batch sequences per step)")
    return "\n".join(lines)


def run_estimate(overrides: list[str], *, as_json: bool, max_context: bool = False) -> int:
    """CLI body of ``vramsweep estimate``: 0 on success, 2 on a bad override (message on stderr).

    ``max_context``: print the longest ``context.max_tokens`` whose estimate fits ``hardware.budget_gib``
    instead of the breakdown (exit 2 without a budget).
    """
    from vramsweep.estimate import estimate
    from vramsweep.estimate import max_context as find_max_context
    from vramsweep.estimate.dims import check_model_config

    try:
        cfg = compose(list(overrides), rules="none")
        validate(cfg, machine=False)  # a GPU config is estimated on any machine
        check_fault_env()
        if str(cfg.model.source) == "path":
            check_model_config(str(cfg.model.path))  # names the file and line of a corrupt config.json
        if max_context:
            if float(cfg.hardware.budget_gib) <= 0:
                print(
                    error_line(
                        "estimate",
                        f"--max-context needs a memory budget, hardware.budget_gib={cfg.hardware.budget_gib} "
                        f"(hardware={cfg.hardware.name}); pick a profile with one (e.g. "
                        "hardware=rtx4080_16gb) or set hardware.budget_gib",
                    ),
                    file=sys.stderr,
                )
                return 2
            res = find_max_context(cfg)
        else:
            est = estimate(cfg)
    except ConfigError as exc:
        print(error_line("estimate", str(exc)), file=sys.stderr)
        return 2
    except (OSError, KeyError, ValueError) as exc:  # anything else unreadable
        print(error_line("estimate", f"{type(exc).__name__}: {exc}"), file=sys.stderr)
        return 2
    title = (
        f"estimate ({' '.join(overrides) or 'defaults'}): model={cfg.model.name}, "
        f"hardware={cfg.hardware.name}"
    )
    if max_context:
        if as_json:
            print(json.dumps(res, indent=2))
        else:
            print(format_max_context(res, title))
        return 0
    if as_json:
        print(json.dumps(est, indent=2))
    else:
        print(format_table(est, title))
    return 0


def _load_results(sweep_dir: Path) -> list[dict]:
    trials = sweep_dir / "trials"
    files = sorted(trials.glob("*.json")) if trials.is_dir() else sorted(sweep_dir.glob("**/result.json"))
    out = []
    for f in files:
        try:
            out.append(read_json_file(f))
        except (OSError, ValueError):  # unreadable, or nested too deeply: not a usable trial
            continue
    return out


def run_calibrate(sweep_dir: str) -> int:
    """CLI body of ``vramsweep estimate --calibrate <sweep dir>``: fit and store constants per device.

    Results are read from ``<sweep>/trials/*.json`` (or any ``result.json`` below the folder); the
    constants go to ``<results_dir>/calibration/<device>.json`` where ``results_dir`` is the folder
    above ``sweeps/`` (for a folder elsewhere, ``results/``). Returns 0 when at least one device was
    calibrated, 2 when the folder does not exist or no trial was usable (one error line).
    """
    from vramsweep.estimate.calibration import calibrate, save_calibration

    d = Path(sweep_dir)
    if not d.is_dir():
        print(f"vramsweep estimate: error: --calibrate {sweep_dir} is not a folder", file=sys.stderr)
        return 2
    results = _load_results(d)
    # docs/ESTIMATOR.md: <results_dir>/calibration/ -- the folder above sweeps/, else the default results/
    # (never calibration/ inside the folder it reads)
    results_dir = d.parent.parent if d.parent.name == "sweeps" else Path("results")
    keys = sorted(
        {
            (
                "cpu"
                if (r.get("config") or {}).get("hardware", {}).get("device") != "cuda"
                else str(r["config"]["hardware"]["name"])
            )
            for r in results
            if r.get("config")
        }
    )
    done = 0
    skipped: list[str] = []
    for key in keys:
        fit = calibrate(results, device_key=key)
        if not fit["n_trials"]:
            skipped.append(key)
            continue
        fit["source"] = str(d)
        try:
            path = save_calibration(results_dir, key, fit)
        except OSError as exc:  # a read-only results folder: one line, not a traceback
            where = Path(results_dir) / "calibration"
            print(
                f"vramsweep estimate: error: --calibrate: cannot write {where}/{key}.json "
                f"({exc.strerror or type(exc).__name__}); run it where {where} is writable",
                file=sys.stderr,
            )
            return 2
        before, after = fit["mean_abs_error_before"], fit["mean_abs_error_after"]
        print(
            f"{key}: {fit['n_trials']} trials, constants {fit['constants']}, mean |error| "
            f"{100 * before:.1f}% -> {100 * after:.1f}% -> {path}"
        )
        done += 1
    need = "need status ok, a measured peak and a loss-phase peak"
    if not done:
        print(
            f"vramsweep estimate: error: --calibrate: no usable trials in {sweep_dir} ({need})",
            file=sys.stderr,
        )
        return 2
    for key in skipped:
        print(f"{key}: no usable trials ({need})")
    return 0


def run_suggest(
    overrides: list[str],
    *,
    as_json: bool,
    max_context: bool = False,
    calibrate_dir: str | None = None,
    any_install: bool = False,
) -> int:
    """CLI body of ``vramsweep estimate [overrides] --suggest``: the cheapest knob changes that fit the budget
    (or, for a config that fits, its headroom and what the spare memory buys); 0 on success, 2 on bad input.

    ``calibrate_dir``: a sweep folder whose measured trials calibrate the memory constants (as ``--calibrate``
    does, without writing them) and the speed factors (:func:`vramsweep.estimate.suggest.fit_costs`).
    """
    from vramsweep.estimate.calibration import calibrate, device_key_for
    from vramsweep.estimate.dims import check_model_config
    from vramsweep.estimate.suggest import fit_costs, format_suggest, suggest

    try:
        cfg = compose(list(overrides), rules="none")
        validate(cfg, machine=False)
        check_fault_env()
        if str(cfg.model.source) == "path":
            check_model_config(str(cfg.model.path))
        if float(cfg.hardware.budget_gib) <= 0:
            raise ConfigError(
                f"--suggest needs a memory budget, hardware.budget_gib={cfg.hardware.budget_gib} "
                f"(hardware={cfg.hardware.name}); pick a profile with one (e.g. hardware=rtx4080_16gb) "
                "or set hardware.budget_gib"
            )
        calib: dict | None = None
        speed: dict[str, float] | None = None
        n_speed = 0
        if calibrate_dir is not None:
            d = Path(calibrate_dir)
            if not d.is_dir():
                raise ConfigError(f"--calibrate {calibrate_dir} is not a folder")
            results = _load_results(d)
            if not results:
                raise ConfigError(f"--calibrate {calibrate_dir}: no trial results in it (trials/*.json)")
            fit = calibrate(results, device_key=device_key_for(cfg))
            calib = fit if fit["n_trials"] else None
            speed, n_speed = fit_costs(results)
        res = suggest(
            cfg,
            with_max_context=max_context,
            calibration=calib if calib is not None else None,
            speed=speed,
            any_install=any_install,
        )
    except ConfigError as exc:
        print(error_line("estimate", str(exc)), file=sys.stderr)
        return 2
    except (OSError, KeyError, ValueError) as exc:
        print(error_line("estimate", f"{type(exc).__name__}: {exc}"), file=sys.stderr)
        return 2
    if calibrate_dir is not None:
        res["calibration_source"] = {
            "sweep": calibrate_dir,
            "memory_trials": int(calib["n_trials"]) if calib else 0,
            "speed_trials": n_speed,
            "speed_factors_fitted": sorted(speed or {}),
        }
    if as_json:
        print(json.dumps(res, indent=2))
        return 0
    title = (
        f"estimate --suggest ({' '.join(overrides) or 'defaults'}): model={cfg.model.name}, "
        f"hardware={cfg.hardware.name}"
    )
    text = format_suggest(res, title)
    if calibrate_dir is not None:
        src = res["calibration_source"]
        text += (
            f"\ncalibrated from {calibrate_dir}: memory constants from {src['memory_trials']} trials, speed "
            f"factors {', '.join(src['speed_factors_fitted']) or 'none (no knob varied enough)'} from "
            f"{src['speed_trials']} trials; every other figure is assumed"
        )
    print(text)
    return 0
