"""Effects measured against noise (issue 14): seed repeats by default for quality ablations, significance
marks in the ablation table, ties within noise in ``best``/``pick``, throughput under load, and
importances that drop metrics whose differences are noise.

Every sweep is fabricated from result JSONs (``test_report`` helpers), with numbers chosen so the test
statistics can be checked by hand; the arithmetic is in the comments.
"""

from __future__ import annotations

from vramsweep.sweeper.design import build_design
from vramsweep.sweeper.engine import compose_sweep
from vramsweep.sweeper.settings import resolve_settings


# ---------------------------------------------------------------------------------------------
# default repeats
# ---------------------------------------------------------------------------------------------
def _settings(*args: str):
    sweeper, task, _ = compose_sweep(list(args))
    return resolve_settings(sweeper, task, sweep_file=task["sweep"]["name"])


def test_quality_ablations_default_to_three_seeds_memory_speed_ones_to_one():
    # optimizer.yaml: ablation with eval_loss among its objectives and no sweep.repeats
    s = _settings("sweep=optimizer")
    assert s.repeats == 3
    pts = build_design(
        s.design,
        dims=[],
        baseline=s.baseline,
        factors=s.factors,
        stack=s.stack,
        repeats=s.repeats,
        base_seed=0,
    )
    seeds = {ov for p in pts for ov in p.overrides if ov.startswith("train.seed=")}
    assert len(pts) == 3 * (1 + len(s.factors)) and seeds == {"train.seed=0", "train.seed=1", "train.seed=2"}
    # repeat-major: every point once before any point again (a cut-short sweep still covers each point,
    # and speed measurements of one point are spread over the sweep instead of back to back)
    assert [p.design["repeat"] for p in pts] == [r for r in range(3) for _ in range(1 + len(s.factors))]
    # no quality objective: one seed (memory is deterministic; speed repeats are asked for explicitly)
    assert (
        _settings("sweep=optimizer", "hydra.sweeper.objectives=[peak_memory_bytes,tokens_per_s]").repeats == 1
    )
    # an explicit sweep.repeats wins
    assert _settings("sweep=optimizer", "+sweep.repeats=1").repeats == 1
    # the demo asks for 2 (CPU cost), the fewest that measure noise
    assert _settings("sweep=demo").repeats == 2
