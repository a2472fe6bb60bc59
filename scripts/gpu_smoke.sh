#!/usr/bin/env bash
# Launch: bash scripts/gpu_smoke.sh [--out DIR] [--bundle FILE] [--wheels DIR] [--budget-s 540] [-- overrides]
#         bash scripts/gpu_smoke.sh --dry-run [--out DIR]     (CPU, embedded tiny model, tiny steps)
#         bash scripts/gpu_smoke.sh --plan [--dry-run]        (print the time plan only)
#         bash scripts/gpu_smoke.sh --maxctx [--budget-s 470] (GPU: sweeps/max_context_16gb.yaml instead)
#         bash scripts/gpu_smoke.sh --only memprobe_fp32,snapshot,step_time --snapshot-tokens N   (the 2nd call)
#         [--only PHASES] [--probe-tokens 57344,61440,53248] [--fp32-tokens ...] (a rerun of some phases)
#
# One-shot GPU smoke test (issues 7, 10, 25, 37): the device script of issue 37.9, 540 s of work on one GPU
# by a plan whose phase caps sum to <= the budget (printed first with what runs in each and why it fits).
# Every phase is time-boxed and independent: a failed one never stops the next, a cut one is "not run".
# No network. In order:
#   1. bundle: found in wheels/ or the shared prebuilt copy, its manifest checked against gpu_bundle.py's
#      WANTED list (--dry-run says so; a GPU run refuses a stale one), extracted once, on PYTHONPATH;
#   2. env: versions (importlib.metadata), device, driver, a 64 MiB pinned round trip;
#   3. fork: trials forked from the sweeper's fork server with its default preload, no fallback to spawn;
#   4. exact / batching: scripts/gpu_longctx_check.py (tiling, offload, RNG replay) and
#      scripts/gpu_batch_check.py (token-weighted accumulation, packing) on the device;
#   5. memprobe: Qwen3-8B (random init) under the 15 GiB cap, 16-bit adapters, between 2026-12-04's fit
#      (49,152) and OOM (65,536): 57,344, then 61,440 or 53,248 (peaks, num_alloc_retries, pool bytes, the
#      estimate); YaRN x4 over 32,768 past the model's 40,960 positions;
#   6. trial: a real trial at the longest length that fitted;
#   7. writes summary.md, summary.csv, trials.jsonl, phases.json, smoke.log (+ snapshot.md) and the summary.
# Opt-in (--only; the second call of a loan): memprobe_fp32 (fp32 adapters at 45,056, then 49,152 or 40,960),
# snapshot (scripts/gpu_memsnapshot.py: the allocator's trace of the peak by owner), step_time
# (bench/step_time.py 1,024 vs 4,096 tokens).
# --dry-run runs the same script on the CPU with the embedded tiny model (CI runs it). Exit status: 0 when
# no phase failed (ok / oom / not run are results), 1 when one did, 2 on bad usage or no CUDA device.
set -euo pipefail
# The budget is hard from here (bundle extraction included): gpu_smoke.py counts from this instant.
export VRAMSWEEP_SMOKE_T0="${VRAMSWEEP_SMOKE_T0:-$(date +%s.%N)}"

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
cd "$ROOT"

DRY=0
PLAN=0
MAXCTX=0
MAXCTX_BUDGET=470
WHEELS="${VRAMSWEEP_WHEELS:-$ROOT/wheels}"
BUNDLE="${VRAMSWEEP_GPU_BUNDLE:-}"   # empty: the first of wheels/, shared/gpu-bundle/, ../shared/gpu-bundle/
ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    --plan) PLAN=1 ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  esac
done
# --wheels/--bundle are consumed here (the install happens before Python runs); the rest goes to gpu_smoke.py.
while [ $# -gt 0 ]; do
  case "$1" in
    --maxctx) MAXCTX=1; shift ;;
    --budget-s) MAXCTX_BUDGET="$2"; ARGS+=("$1" "$2"); shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --bundle) BUNDLE="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

if [ "$PLAN" = 1 ]; then   # the plan needs no GPU, bundle or venv beyond PyYAML
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi
  if [ -n "$BUNDLE" ]; then "$PY" "$HERE/gpu_bundle.py" verify --bundle "$BUNDLE" || true
  else "$PY" "$HERE/gpu_bundle.py" verify || true; fi
  exec "$PY" "$HERE/gpu_smoke.py" "${ARGS[@]+"${ARGS[@]}"}"
fi

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

# The bundle is a precondition of the loan (issue 37.3): found and its manifest checked against
# scripts/gpu_bundle.py's WANTED list before anything runs; the dry run says so, a GPU run refuses a stale one.
VERIFY_ARGS=(verify --print-path)
if [ -n "$BUNDLE" ]; then VERIFY_ARGS+=(--bundle "$BUNDLE"); fi
set +e
VERIFY_OUT="$("$PY" "$HERE/gpu_bundle.py" "${VERIFY_ARGS[@]}")"
VERIFY_RC=$?
set -e
echo "$VERIFY_OUT" | grep -v '^BUNDLE=' || true
BUNDLE="$(echo "$VERIFY_OUT" | sed -n 's/^BUNDLE=//p')"
if [ "$DRY" = 1 ]; then
  case "$VERIFY_RC" in
    0) echo "gpu_smoke: --dry-run: bundle ready for the loan (not extracted here; carry it as wheels/gpu_bundle.tar.xz)" ;;
    *) echo "gpu_smoke: --dry-run: the bundle is NOT ready: a GPU run would stop here (exit 2)" ;;
  esac
elif [ "$VERIFY_RC" = 1 ]; then
  echo "gpu_smoke: the bundle does not match scripts/gpu_bundle.py's WANTED list: rebuild it (bash scripts/fetch_gpu_wheels.sh)" >&2
  exit 2
fi

PYTHONPATH_IMAGE="${PYTHONPATH:-}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"   # works without `pip install -e .`
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
export WANDB_MODE="${WANDB_MODE:-disabled}"
export VRAMSWEEP_CACHE="${VRAMSWEEP_CACHE:-$ROOT/.cache/vramsweep}"
export PYTHONUNBUFFERED=1

# What the image lacks, offline (GPU runs only; the dry run uses what is installed):
# 1. the bundle from scripts/fetch_gpu_wheels.sh (wheels/gpu_bundle.tar.xz): extracted once into
#    $VRAMSWEEP_CACHE/gpu_bundle/, every distribution the image already has set aside (the image's copy
#    wins), the folder put on PYTHONPATH (trial processes inherit it);
# 2. else loose wheels in --wheels DIR, installed with pip --no-index.
# matplotlib is in neither the image nor the bundle: not required; the report then writes tables only and
# the summary says the plots were skipped.
if [ "$DRY" = 0 ]; then
  if [ -n "$BUNDLE" ] && [ -f "$BUNDLE" ]; then
    BDIR="$VRAMSWEEP_CACHE/gpu_bundle"
    STAMP_NOW="$(stat -c '%s %Y' "$BUNDLE")"
    if [ "$(cat "$BDIR.stamp" 2>/dev/null)" != "$STAMP_NOW" ]; then
      echo "gpu_smoke: extracting $BUNDLE -> $BDIR"
      rm -rf "$BDIR" "$BDIR.shadowed" "$BDIR.stamp"
      mkdir -p "$(dirname "$BDIR")"
      "$PY" - "$BUNDLE" "$(dirname "$BDIR")" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:  # the archive holds one folder, gpu_bundle/
    kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    tar.extractall(sys.argv[2], **kw)
EOF
      "$PY" "$HERE/gpu_bundle.py" activate "$BDIR"
      echo "$STAMP_NOW" > "$BDIR.stamp"
    else
      echo "gpu_smoke: using the extracted bundle in $BDIR"
    fi
    export PYTHONPATH="$ROOT/src:$BDIR${PYTHONPATH_IMAGE:+:$PYTHONPATH_IMAGE}"
  fi
  MISSING="$("$PY" - <<'EOF'
import importlib.util
need = {"bitsandbytes": "bitsandbytes", "liger_kernel": "liger-kernel", "pynvml": "nvidia-ml-py",
        "hydra": "hydra-core", "omegaconf": "omegaconf", "optuna": "optuna",
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
      echo "gpu_smoke: missing $MISSING and no bundle ($BUNDLE) or wheels in $WHEELS (run scripts/fetch_gpu_wheels.sh where PyPI is reachable)"
    fi
  fi
fi

if [ "$MAXCTX" = 1 ]; then
  # Max-context search (issue 11): estimator prediction, then real trials to the boundary, per config of
  # sweeps/max_context_16gb.yaml, under a wall-clock budget. Probes are kept: a re-run continues where the
  # budget stopped it. Grid step 8,192 tokens here (the sweep file's 4,096 takes about twice the probes).
  OUTDIR="${OUT:-$ROOT/results/gpu_maxctx}"
  mkdir -p "$OUTDIR"
  set +e
  timeout --signal=INT "$MAXCTX_BUDGET" "$PY" -m vramsweep.cli train -m sweep=max_context_16gb \
    "results_dir=$ROOT/results" sweep.max_context.step=8192 2>&1 | tee "$OUTDIR/maxctx.log"
  rc=${PIPESTATUS[0]}
  set -e
  cp "$ROOT/results/sweeps/max_context_16gb/max_context."{md,csv,json} "$OUTDIR/" 2>/dev/null || true
  echo "gpu_smoke --maxctx: exit $rc; table in $OUTDIR/max_context.md (absent when the budget ran out first)"
  exit "$rc"
fi

exec "$PY" "$HERE/gpu_smoke.py" "${ARGS[@]+"${ARGS[@]}"}"
