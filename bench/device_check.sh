#!/usr/bin/env bash
# The one prepared GPU check: GPU tests, then the benchmarks, each stage with its own deadline,
# JSON written after every stage into OUT (default: $OUT or ./out). Installs nothing from the
# network: it uses the machine's torch/triton and installs bik itself with --no-deps
# --no-build-isolation. The stage deadlines sum to about 10 minutes (an upper bound: a stage that
# finishes early hands its time on). Without a GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: no CUDA device visible to torch; nothing to do"
  echo '{"gpu": null, "note": "no CUDA device"}' > "$OUT/device_check.json"
  exit 0
fi

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/stages.jsonl"
  echo "device_check: $name rc=$rc ($(( $(date +%s) - t0 )) s)"
}

stage install 60 $PY -m pip install --no-deps --no-build-isolation -q -e .
$PY - > "$OUT/env.json" <<'PYEOF'
import json, datetime, torch, triton, bik
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": triton.__version__, "cuda": torch.version.cuda,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "fingerprint": bik.fingerprint("cuda").as_dict()}, indent=2))
PYEOF
stage gpu_tests 90 env BIK_GPU_RECORD="$OUT/torch_mm_variance.json" \
  $PY -m pytest -q -x tests/test_gpu.py --junitxml "$OUT/gpu_tests.xml"
stage gpu_attention_tests 180 env BIK_GPU_RECORD_ATTN="$OUT/sdpa_variance.json" \
  $PY -m pytest -q -x tests/test_attention_gpu.py --junitxml "$OUT/gpu_attention_tests.xml"
stage check 90 $PY -m bik check --json "$OUT/check.json"
stage bench_rmsnorm 20 $PY -m bik bench rmsnorm --json "$OUT/bench_rmsnorm.json"
stage bench_attention 150 $PY -m bik bench attention --json "$OUT/bench_attention.json" \
  --plot "$OUT/bench_attention.png"
stage bench_matmul 60 $PY -m bik bench matmul --json "$OUT/bench_matmul.json" \
  --plot "$OUT/bench_matmul.png"
stage bench_sample 60 $PY -m bik bench sample --json "$OUT/bench_sample.json"
stage bench_boundary 10 $PY -m bik bench boundary --json "$OUT/bench_boundary.json"
stage gpu_dvr_tests 60 $PY -m pytest -q -x tests/test_dvr_gpu.py --junitxml "$OUT/gpu_dvr_tests.xml"
stage bench_dvr 120 $PY -m bik bench dvr --json "$OUT/bench_dvr.json"
echo "device_check: done; results in $OUT"
