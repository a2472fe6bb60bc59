#!/usr/bin/env bash
# Launch: bash scripts/gpu_smoke.sh [--out DIR] [--wheels DIR] [--budget-s 420] [-- extra overrides]
#         bash scripts/gpu_smoke.sh --dry-run [--out DIR]     (CPU, embedded tiny model, tiny steps)
#
# One-shot GPU smoke test (issue 7). On a CUDA machine with no network it
#   1. installs what the image lacks from a wheels folder, offline (bitsandbytes, liger-kernel,
#      nvidia-ml-py, ...: `pip install --no-index --find-links wheels/`, see scripts/fetch_gpu_wheels.sh);
#   2. runs sweeps/gpu_smoke.yaml: a random-init Qwen3-8B architecture under a 16 GiB cap
#      (hardware=rtx4080_16gb emulated on the larger GPU), ablating quant x attention x kernels x
#      checkpointing x context, each trial in a fresh process, within --budget-s seconds;
#   3. writes the report and bundles everything into one folder of at most 8 files:
#      summary.md (dated table for README), summary.csv, ablation.md, pareto.png, memory_breakdown.png,
#      trials.jsonl (every trial result), sweep.json, smoke.log;
#   4. prints the dated markdown table.
# --dry-run runs the same sweep file, sweeper, trial code and report on the CPU with the embedded tiny
# model and tiny steps (CI runs it). Exit status: 0 when every trial ended in a recorded status
# (ok / oom / unsupported are all results), 1 when the sweep or the report failed, 2 on bad usage.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
cd "$ROOT"

DRY=0
WHEELS="${VRAMSWEEP_WHEELS:-$ROOT/wheels}"
ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  esac
done
# --wheels is consumed here (the install happens before Python runs); everything else goes to gpu_smoke.py.
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

# Interpreter: $PYTHON if set; else, for the dry run, the project venv (or python3); for a GPU run the
# first of .venv/bin/python and python3 whose torch sees CUDA (a `make install` venv on a CPU-only wheel
# must not shadow a GPU image's own Python).
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ "$DRY" = 1 ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
else
  PY=""
  for cand in "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$cand" >/dev/null 2>&1 \
       && "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
      PY="$cand"; break
    fi
  done
  if [ -z "$PY" ]; then
    echo "gpu_smoke: no Python here whose torch sees a CUDA device (use --dry-run for the CPU path, or set PYTHON)" >&2
    exit 2
  fi
fi
echo "gpu_smoke: python $PY"

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"   # works without `pip install -e .`
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
export WANDB_MODE="${WANDB_MODE:-disabled}"
export VRAMSWEEP_CACHE="${VRAMSWEEP_CACHE:-$ROOT/.cache/vramsweep}"
export PYTHONUNBUFFERED=1

# Offline install of whatever the image lacks (GPU runs only; the dry run uses what is installed).
if [ "$DRY" = 0 ]; then
  MISSING="$("$PY" - <<'EOF'
import importlib.util
need = {"bitsandbytes": "bitsandbytes", "liger_kernel": "liger-kernel", "pynvml": "nvidia-ml-py",
        "hydra": "hydra-core", "omegaconf": "omegaconf", "optuna": "optuna", "matplotlib": "matplotlib",
        "sqlalchemy": "sqlalchemy", "accelerate": "accelerate", "psutil": "psutil", "tqdm": "tqdm"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
EOF
)"
  if [ -n "$MISSING" ]; then
    if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
      echo "gpu_smoke: installing offline from $WHEELS: $MISSING"
      for dist in $MISSING; do   # one at a time: a wheel that is not there must not block the others
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$dist" \
          || echo "gpu_smoke: could not install $dist from $WHEELS (trials needing it are recorded unsupported)"
      done
    else
      echo "gpu_smoke: missing $MISSING and no wheels in $WHEELS (run scripts/fetch_gpu_wheels.sh where PyPI is reachable)"
    fi
  fi
fi

exec "$PY" "$HERE/gpu_smoke.py" "${ARGS[@]+"${ARGS[@]}"}"
