"""Sweep identity is pinned: a sweep made before a refactor of the settings resumes after it.

The identity (design, points or space, fixed overrides, objectives, trial function) is stored with the study
and names ad-hoc sweeps (``<keys>-<hash>``); a change of its hash would make every existing study refuse to
resume (or start a new folder). The hashes below were recorded before the settings were refactored.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from vramsweep.sweeper.plan import identity_hash, plan_from_args

FAKE = ["hydra.sweeper.trial_fn=fakes:fake_trial", "hydra.sweeper.preload=[fakes]"]

#: (command line, identity hash, sweep name) recorded before the sweeper settings became one declaration each
PINNED = [
    (["adapter.r=4,8", "train.steps=3"], "bd3e251d", "adapter.r-bd3e251d"),
    (
        ["adapter.r=4,8", "hydra.sweeper.sampler=tpe", "hydra.sweeper.n_trials=3"],
        "de4351d4",
        "adapter.r-de4351d4",
    ),
    (["train.lr=interval(1e-4,1e-2)", "hydra.sweeper.n_trials=2"], "5bba5072", "train.lr-5bba5072"),
    (["sweep=demo"], "8440e879", "demo"),
    (["sweep=adapter_rank", "adapter.r=4", "hydra.sweeper.isolation=inprocess"], "d38eb03d", "adapter_rank"),
]


@pytest.mark.parametrize(("args", "want_hash", "want_name"), PINNED)
def test_sweep_identity_hash_is_pinned(tmp_path, args, want_hash, want_name):
    """The identity hash and name of a fixed set of sweeps are the ones recorded before the settings refactor."""
    plan = plan_from_args([f"results_dir={tmp_path}", *FAKE, *args])
    got = identity_hash(plan.identity)
    assert plan.sweep_id == got
    assert (got, plan.name) == (want_hash, want_name)
    assert plan.study_key == want_name
    assert str(plan.folder) == str(tmp_path / "sweeps" / want_name)
    assert plan.storage_url == f"sqlite:///{tmp_path / 'sweeps' / want_name / 'study.db'}"
    assert _public_hash(plan, tmp_path) == PUBLIC[want_name]


#: hash of each sweep's ``sweep.json`` settings (``public_dict``, the temporary folder masked), recorded
#: before that change: the resolved settings a study records do not change either. ``sweep.json`` has since
#: gained every other setting (:data:`RECORDED` are the keys it held then; their values are hashed)
PUBLIC = {
    "adapter.r-bd3e251d": "211deed08ba1",
    "adapter.r-de4351d4": "cb88c4603ce7",
    "train.lr-5bba5072": "802ec70cffa5",
    "demo": "3ef09f70c8d1",
    "adapter_rank": "075c018a942f",
}


#: the keys ``sweep.json``'s settings held when :data:`PUBLIC` was recorded
RECORDED = (
    "name design objectives baseline factors stack repeats preflight edge_start budget_gib storage study_name "
    "n_trials n_jobs sampler pruner pruning_active params seed isolation trial_fn max_failure_rate timeout_s "
    "sweep_dir"
).split()


def _public_hash(plan, tmp_path) -> str:
    public = plan.public_dict()
    assert set(RECORDED) <= set(public)
    text = json.dumps({k: public[k] for k in RECORDED}, sort_keys=True, default=str).replace(
        str(tmp_path), "<tmp>"
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]
