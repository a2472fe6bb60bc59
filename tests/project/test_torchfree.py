"""The torch-free parts (CLI parsing and --help, compose with the config rules, the estimator, the sweeper's
settings, the report) import no torch, transformers, peft, bitsandbytes, accelerate or trl: the Python 3.12
job (``make test-py312``) runs them in a venv without those packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchfree

TESTS = str(Path(__file__).resolve().parents[1])
SRC = str(Path(__file__).resolve().parents[2] / "src")
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "trl")

# Any import of a HEAVY package (``import``, ``importlib.util.find_spec``) is recorded and refused as if the
# package were not installed, so the check means the same where torch is installed (Python 3.11 venv).
CODE = f"""
import contextlib, importlib.abc, io, sys, tempfile
from pathlib import Path
HEAVY = {HEAVY!r}
tried = []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in HEAVY:
            tried.append(name)
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
        return None
sys.meta_path.insert(0, Block())

from vramsweep.cli import build_parser, main
for verb in ('train', 'estimate', 'report', 'pick', 'env'):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main([verb, '--help'])
build_parser().parse_args(['train', 'quant=nf4', 'adapter.r=8'])

from vramsweep.config import compose
from vramsweep.estimate import estimate
cfg = compose(['quant=nf4', 'adapter.r=8'], rules='config')
est = estimate(cfg, calibration=False)
assert est['peak_memory_bytes'] > 0, est

from vramsweep.sweeper.plan import resolve_settings  # noqa: F401  (the sweeper's settings and space)
from vramsweep.sweeper import space  # noqa: F401

from _reports import result, write_sweep
from vramsweep.report import run_report
folder = write_sweep(Path(tempfile.mkdtemp()) / 'syn', [result(0, []), result(1, ['adapter.r=8'])])
with contextlib.redirect_stdout(io.StringIO()):
    assert run_report(str(folder)) == 0

print('tried', sorted(set(tried)))
print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in HEAVY))
"""


def test_cli_compose_estimate_sweeper_and_report_import_no_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", CODE], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-2:] == ["tried []", "loaded []"], out.stdout[-2000:]
