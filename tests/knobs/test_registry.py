"""Providers (vramsweep.knobs.registry): the build, the loop's loss and the estimator take what a
registered provider says, with no group- or knob-specific branch of their own; every config group that
changes what runs has one."""

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

    def build(cfg, b):
        b.model._probe_knob = True
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
        estimate=lambda cfg, e: {"mlp_tile": 7},
    )
    registry.register(hooks)
    try:
        yield calls
    finally:
        registry._HOOKS.pop("probe", None)


def test_long_context_knobs_are_registered():
    names = {h.name for h in registry.registered()}
    assert {"offload", "mlp_tiles", "loss_chunks", "attention_heads"} <= names
    cfg = compose(["checkpointing=offload", "tiling=on"])
    knobs = {h.name for h in registry.registered() if h.notes_in == "knobs" and h.build is not None}
    assert knobs == {"offload", "mlp_tiles", "loss_chunks", "attention_heads"}
    assert {h.name for h in registry.active(cfg)} & knobs == {"offload", "mlp_tiles", "loss_chunks"}
    grouped = compose(["tiling=on", "tiling.attention_heads=2"])
    assert {h.name for h in registry.active(grouped)} & knobs == {
        "mlp_tiles",
        "loss_chunks",
        "attention_heads",
    }
    assert {h.name for h in registry.active(compose([]))} & knobs == set()


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


# --- every group is a provider: the pipeline's order, the one place a new group registers

#: Groups with no provider of their own, and why (``tiling``'s knobs and ``rope`` have one).
NO_PROVIDER = {
    "logger": "where rows go (W&B or nowhere): the trial's callback, not the model",
    "sweep": "which trials run (the sweeper), not what one trial builds",
}
#: Groups that only set values: their provider has no hook that changes what runs (estimate only).
VALUES_ONLY = {"train", "context", "hardware", "optimizer"}


def _groups() -> set[str]:
    from vramsweep.config.paths import packaged_conf_dir

    return {p.name for p in packaged_conf_dir().iterdir() if p.is_dir() and not p.name.startswith("_")}


def test_every_config_group_has_a_provider_or_is_listed():
    by_group: dict[str, list] = {}
    for h in registry.registered():
        for g in h.groups:
            by_group.setdefault(g, []).append(h)
    groups = _groups()
    assert not set(by_group) - groups, "providers name groups that do not exist"
    assert not groups - set(by_group) - set(NO_PROVIDER), "a config group with no provider, unlisted"
    assert not set(by_group) & set(NO_PROVIDER)
    runs = ("patch", "load", "build", "loss", "wrap_loss", "data", "measure")
    for g, hooks in by_group.items():
        changes = any(getattr(h, stage) is not None for h in hooks for stage in runs)
        assert changes == (g not in VALUES_ONLY), g  # a group that only sets values says so in VALUES_ONLY
        assert all(h.estimate is not None for h in hooks if g in VALUES_ONLY), g


def test_the_pipeline_order_is_explicit():
    names = [h.name for h in registry.registered()]
    assert names[:10] == [
        "step",
        "attention",
        "rope",
        "quant",
        "vocab",
        "checkpointing",
        "adapter",
        "kernels",
        "optimizer",
        "model",  # loads with what the earlier load hooks set
    ]
    assert set(names[10:]) >= {"offload", "mlp_tiles", "loss_chunks"}  # on the finished model
    assert registry.STAGES == ("patch", "load", "build")
    # the one place the order is written: each provider runs at its module's line in PROVIDERS
    modules = [registry._MODULE[h.name] for h in registry.registered()]
    ours = [m for m in modules if m in registry.PROVIDERS]
    assert list(dict.fromkeys(ours)) == list(registry.PROVIDERS)
    assert modules[: len(ours)] == ours  # providers registered elsewhere (a test) come after them


def test_the_build_notes_keep_their_keys_and_order():
    from vramsweep.knobs import build_model

    notes = build_model(compose(["checkpointing=offload"])).notes
    assert list(notes) == [
        "device",
        "dtype",
        "kernels",
        "attn_implementation",
        "rope",
        "quantised_layers",
        "gradient_checkpointing",
        "adapter",
        "knobs",
        "trainable_params",
        "total_params",
    ]
    assert notes["kernels"] == "none" and notes["adapter"]["type"] == "lora" and "offload" in notes["knobs"]


@pytest.fixture()
def toy_group(monkeypatch):
    """A toy provider of every stage, on when train.seed == 4343, registered without touching the build
    or the estimator: it patches, sets a load keyword, notes what it saw, and sets an estimate field.
    Its place is its module's line in PROVIDERS: after the adapter, before Liger's check."""
    registry.registered()  # the providers' modules are imported before PROVIDERS gets this one
    after = registry.PROVIDERS.index("vramsweep.knobs.adapter") + 1
    monkeypatch.setattr(
        registry, "PROVIDERS", (*registry.PROVIDERS[:after], __name__, *registry.PROVIDERS[after:])
    )
    seen: list[str] = []

    def patch(cfg, b):
        seen.append("patch")
        return {"toy_patch": b.model is None}

    def load(cfg, b):
        seen.append("load")
        b.load_kwargs["attn_implementation"] = "eager"  # runs before the model provider loads
        return {}

    def build(cfg, b):
        seen.append("build")
        return {"toy": {"attn": b.model.config._attn_implementation, "adapter": b.notes["adapter"]["type"]}}

    def estimate(cfg, e):
        e.note("toy: counted as eager attention")
        return {"attention": "eager", "mlp_tile": e.fields["micro_batch"] * 3}

    registry.register(
        KnobHooks(
            name="toy",
            active=lambda cfg: int(cfg.train.seed) == 4343,
            patch=patch,
            load=load,
            build=build,
            estimate=estimate,
            groups=(),
            notes_in="build",
        )
    )
    try:
        yield seen
    finally:
        registry._HOOKS.pop("toy", None)


def test_a_toy_provider_needs_no_edit_of_the_build_or_the_estimator(toy_group):
    from vramsweep.estimate import knobs_from_cfg
    from vramsweep.knobs import build_model

    cfg = compose(["train.seed=4343", "attention=sdpa"])
    notes = build_model(cfg).notes
    assert toy_group == ["patch", "load", "build"]
    assert notes["toy_patch"] is True and notes["toy"] == {"attn": "eager", "adapter": "lora"}
    assert (
        notes["attn_implementation"] == "eager"
        and list(notes).index("toy") == list(notes).index("adapter") + 1
    )
    k = knobs_from_cfg(cfg)
    assert k.attention == "eager" and k.mlp_tile == 2 * 3 and "toy: counted as eager attention" in k.notes
    off = knobs_from_cfg(compose(["attention=sdpa"]))
    assert off.attention == "sdpa" and off.mlp_tile == 0


def test_the_estimator_imports_no_torch_through_the_providers():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from vramsweep.config import compose\n"
        "from vramsweep.estimate import estimate\n"
        "from vramsweep.knobs import registry\n"
        "estimate(compose(['kernels=liger', 'vocab=sliced', 'tiling=on', 'quant=nf4'], rules='none'))\n"
        "print(len(registry.registered()), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
