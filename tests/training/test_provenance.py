"""Provenance (``record/provenance.py``): the source revision of a git checkout, and the meta a trial
records about what ran it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vramsweep.config import compose
from vramsweep.record.provenance import collect_meta, source_revision

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.torchfree
def test_source_revision_is_the_checkouts_head():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert source_revision() == head.stdout.strip()


def test_collect_meta_on_cpu_records_device_versions_and_conditions():
    meta = collect_meta(compose([]), lambda device: None)
    assert meta["device"].startswith("cpu (") and meta["hardware_emulation"] is None
    assert meta["versions"]["torch"] and meta["versions"]["omegaconf"]
    assert {"cpu_count", "torch_threads"} <= set(meta["timing_conditions"])
    assert meta["seed"] == int(compose([]).train.seed)
