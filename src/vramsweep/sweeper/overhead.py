"""The runner's per-trial overhead probe, run as ``python -m vramsweep.sweeper.runner --overhead``.

Times a no-op trial (:func:`noop_trial`, which imports what a real trial imports) through each isolation
of :mod:`.isolation`, as the sweeper sees it (start to result told). The command-line entry is the thin
:mod:`.runner`, which nothing imports: the fork server preloads this module (for :func:`noop_trial`), and
a module that is both preloaded and run with ``-m`` makes runpy warn ("found in sys.modules") in every
trial process.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any

from vramsweep.record.metrics import MetricName as M
from vramsweep.record.result import new_result
from vramsweep.record.status import Status
from vramsweep.sweeper.isolation import cuda_host, make_runner
from vramsweep.sweeper.settings import DEFAULT_PRELOAD
from vramsweep.sweeper.trialproc import TrialSpec


def noop_trial(overrides: list[str], **_: Any) -> dict[str, Any]:
    """Imports what a real trial imports (``VRAMSWEEP_PRELOAD``) and returns ``ok`` at once (overhead
    probe)."""

    for name in [m for m in os.environ.get("VRAMSWEEP_PRELOAD", "").split(",") if m]:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    res = new_result(status=Status.OK.value, overrides=list(overrides))
    res["metrics"][M.EVAL_LOSS] = 1.0
    return res


def measure_overhead(
    isolation: str = "fork", n: int = 5, preload: list[str] | None = None, workdir: str | None = None
) -> dict[str, Any]:
    """Per-trial fixed cost: wall time of a no-op trial, as the sweeper sees it (start to result told).

    Returns:
        ``{"isolation", "n", "warmup_s", "per_trial_s": [...], "median_s"}``.
    """
    import statistics
    import tempfile

    modules = list(DEFAULT_PRELOAD if preload is None else preload)
    os.environ["VRAMSWEEP_PRELOAD"] = ",".join(modules)  # what the no-op trial imports (free when preloaded)
    runner = make_runner(isolation, modules)
    runner.start()
    times: list[float] = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            for i in range(n):
                spec = TrialSpec(
                    number=i,
                    trial_id=-1,
                    slot=i,
                    overrides=[],
                    result_path=f"{tmp}/{i:04d}.json",
                    sweep_name="overhead",
                    study_name="overhead",
                    storage="",
                    objectives=[],
                    trial_fn="vramsweep.sweeper.overhead:noop_trial",
                    parent_pid=os.getpid(),
                    env=dict(os.environ),
                    cwd=os.getcwd(),
                )
                t0 = time.perf_counter()
                runner.run(spec, tick_s=0.05)
                times.append(time.perf_counter() - t0)
        finally:
            runner.stop()
    return {
        "isolation": getattr(runner, "name", isolation),
        "n": n,
        "cuda_host": cuda_host(),
        "preload": getattr(runner, "server_preload", None) or None,
        "left_out": getattr(runner, "left_out", None) or None,
        "fallback_reason": getattr(runner, "fallback_reason", None),
        "warmup_s": getattr(runner, "warmup_s", None),
        "per_trial_s": [round(t, 4) for t in times],
        "median_s": round(statistics.median(times), 4),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m vramsweep.sweeper.runner --overhead [--n 5] [--isolation fork spawn]``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overhead", action="store_true", help="measure the per-trial fixed cost")
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--isolation", nargs="+", default=["fork", "spawn"])
    args = ap.parse_args(argv)
    if not args.overhead:
        ap.print_help()
        return 0
    for iso in args.isolation:
        print(json.dumps(measure_overhead(iso, args.n)))
    return 0
