"""Dependencies: ranges in pyproject, the exact set in constraints.txt, and a GPU environment's
torch / transformers / peft kept as they are by ``pip install .[gpu]``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: what the GPU image has (docs/GPU.md, 2026-12-01): `pip install .[gpu]` there must not replace them
GPU_IMAGE = {"torch": "2.11.0", "transformers": "5.17.0", "peft": "0.21.0"}


def _requirements(extra: str | None = None) -> dict[str, Requirement]:
    deps = (
        PYPROJECT["project"]["dependencies"]
        if extra is None
        else PYPROJECT["project"]["optional-dependencies"][extra]
    )
    return {Requirement(d).name.lower(): Requirement(d) for d in deps}


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_runtime_dependency_is_a_range_with_both_bounds() -> None:
    for name, req in _requirements().items():
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops and "<" in ops, f"{name}: {req.specifier} (want >=tested,<cap)"
        assert "==" not in ops, name
    assert PYPROJECT["project"]["requires-python"] == ">=3.11,<3.14"


def test_the_lock_lies_inside_the_ranges() -> None:
    lock = _lock()
    for extra in (None, "dev", "gpu", "dashboard"):
        for name, req in _requirements(extra).items():
            if name in lock:
                assert req.specifier.contains(Version(lock[name]), prereleases=True), (
                    name,
                    lock[name],
                    str(req),
                )
            else:
                assert extra == "gpu", f"{name} (required) is missing from constraints.txt"
    assert lock["torch"].startswith("2.13.0")  # the local CPU wheel the Makefile installs


def test_the_gpu_images_versions_are_allowed() -> None:
    reqs = _requirements()
    for name, version in GPU_IMAGE.items():
        assert reqs[name].specifier.contains(Version(version)), (name, version, str(reqs[name]))


def _index_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


@pytest.mark.network
def test_pip_install_gpu_extra_keeps_the_gpu_images_torch_transformers_peft(tmp_path) -> None:
    """``pip install --dry-run --report`` of ``.[gpu]`` against a constraints set pinned to the GPU image:
    it resolves (no conflict) and installs those three at exactly the image's versions."""
    if not _index_reachable():
        pytest.skip("pypi.org not reachable: the resolution test needs the package index (CI has it)")
    pins = tmp_path / "gpu-image.txt"
    pins.write_text("".join(f"{k}=={v}\n" for k, v in GPU_IMAGE.items()))
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--report", str(report), "-c", str(pins), f"{ROOT}[gpu]"]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = {
        canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    for name, version in GPU_IMAGE.items():
        assert got.get(name) == version, (name, got.get(name))
    assert "liger-kernel" in got
