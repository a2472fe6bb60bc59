"""``sweep.design: max_context`` — the longest context each config trains at within the memory budget.

For each config of the sweep file's ``sweep.configs`` (override lists, on top of the fixed overrides):

1. **Predict**: the estimator's longest ``context.max_tokens`` whose estimate fits ``hardware.budget_gib``
   (:func:`vramsweep.estimate.max_context`), rounded down to the search grid
   (multiples of ``sweep.max_context.step`` within ``[min, max]``).
2. **Confirm with real trials**: run the trial at the predicted length; while it fits, step up (doubling
   the step), while it does not, step down (doubling); then bisect between the last length that fit and
   the first that did not, until they are one grid step apart. "Fits" = status ``ok`` and measured peak
   ≤ the budget; ``oom`` or a peak over the budget does not fit; any other status ends that config's
   search with the reason.

Every probe is a real trial in its own process (the sweep's isolation: warm fork server, spawn or
in-process), its result JSON in ``<sweep dir>/trials/``. A re-run reuses the probes already measured
(same overrides), so an interrupted search continues where it stopped. The answer is right by
construction: the reported length's trial fitted and the next grid step's trial did not (or the next step
is past ``max``). Written: ``max_context.json`` / ``.md`` / ``.csv`` in the sweep folder, and printed.
Trials use random tokens of exactly the probed length when ``data=random`` (documents may be shorter).
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError, compose
from vramsweep.config.errors import error_line
from vramsweep.config.rules import validate
from vramsweep.estimate import max_context as predict
from vramsweep.record.feasibility import feasible
from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import atomic_write_json, atomic_write_text, write_result
from vramsweep.record.status import Status
from vramsweep.record.units import GIB
from vramsweep.sweeper.isolation import make_runner
from vramsweep.sweeper.settings import SweepConfig, SweeperConf, sweeper_conf
from vramsweep.sweeper.space import override_key
from vramsweep.sweeper.trialproc import TrialSpec


def _fits(result: dict[str, Any], budget_bytes: int) -> bool | None:
    """True/False when the probe answers the question (the feasibility rule of
    :mod:`vramsweep.record.feasibility`; ``oom`` does not fit), None when it failed for another reason."""
    status = result.get("status")
    if status == Status.OOM:
        return False
    if status != Status.OK:
        return None
    return feasible(status, (result.get("metrics") or {}).get(M.PEAK_MEMORY_BYTES), budget_bytes / GIB)


class _Prober:
    def __init__(self, runner, sweep_dir: Path, name: str, conf: SweeperConf, budget_bytes: int, say):
        self.runner = runner
        self.dir = sweep_dir
        self.name = name
        self.conf = conf
        self.budget = budget_bytes
        self.say = say
        self.number = 0
        self.known: dict[tuple[str, ...], dict[str, Any]] = {}
        for path in sorted((sweep_dir / "trials").glob("*.json")):
            try:
                res = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            self.number = max(self.number, int(res.get("trial") or 0) + 1)
            if res.get("status") is not None and (res.get("meta") or {}).get("max_context_probe"):
                self.known[tuple(res.get("overrides") or [])] = res

    def probe(self, overrides: list[str], tokens: int) -> dict[str, Any]:
        over = [*overrides, f"context.max_tokens={tokens}"]
        if tuple(over) in self.known:
            return self.known[tuple(over)]
        number = self.number
        self.number += 1
        spec = TrialSpec(
            number=number,
            trial_id=-1,
            slot=number,
            overrides=over,
            result_path=str(self.dir / "trials" / f"{number:04d}.json"),
            sweep_name=self.name,
            study_name=self.name,
            storage="",
            objectives=[],
            trial_fn=self.conf.trial_fn,
            design={"role": "max_context", "tokens": tokens},
            budget_gib=self.budget / GIB,
            log_path=None
            if self.conf.isolation == "inprocess"
            else str(self.dir / "trials" / f"{number:04d}.log"),
            parent_pid=os.getpid(),
            env=dict(os.environ),
            cwd=os.getcwd(),
        )
        t0 = time.perf_counter()
        rep = self.runner.run(spec, timeout_s=self.conf.timeout_s)
        res = rep.result
        res.setdefault("meta", {})["max_context_probe"] = {"tokens": tokens}

        write_result(spec.result_path, res)
        self.known[tuple(over)] = res
        fit = _fits(res, self.budget)
        peak = (res.get("metrics") or {}).get(M.PEAK_MEMORY_BYTES)
        peak_txt = f"{peak / GIB:.3f} GiB" if peak else "-"
        verdict = {True: "fits", False: "does not fit", None: f"{res.get('status')}: {res.get('reason')}"}[
            fit
        ]
        self.say(
            f"  trial {number:04d}: {tokens:,} tokens: {verdict} (peak {peak_txt}, "
            f"{time.perf_counter() - t0:.1f} s)"
        )
        return res


class _GridSearch:
    """One config's probes on the grid ``lo + k*step`` within ``[lo, hi]``: the lengths that fit, those that
    did not, and ``error``, the reason of a probe that failed otherwise (it ends the search)."""

    def __init__(self, prober: _Prober, overrides: list[str], lo: int, hi: int, step: int):
        self.prober = prober
        self.overrides = overrides
        self.lo, self.hi, self.step = lo, hi, step
        self.fits: dict[int, dict] = {}
        self.fails: dict[int, dict] = {}
        self.error: str | None = None

    def snap(self, t: int) -> int:
        """``t`` rounded down to the grid, clamped to ``[lo, hi]``."""
        return max(self.lo, min(self.hi, self.lo + ((t - self.lo) // self.step) * self.step))

    def run(self, t: int) -> bool | None:
        """Probe ``t`` tokens and file the result under ``fits`` / ``fails`` (None: ``error`` says why)."""
        res = self.prober.probe(self.overrides, t)
        f = _fits(res, self.prober.budget)
        if f is None:
            self.error = f"{res.get('status')} at {t} tokens: {res.get('reason')}"
        elif f:
            self.fits[t] = res
        else:
            self.fails[t] = res
        return f

    def climb(self, t: int) -> bool:
        """From ``t`` (which fits), step up, doubling the step, until a length does not fit or ``hi`` fits;
        False when a probe failed otherwise."""
        jump = self.step
        while t < self.hi:
            nxt = self.snap(min(self.hi, t + jump))
            if nxt == t:
                break
            r = self.run(nxt)
            if r is None:
                return False
            if not r:
                break
            t, jump = nxt, jump * 2
        return True

    def descend(self, t: int) -> bool:
        """From ``t`` (which does not fit), step down, doubling the step, until a length fits or ``lo`` does
        not; False when a probe failed otherwise."""
        jump = self.step
        while t > self.lo:
            nxt = self.snap(max(self.lo, t - jump))
            r = self.run(nxt)
            if r is None:
                return False
            if r:
                break
            t, jump = nxt, jump * 2
        return True

    def bisect(self) -> None:
        """Bisect between the longest fit and the shortest fail above it until they are one grid step apart
        (or a probe fails otherwise)."""
        while self.fits and self.fails:
            good = max(self.fits)
            above = [x for x in self.fails if x > good]
            if not above:
                break
            bad = min(above)
            if bad - good <= self.step:
                break
            mid = self.snap(good + ((bad - good) // self.step // 2) * self.step)
            if mid in (good, bad):
                break
            if self.run(mid) is None:
                break


def search_config(prober: _Prober, overrides: list[str], predicted: int, lo: int, hi: int, step: int) -> dict:
    """Exponential steps from the prediction, then bisection on the grid ``lo + k*step``."""
    search = _GridSearch(prober, overrides, lo, hi, step)
    t = search.snap(predicted)
    f = search.run(t)
    if f is not None and (search.climb(t) if f else search.descend(t)):
        search.bisect()
    return _summary(overrides, predicted, search.fits, search.fails, hi, step, search.error)


def _summary(overrides, predicted, fits, fails, hi, step, error) -> dict[str, Any]:
    best = max(fits) if fits else None
    nxt = min((x for x in fails if best is None or x > best), default=None)
    row: dict[str, Any] = {
        "config": " ".join(overrides) or "(fixed overrides only)",
        "overrides": list(overrides),
        "predicted_tokens": predicted,
        "max_tokens": best,
        "next_tokens": nxt,
        "next_status": None,
        "probes": len(fits) + len(fails),
        "reason": error,
    }
    if best is not None:
        m = fits[best].get("metrics") or {}
        row.update(
            peak_gib=(m.get(M.PEAK_MEMORY_BYTES) or 0) / GIB,
            **{M.TOKENS_PER_S: m.get(M.TOKENS_PER_S), M.MEMORY_KIND: m.get(M.MEMORY_KIND)},
            trial=fits[best].get("trial"),
        )
        if nxt is None and best < hi:
            row["reason"] = row["reason"] or "no failing length found above it"
        if nxt is None and best >= hi:
            row["reason"] = row["reason"] or f"fits at sweep.max_context.max={hi}: the real limit is higher"
    if nxt is not None:
        r = fails[nxt]
        peak = (r.get("metrics") or {}).get(M.PEAK_MEMORY_BYTES)
        row["next_status"] = (
            r.get("status") if r.get("status") != Status.OK else f"over budget ({peak / GIB:.3f} GiB)"
        )
    if best is None and error is None:
        row["reason"] = "not even sweep.max_context.min fits"
    row["confirmed"] = best is not None and (nxt is not None and nxt - best <= step)
    return row


def _table_md(rows: list[dict], budget_gib: float, device_note: str) -> str:
    out = io.StringIO()
    out.write(f"# Max context per config (budget {budget_gib:g} GiB{device_note})\n\n")
    out.write(
        "| config | predicted | max tokens (fits) | next step | peak GiB at max | tokens/s at max "
        "| probes | note |\n"
    )
    out.write("|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        nxt = f"{r['next_tokens']:,} ({r['next_status']})" if r.get("next_tokens") else "-"
        mx = f"{r['max_tokens']:,}" if r.get("max_tokens") else "-"
        peak = f"{r['peak_gib']:.3f}" if r.get("peak_gib") is not None and r.get("max_tokens") else "-"
        tps = f"{r[M.TOKENS_PER_S]:,.0f}" if r.get(M.TOKENS_PER_S) else "-"
        out.write(
            f"| {r['config']} | {r['predicted_tokens']:,} | {mx} | {nxt} | {peak} | {tps} | {r['probes']} | "
            f"{r.get('reason') or ('confirmed' if r.get('confirmed') else '')} |\n"
        )
    return out.getvalue()


@dataclass
class MaxContextPlan:
    """A validated ``max_context`` sweep: bounds, budget, and each config with its predicted length; ``conf``
    the typed ``hydra.sweeper.*`` settings (the main driver's :class:`SweeperConf`)."""

    name: str
    lo: int
    hi: int
    step: int
    budget_bytes: int
    fixed: list[str]
    configs: list[tuple[list[str], list[str], int]] = field(
        default_factory=list
    )  # (overrides, config, predicted)
    conf: SweeperConf = field(default_factory=SweeperConf)


def plan_max_context(
    sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str]
) -> MaxContextPlan:
    """Check everything (bounds, every config composes and passes the rules, a budget) and predict each
    config's max context; raise ``ConfigError`` before anything is written."""

    conf = sweeper_conf(sweeper_cfg)  # every hydra.sweeper.* key: type and range (timeout_s, n_jobs, ...)
    sweep = SweepConfig.from_dict(task_cfg.get("sweep"))
    name = str(conf.study_name or sweep.name or "max_context")
    bounds = sweep.max_context
    try:
        lo, hi, step = (
            int(bounds.get("min", 256)),
            int(bounds.get("max", 131072)),
            int(bounds.get("step", 1024)),
        )
    except (TypeError, ValueError):
        raise ConfigError(
            "sweep.max_context needs integers min, max, step", key="sweep.max_context"
        ) from None
    if not (0 < lo <= hi and step > 0):
        raise ConfigError(
            f"sweep.max_context: need 0 < min <= max and step > 0 (got min={lo}, max={hi}, step={step})",
            key="sweep.max_context",
        )
    # sweep=<name> stays (its defaults list picks model/quant/hardware/data for every probe); sweep.* and
    # hydra.* settings are the driver's, not the trial's
    fixed = [a for a in arguments if not override_key(a).startswith(("sweep.", "hydra."))]
    fixed = [*sweep.fixed, *fixed]
    configs = [list(c) if isinstance(c, list | tuple) else str(c).split() for c in (sweep.configs or [[]])]
    plan = MaxContextPlan(name, lo, hi, step, 0, fixed, conf=conf)
    for conf in configs:
        over = [*fixed, *conf]
        try:
            cfg = compose(over, rules="none")
            # what this machine lacks (CUDA, Liger) shows as an unsupported probe, not a planning error
            validate(cfg, machine=False)
            est = predict(cfg)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(
                f"max_context config {' '.join(conf) or '(base)'}: {exc}", key="sweep.configs"
            ) from None
        plan.budget_bytes = int(float(cfg.hardware.budget_gib) * GIB)
        plan.configs.append((over, conf, int(est["max_tokens"])))
    return plan


def _write_tables(sweep_dir: Path, plan: MaxContextPlan, rows: list[dict[str, Any]], known: dict) -> str:
    """``max_context.json``/``.md``/``.csv`` from the rows so far (after each config: a budget-limited run
    keeps what it finished); returns the Markdown table."""

    device = next(
        (
            f", measured on {r['meta']['device']}"
            for r in known.values()
            if (r.get("meta") or {}).get("device")
        ),
        "",
    )
    atomic_write_json(
        sweep_dir / "max_context.json", {"budget_bytes": plan.budget_bytes, "fixed": plan.fixed, "rows": rows}
    )
    md = _table_md(rows, plan.budget_bytes / GIB, device)
    atomic_write_text(sweep_dir / "max_context.md", md)
    buf = io.StringIO()
    cols = [
        "config",
        "predicted_tokens",
        "max_tokens",
        "next_tokens",
        "next_status",
        "peak_gib",
        M.TOKENS_PER_S,
        "probes",
        "confirmed",
        "reason",
    ]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(sweep_dir / "max_context.csv", buf.getvalue())
    return md


def run_max_context(
    sweeper_cfg: dict[str, Any], task_cfg: dict[str, Any], arguments: list[str], *, runner=None
) -> int:
    """Run a ``max_context`` sweep; 0 done, 2 bad config (nothing written)."""

    def say(text: str) -> None:
        print(text, flush=True)

    try:
        plan = plan_max_context(sweeper_cfg, task_cfg, arguments)
    except ConfigError as exc:
        print(error_line("train", str(exc)), file=sys.stderr)
        return 2
    results_dir = str(task_cfg.get("results_dir") or "results")
    conf = plan.conf
    sweep_dir = Path(os.path.abspath(conf.sweep_dir or Path(results_dir) / "sweeps" / plan.name))
    (sweep_dir / "trials").mkdir(parents=True, exist_ok=True)
    isolation = conf.isolation
    runner = runner or make_runner(isolation, list(conf.preload))
    say(
        f"vramsweep: '{plan.name}': max-context search over {len(plan.configs)} config(s), "
        f"{plan.lo:,}..{plan.hi:,} tokens in steps of {plan.step:,}, budget {plan.budget_bytes / GIB:g} "
        f"GiB; each probe is a real trial ({isolation})"
    )
    runner.start()
    prober = _Prober(runner, sweep_dir, plan.name, conf, plan.budget_bytes, say)
    rows: list[dict[str, Any]] = []
    try:
        for over, conf, predicted in plan.configs:
            say(f"config {' '.join(conf) or '(base)'}: estimator predicts {predicted:,} tokens")
            rows.append(search_config(prober, over, predicted, plan.lo, plan.hi, plan.step))
            rows[-1]["config"] = " ".join(conf) or "(base)"
            md = _write_tables(sweep_dir, plan, rows, prober.known)
    finally:
        runner.stop()
    say(md)
    say(f"results: {sweep_dir}")
    return 0
