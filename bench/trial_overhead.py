"""The sweeper's per-trial overhead: a no-op trial timed through each isolation, as the sweeper sees it.

Times a no-op trial (:func:`noop_trial`, which imports what a real trial imports) through each isolation
of ``vramsweep.sweeper.isolation`` (start to result told). The trial processes import this module by name
(``trial_overhead:noop_trial``): run as a script, its folder ``bench/`` is on ``sys.path`` and the trial
processes inherit it; a caller that imports it puts ``bench/`` there first (``scripts/gpu_smoke.py``).

Run:  python bench/trial_overhead.py [--n 5] [--isolation fork spawn] [--preload MODULE,...]
Prints one JSON line per isolation.
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

    from vramsweep.sweeper.isolation import cuda_host, make_runner
    from vramsweep.sweeper.settings import DEFAULT_PRELOAD
    from vramsweep.sweeper.trialproc import TrialSpec

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
                    trial_fn="trial_overhead:noop_trial",
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
    """``python bench/trial_overhead.py [--n 5] [--isolation fork spawn] [--preload MODULE,...]``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5, help="no-op trials per isolation (default: 5)")
    ap.add_argument("--isolation", nargs="+", default=["fork", "spawn"], help="default: fork spawn")
    ap.add_argument(
        "--preload",
        default=None,
        help="modules the fork server imports and each no-op trial imports, comma-separated "
        "(default: the sweeper's default preload)",
    )
    args = ap.parse_args(argv)
    preload = None if args.preload is None else [m for m in args.preload.split(",") if m]
    for iso in args.isolation:
        print(json.dumps(measure_overhead(iso, args.n, preload=preload)))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
