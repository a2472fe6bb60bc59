"""``sweep.check=true``: ``vramsweep check`` (:mod:`vramsweep.check`) on the sweep's baseline as its
pre-flight, after the settings and inputs are checked and before the study, the sweep folder or any trial.

The baseline is the sweep's fixed overrides with ``sweep.baseline`` applied (a search: the base config).
Each line is printed as it is for ``vramsweep check``; a FAIL stops the sweep with one line (exit 2, nothing
written: an existing study is left as it was); a pass is recorded in ``sweep.json`` (``check_result``: the
overrides checked and each line's name, verdict, figure and tolerance).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vramsweep.config.compose import ConfigError
from vramsweep.sweeper.space import merge_overrides


def baseline_overrides(plan: Any) -> list[str]:
    """What the sweep's baseline trial is composed from (its seed aside)."""
    return merge_overrides(plan.fixed, plan.baseline)


def check_precheck_design(sweep: Any) -> None:
    """``sweep.check=true`` on a ``max_context`` design (no baseline: its trials probe memory): refused."""
    if sweep.check and sweep.design == "max_context":
        raise ConfigError(
            "sweep.check=true does not apply to design max_context (it has no baseline; its trials probe "
            "memory): run vramsweep check on one of its configs instead",
            key="sweep.check",
            allowed=["false"],
        )


def run_precheck(plan: Any, say: Callable[[str], None] = print) -> Any:
    """The plan, with ``check_result`` when ``sweep.check`` is on; :class:`ConfigError` on a FAIL."""
    if not plan.check:
        return plan
    from vramsweep import (
        check,  # torch and a model build: only when sweep.check is on (a sweeper starts light)
    )

    overrides = baseline_overrides(plan)
    cfg = check.checked_config(overrides, say_data=False)  # a refused sweep: its one error line
    say(f"vramsweep: sweep.check: {check.headline(cfg)}")
    lines, notes = check.checks_on(cfg)
    for text in [f"note: {n}" for n in notes] + [str(x) for x in lines]:
        say(f"vramsweep: sweep.check: {text}")
    failed = [x for x in lines if not x.ok]
    if failed:
        more = f" (and {len(failed) - 1} more FAIL)" if len(failed) > 1 else ""
        raise ConfigError(
            f"sweep.check: the baseline ({' '.join(plan.baseline) or 'the base config'}) fails vramsweep "
            f"check: {failed[0]}{more}; no trial ran and nothing was written (sweep.check=false skips it)",
            key="sweep.check",
        )
    result = [{"name": x.name, "ok": x.ok, "figure": x.figure, "tolerance": x.tolerance} for x in lines]
    return replace(plan, check_result={"overrides": overrides, "lines": result, "notes": notes})
