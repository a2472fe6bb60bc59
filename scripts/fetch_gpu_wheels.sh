#!/usr/bin/env bash
# Launch: bash scripts/fetch_gpu_wheels.sh [--with-deps] [--python-version 3.12] [--dest wheels]
#
# Download, on a machine with PyPI access, the wheels that scripts/gpu_smoke.sh installs offline
# (`pip install --no-index --find-links wheels/`) on a CUDA box whose image lacks them:
#   bitsandbytes 0.50.2 (manylinux x86_64, ships libbitsandbytes_cuda118..132 incl. cuda130, ~43 MB),
#   liger-kernel 0.8.5 (pure Python + Triton kernels), nvidia-ml-py (pynvml, for the NVML peak).
# --with-deps adds vramsweep's light runtime dependencies (hydra-core, omegaconf, optuna, matplotlib,
# sqlalchemy, accelerate, psutil and what they need; ~45 MB) for --python-version, for an image that
# has only torch/transformers/peft/triton. torch, triton, transformers, peft, numpy are never downloaded.
# wheels/ is git-ignored: carry it to the GPU box, never commit it.
set -euo pipefail

DEST=wheels
PYVER=""
WITH_DEPS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) DEST="$2"; shift 2 ;;
    --python-version) PYVER="$2"; shift 2 ;;
    --with-deps) WITH_DEPS=1; shift ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fetch_gpu_wheels: unknown argument $1" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
mkdir -p "$DEST"

PLATFORM=(--only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64)
if [ -n "$PYVER" ]; then PLATFORM+=(--python-version "$PYVER"); fi

# The pinned GPU wheels (versions as in pyproject's `gpu` extra and issue 7).
GPU_PKGS=(bitsandbytes==0.50.2 liger-kernel==0.8.5 nvidia-ml-py==13.615.71)
echo "fetch_gpu_wheels: ${GPU_PKGS[*]} -> $DEST/"
"$PY" -m pip download --no-deps "${PLATFORM[@]}" -d "$DEST" "${GPU_PKGS[@]}"

if [ "$WITH_DEPS" = 1 ]; then
  # hydra-core needs antlr4-python3-runtime 4.9.x, published as an sdist only: build its (pure Python)
  # wheel here so the offline install needs no build step, and let the resolver find it in $DEST.
  "$PY" -m pip wheel --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
  # Light runtime deps with their dependency closure for the target Python.
  DEPS=(hydra-core==1.3.8 omegaconf==2.3.1 optuna==5.0.0 sqlalchemy==2.1.9 matplotlib==3.11.2
        psutil==7.2.2 tqdm==4.70.1)
  echo "fetch_gpu_wheels: runtime deps ${DEPS[*]} (+ their dependencies) -> $DEST/"
  "$PY" -m pip download --find-links "$DEST" "${PLATFORM[@]}" -d "$DEST" "${DEPS[@]}"
  # accelerate depends on torch (the image has it): fetch it alone; its other deps come with transformers.
  "$PY" -m pip download --no-deps "${PLATFORM[@]}" -d "$DEST" accelerate==1.15.0
  # An image with torch + transformers already has these: drop them to keep the folder small (pip
  # accepts installed packages as satisfying requirements under --no-index).
  for have in numpy packaging pyyaml typing_extensions tqdm; do
    rm -f "$DEST"/"$have"-*.whl "$DEST"/"${have^}"-*.whl "$DEST"/PyYAML-*.whl
  done
fi

echo "fetch_gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheel(s), $(du -sh "$DEST" | cut -f1) in $DEST/:"
ls -1 "$DEST"
