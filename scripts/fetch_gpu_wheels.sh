#!/usr/bin/env bash
# Launch: bash scripts/fetch_gpu_wheels.sh [--dest wheels] [--python-version 3.12] [--max-mib 64]
#
# Run where PyPI is reachable. Prepares, as ONE file (wheels/gpu_bundle.tar.xz, at most --max-mib MiB),
# everything the offline GPU image (torch 2.11 + triton 3.6 + transformers 5.17 + peft 0.21, Python 3.12)
# lacks: bitsandbytes 0.50.2 trimmed to its CUDA 13.0 library, liger-kernel 0.8.5, nvidia-ml-py,
# hydra-core + omegaconf + antlr4-python3-runtime (an sdist: built into a wheel here), optuna + alembic/
# colorlog/mako/sqlalchemy, and the Unsloth stack (unsloth without its studio/ web UI, unsloth_zoo, trl,
# datasets<5 + pyarrow/pandas, tyro, torchao, cut_cross_entropy, msgspec, ...), binary wheels for
# cp312 manylinux x86_64, resolved against what the image already has and unzipped into one folder.
# scripts/gpu_smoke.sh extracts it and puts it on PYTHONPATH (distributions the image already has are
# set aside, so the image's copies win). wheels/ is git-ignored: carry the file, never commit it.
set -euo pipefail

DEST=wheels
PYVER=3.12
MAXMIB=64
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST="$2"; shift 2 ;;
    --python-version) PYVER="$2"; shift 2 ;;
    --max-mib) MAXMIB="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fetch_gpu_wheels: unknown argument $1 (allowed: --dest, --python-version, --max-mib)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
exec "$PY" scripts/gpu_bundle.py build --dest "$DEST" --python-version "$PYVER" --max-mib "$MAXMIB"
