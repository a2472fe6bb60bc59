"""Knob hooks (vramsweep.knobs.registry): the build, the loop's loss and the estimator take what a
registered knob says, with no knob-specific branch of their own."""

from __future__ import annotations

import pytest

from vramsweep.config import compose
from vramsweep.knobs import registry
from vramsweep.knobs.registry import KnobHooks

pytestmark = pytest.mark.usefixtures("embedded_model_dir")


@pytest.fixture()
def probe():
    """A throw-away knob, on when train.seed == 4242: tags the model, replaces the loss, sets a field."""
    calls = []

    def build(cfg, model, device):
        model._probe_knob = True
        calls.append("build")
        return {"tagged": True}

    def loss(cfg, model):
        def fn(ids, mask, labels):
            calls.append("loss")
            return model(input_ids=ids, attention_mask=mask, labels=labels).loss * 0.0

        return fn

    hooks = KnobHooks(
        name="probe",
        active=lambda cfg: int(cfg.train.seed) == 4242,
        build=build,
        loss=loss,
        estimate=lambda cfg: {"mlp_tile": 7},
    )
    registry.register(hooks)
    try:
        yield calls
    finally:
        registry._HOOKS.pop("probe", None)


def test_long_context_knobs_are_registered():
    names = {h.name for h in registry.registered()}
    assert {"offload", "mlp_tiles", "loss_chunks"} <= names
    cfg = compose(["checkpointing=offload", "tiling=on"])
    assert {h.name for h in registry.active(cfg)} == {"offload", "mlp_tiles", "loss_chunks"}
    assert registry.active(compose([])) == []


def test_a_registered_knob_changes_build_loss_and_estimate(probe):
    from vramsweep.estimate import knobs_from_cfg
    from vramsweep.knobs import build_model

    cfg = compose(["train.seed=4242"])
    built = build_model(cfg)
    assert built.model._probe_knob and built.notes["knobs"] == {"probe": {"tagged": True}}
    assert knobs_from_cfg(cfg).mlp_tile == 7
    off = compose([])
    assert knobs_from_cfg(off).mlp_tile == 0 and "probe" not in build_model(off).notes["knobs"]

    import torch

    ids = torch.randint(3, 100, (1, 16))
    loss = registry.loss_fn(cfg, built.model)(ids, None, ids)
    assert float(loss) == 0.0 and probe == ["build", "loss"]


def test_the_trial_loop_uses_the_registered_loss(probe, tmp_path):
    from conftest import FAST
    from vramsweep.trial import run_trial

    res = run_trial(compose([*FAST, "train.seed=4242", f"results_dir={tmp_path}"]))
    assert res["status"] == "ok", res["reason"]
    assert res["metrics"]["train_loss"] == 0.0 and probe.count("loss") == 4


def test_two_knobs_replacing_the_loss_are_refused(probe):
    registry.register(KnobHooks(name="probe2", active=lambda cfg: True, loss=lambda cfg, m: None))
    try:
        with pytest.raises(ValueError, match="probe.*probe2"):
            registry.loss_fn(compose(["train.seed=4242"]), object())
    finally:
        registry._HOOKS.pop("probe2", None)
