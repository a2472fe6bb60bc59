"""Settings the user left unset, fitted to the run at compose time.

``train.warmup_steps`` and ``train.measure_warmup_steps`` default to ``null``: 2 each, shrunk to fit a short
run (``train.steps=1`` trains and times its one step). A value the user gave (command line, sweep file,
experiment, their own ``train`` option) is kept as given, and the rules refuse it when it does not fit.
The shrink is said once, on stderr, per command (its child processes inherit the mark).
"""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig, open_dict

#: The default LR warm-up, in optimizer steps, when ``train.warmup_steps`` is unset (at most half the run).
WARMUP_STEPS = 2
#: The default of steps left out of tokens/s when ``train.measure_warmup_steps`` is unset (at least one
#: step stays measured).
MEASURE_WARMUP_STEPS = 2
#: Notes already said by this command (inherited by the trial processes it starts).
SAID_ENV = "VRAMSWEEP_SAID"


def say_once(key: str, text: str) -> bool:
    """Print ``text`` on stderr unless ``key`` was said by this process or the one that started it.
    Returns whether it was printed."""
    said = os.environ.get(SAID_ENV, "").split(",")
    if key in said:
        return False
    os.environ[SAID_ENV] = ",".join(k for k in [*said, key] if k)
    print(text, file=sys.stderr, flush=True)
    return True


def fitted_warmups(steps: int) -> tuple[int, int]:
    """``(warmup_steps, measure_warmup_steps)`` for an unset pair: the defaults, shrunk so that the LR
    warm-up is at most half of ``steps`` and at least one step is measured."""
    steps = max(int(steps), 1)
    return min(WARMUP_STEPS, steps // 2), min(MEASURE_WARMUP_STEPS, steps - 1)


def fit_unset(cfg: DictConfig) -> list[str]:
    """Fill the unset (``null``) warm-ups of ``cfg.train`` from :func:`fitted_warmups`; say once when a
    default was shrunk. Returns the ``key=value`` settings that were shrunk (empty when none was)."""
    t = cfg.get("train")
    if t is None or "warmup_steps" not in t:
        return []
    steps = t.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool):
        steps = 1  # a bad value: the rules name it; the warm-ups must not fail first
    warm, measure = fitted_warmups(steps)
    shrunk = []
    with open_dict(cfg):
        for key, value, default in (
            ("warmup_steps", warm, WARMUP_STEPS),
            ("measure_warmup_steps", measure, MEASURE_WARMUP_STEPS),
        ):
            if t.get(key) is None:
                t[key] = value
                if value != default:
                    shrunk.append(f"train.{key}={value}")
    if shrunk:
        say_once(
            "short-run-warmups",
            f"vramsweep: note: train.steps={steps} is shorter than the default warm-ups: "
            f"{', '.join(shrunk)} (set train.warmup_steps / train.measure_warmup_steps to choose)",
        )
    return shrunk
