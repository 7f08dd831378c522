#!/usr/bin/env bash
# The one prepared GPU check: GPU tests, then the benchmarks, each stage with its own deadline,
# JSON written after every stage into OUT (default: $OUT or ./out). Installs nothing from the
# network: it uses the machine's torch/triton and installs bik itself with --no-deps
# --no-build-isolation. Without a GPU it says so and exits 0.
#
#   bash tools/device_check.sh OUT [PARTS]     PARTS: comma-separated, default "triton,dvr,cuda"
#
# Stages run in priority order (Triton tests and benchmarks, then the decode-verify-rollback
# loop, then the CUDA C++ backend) under one overall budget, BUDGET seconds (default 540, so one
# call fits a 10-minute device command): a stage gets min(its deadline, what is left), and a
# stage with under 10 s left is recorded as skipped. Run a later part in a second call if the
# first one ran out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
PARTS=",${2:-triton,dvr,cuda},"
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: no CUDA device visible to torch; nothing to do"
  echo '{"gpu": null, "note": "no CUDA device"}' > "$OUT/device_check.json"
  exit 0
fi

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 10 ]; then
    echo "{\"stage\": \"$name\", \"rc\": null, \"note\": \"skipped: budget spent\"}" >> "$OUT/stages.jsonl"
    echo "device_check: $name skipped (budget spent)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/stages.jsonl"
  echo "device_check: $name rc=$rc ($(( $(date +%s) - t0 )) s)"
}
part() { [[ "$PARTS" == *",$1,"* ]]; }

stage install 60 $PY -m pip install --no-deps --no-build-isolation -q -e .
$PY - > "$OUT/env.json" <<'PYEOF'
import json, datetime, torch, triton, bik
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": triton.__version__, "cuda": torch.version.cuda,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "fingerprint": bik.fingerprint("cuda").as_dict()}, indent=2))
PYEOF
if part triton; then
  stage gpu_tests 90 env BIK_GPU_RECORD="$OUT/torch_mm_variance.json" \
    $PY -m pytest -q -x tests/matmul/test_matmul_gpu.py tests/rms_norm/test_rms_norm_gpu.py \
      tests/reductions/test_reductions.py -m gpu --junitxml "$OUT/gpu_tests.xml"
  stage gpu_attention_tests 180 env BIK_GPU_RECORD_ATTN="$OUT/sdpa_variance.json" \
    $PY -m pytest -q -x tests/attention/test_attention_gpu.py --junitxml "$OUT/gpu_attention_tests.xml"
  # A decode step captured in a CUDA graph with host metadata (Triton and CUDA C++ backends),
  # replayed on new data, bits equal to eager; the host-metadata calls on the GPU.
  stage gpu_graph_tests 60 $PY -m pytest -q tests/test_cuda_graphs.py tests/test_host_metadata.py \
    -m gpu --junitxml "$OUT/gpu_graph_tests.xml"
  stage check 90 $PY -m bik check --json "$OUT/check.json"
  stage bench_rmsnorm 20 $PY -m bik bench rmsnorm --json "$OUT/bench_rmsnorm.json"
  stage bench_attention 150 $PY -m bik bench attention --json "$OUT/bench_attention.json" \
    --plot "$OUT/bench_attention.png"
  stage bench_matmul 60 $PY -m bik bench matmul --json "$OUT/bench_matmul.json" \
    --plot "$OUT/bench_matmul.png"
  stage bench_sample 60 $PY -m bik bench sample --json "$OUT/bench_sample.json"
  stage bench_boundary 10 $PY -m bik bench boundary --json "$OUT/bench_boundary.json"
fi
if part dvr; then
  stage gpu_dvr_tests 60 $PY -m pytest -q -x tests/dvr/test_dvr_gpu.py --junitxml "$OUT/gpu_dvr_tests.xml"
  stage bench_dvr 120 $PY -m bik bench dvr --json "$OUT/bench_dvr.json"
fi
if part cuda; then
  # The CUDA C++ backend (NVRTC JIT at first use): its invariance/accuracy suites, not the Triton
  # params (the stages above cover Triton).
  stage gpu_cuda_tests 150 $PY -m pytest -q -k "not triton" tests/matmul/test_matmul_cuda_gpu.py \
    tests/attention/test_attention_gpu_backends.py --junitxml "$OUT/gpu_cuda_tests.xml"
  # RMSNorm and sampler on the CUDA backend (bits vs the CPU backend, tokens vs CPU and Triton, a
  # CUDA-graph capture, the AOT fatbin path), then compute-sanitizer memcheck over a subset.
  stage gpu_cuda_norm_sample_tests 120 $PY -m pytest -q tests/cuda/test_cuda_gpu.py \
    --junitxml "$OUT/gpu_cuda_norm_sample_tests.xml"
  SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  if [ -x "$SANITIZER" ]; then
    stage cuda_memcheck 120 "$SANITIZER" --tool memcheck --error-exitcode 99 \
      --target-processes all $PY -m pytest -q -x tests/cuda/test_cuda_gpu.py \
      -k "bits_equal_cpu_backend and 111 or tokens_equal_cpu_and_triton and 1000 or graph_capture"
  else
    echo '{"stage": "cuda_memcheck", "rc": null, "note": "no compute-sanitizer"}' >> "$OUT/stages.jsonl"
  fi
fi
echo "device_check: done; results in $OUT"
