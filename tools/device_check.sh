#!/usr/bin/env bash
# The one prepared GPU check: the benchmarks first, then the GPU tests, each stage with its own
# deadline. Installs nothing from the network: it uses the machine's torch/triton and installs
# bik itself with --no-deps --no-build-isolation. Without a GPU it says so and exits 0.
#
#   bash tools/device_check.sh OUT [PARTS]   PARTS: comma-separated, default "bench";
#                                             then "triton", "cuda" and "dvr", a call each
#   PLAN=1 bash tools/device_check.sh OUT [PARTS]   prints "plan STAGE SECONDS" per stage, runs none
#
# GPU time is rare and short (15 minutes a session, start-up included), so the first call
# (~6 minutes) returns every headline number and nothing else: install, the Triton matmul bench
# at Llama-3-8B shapes in bf16 (the fixed split; M = 1, 8, 64, 512, 4096; each call on the next
# of enough weight copies to outrun L2; GB/s of the bytes moved where a device time is taken),
# the sampler bench (SmolLM2's real logits, a peaked and a flat case, B up to 1024, V up to
# 262144), the attention bench (decode first), RMSNorm, the decoder layer, `bik bench
# boundary` (host µs per eager call on each backend), `bik check`, and a profile of a decode
# step's calls (tools/device_profile.py: kernels per call from the profiler's device events,
# host µs, cProfile, a Chrome trace of bik.linear). PARTS=triton is the second call: the
# matmul bench in fp16 and fp32, the MoE grouped product against torch's, then the Triton GPU
# tests. The CUDA C++ backend's tests and
# memcheck are the third (PARTS=cuda); the DVR loop's tests, the plugin's verifier on CUDA and
# the DVR bench the fourth (PARTS=dvr). The sum of each call's deadlines is at most
# BUDGET - 30 s (tests/test_device_check.py checks it from PLAN=1), so no stage is starved by a
# slow one before it.
#
# A device run returns at most 8 files, so OUT holds only: device_check.json (the environment,
# every stage's rc and seconds, and each pytest stage's counts from its junit XML: tests,
# failures, errors, skipped), device_check_raw.tar.gz (every log, XML, bench JSON and the
# profile) and the bench plots. Both are rewritten after every stage, so a run cut off by its
# time limit still returns what finished; a bench cut off by its stage's deadline leaves its
# finished cases in bench_NAME.json.partial.jsonl (bik.cli.bench.stream), which the tarball
# carries. A test stage past its deadline gets SIGINT (pytest stops and still writes its junit
# XML), then SIGKILL 5 s later. Test stages run without -x (every failure is reported), and a
# preflight stage fails loudly when the CUDA C++ toolchain (cuda-core / NVRTC) is missing,
# since its tests would otherwise all skip and read as a pass.
#
# A stage gets min(its deadline, what is left of BUDGET seconds (default 540, so one call fits
# a 10-minute device command)); a stage with under 10 s left is recorded as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-out}}
PARTS=",${2:-bench},"
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RAW=$(mktemp -d)  # every stage's files; packed into OUT after each stage
PY=${PYTHON:-python3}
START=$(date +%s)

pack() {  # device_check.json (summary) and device_check_raw.tar.gz from RAW
  $PY tools/device_check_summary.py "$RAW" "$OUT/device_check.json"
  tar czf "$OUT/device_check_raw.tar.gz" -C "$RAW" .
}

if [ -z "${PLAN:-}" ] && \
    ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: no CUDA device visible to torch; nothing to do"
  echo '{"env": {"gpu": null}, "note": "no CUDA device"}' > "$OUT/device_check.json"
  exit 0
fi

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  if [ -n "${PLAN:-}" ]; then echo "plan $name $limit"; return; fi
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 10 ]; then
    echo "{\"stage\": \"$name\", \"rc\": null, \"note\": \"skipped: budget spent\"}" >> "$RAW/stages.jsonl"
    echo "device_check: $name skipped (budget spent)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  # SIGINT first: pytest stops cleanly and writes its junit XML; a bench writes its partial file.
  timeout -s INT -k 5 "$limit" "$@" > "$RAW/$name.log" 2>&1
  local rc=$?
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$RAW/stages.jsonl"
  echo "device_check: $name rc=$rc ($(( $(date +%s) - t0 )) s)"
  pack
}
part() { [[ "$PARTS" == *",$1,"* ]]; }

stage install 45 $PY -m pip install --no-deps --no-build-isolation -q -e .
[ -z "${PLAN:-}" ] && $PY - > "$RAW/env.json" 2> "$RAW/env.log" <<'PYEOF'
import datetime, json, torch, triton
env = {"gpu": None, "torch": torch.__version__, "triton": triton.__version__,
       "cuda": torch.version.cuda,
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
try:  # what fails here is recorded, not lost: the stages below say more
    import bik
    env["gpu"] = torch.cuda.get_device_name()
    env["fingerprint"] = bik.fingerprint("cuda").as_dict()
except Exception as exc:
    env["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(env, indent=2))
PYEOF
# The CUDA C++ backend's toolchain: without it every CUDA test skips (and would read as a pass).
stage preflight_cuda_toolchain 20 $PY -c "
from bik.runtime import cuda_jit
import sys
print('cuda_jit available:', cuda_jit.available(), cuda_jit.unavailable_reason() or '')
sys.exit(0 if cuda_jit.available() else 3)"
if part bench; then
  stage bench_matmul 85 $PY -m bik bench matmul --backend triton --split fixed \
    --ms 1,8,64,512,4096 --json "$RAW/bench_matmul.json" --plot "$OUT/bench_matmul.png"
  stage bench_sample 50 $PY -m bik bench sample --json "$RAW/bench_sample.json"
  stage bench_attention 75 $PY -m bik bench attention --json "$RAW/bench_attention.json" \
    --plot "$OUT/bench_attention.png"
  stage bench_rmsnorm 20 $PY -m bik bench rmsnorm --json "$RAW/bench_rmsnorm.json"
  stage bench_layer 40 $PY -m bik bench layer --json "$RAW/bench_layer.json"
  stage bench_boundary 20 $PY -m bik bench boundary --json "$RAW/bench_boundary.json"
  stage check 90 $PY -m bik check --json "$RAW/check.json"
  stage profile 45 $PY tools/device_profile.py "$RAW/profile"
fi
if part triton; then
  for dt in fp16 fp32; do
    stage "bench_matmul_$dt" 85 $PY -m bik bench matmul --backend triton --split fixed \
      --dtype "$dt" --ms 1,8,64,512,4096 --json "$RAW/bench_matmul_$dt.json"
  done
  # The MoE grouped product at Qwen3-30B-A3B's widths against torch's _grouped_mm.
  stage bench_moe 25 $PY -m bik bench moe --device cuda --json "$RAW/bench_moe.json"
  stage gpu_tests 60 env BIK_GPU_RECORD="$RAW/torch_mm_variance.json" \
    $PY -m pytest -q tests/matmul/test_matmul_gpu.py tests/rms_norm/test_rms_norm_gpu.py \
      tests/reductions/test_reductions.py tests/matmul/test_grouped_matmul.py -m gpu \
      --junitxml "$RAW/gpu_tests.xml"
  # The samplers (Triton and CUDA C++) against the CPU's bits: the (row, group) programs of a
  # top-p pass and the row tickets under real concurrency, up to Llama-3's vocabulary.
  stage gpu_sampler_tests 40 $PY -m pytest -q tests/sampling/test_sampling_vs_cpu.py \
    tests/sampling/test_sampling_top_p_search.py -m gpu --junitxml "$RAW/gpu_sampler_tests.xml"
  # A decode step captured in a CUDA graph with host metadata (Triton and CUDA C++ backends),
  # replayed on new data, bits equal to eager; the host-metadata calls on the GPU.
  stage gpu_graph_tests 40 $PY -m pytest -q tests/test_cuda_graphs.py tests/test_host_metadata.py \
    -m gpu --junitxml "$RAW/gpu_graph_tests.xml"
  stage gpu_attention_tests 35 env BIK_GPU_RECORD_ATTN="$RAW/sdpa_variance.json" \
    $PY -m pytest -q tests/attention/test_attention_gpu.py --junitxml "$RAW/gpu_attention_tests.xml"
fi
if part cuda; then
  # The CUDA C++ backend (NVRTC JIT at first use): its invariance/accuracy suites, not the Triton
  # params (the stages above cover Triton).
  stage gpu_cuda_tests 150 $PY -m pytest -q -k "not triton" tests/matmul/test_matmul_cuda_gpu.py \
    tests/attention/test_attention_gpu_backends.py --junitxml "$RAW/gpu_cuda_tests.xml"
  # RMSNorm and sampler on the CUDA backend (bits vs the CPU backend, tokens vs CPU and Triton, a
  # CUDA-graph capture, the AOT fatbin path), then compute-sanitizer memcheck over a subset.
  stage gpu_cuda_norm_sample_tests 120 $PY -m pytest -q tests/cuda/test_cuda_gpu.py \
    --junitxml "$RAW/gpu_cuda_norm_sample_tests.xml"
  SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  if [ -n "${PLAN:-}" ] || [ -x "$SANITIZER" ]; then
    # --report-api-errors no: cuda-bindings probes driver entry points that this driver lacks
    # (cuGetProcAddress_v2 -> CUDA_ERROR_INVALID_VALUE, 34 of them at import on the H200 of
    # 2026-12-04), which memcheck would count as errors; the kernels' accesses are what it checks.
    stage cuda_memcheck 120 "$SANITIZER" --tool memcheck --report-api-errors no --error-exitcode 99 \
      --target-processes all $PY -m pytest -q tests/cuda/test_cuda_gpu.py \
      -k "bits_equal_cpu_backend and 111 or tokens_equal_cpu_and_triton and 1000 or graph_capture"
  else
    echo '{"stage": "cuda_memcheck", "rc": null, "note": "no compute-sanitizer"}' >> "$RAW/stages.jsonl"
  fi
fi
if part dvr; then
  stage gpu_dvr_tests 60 $PY -m pytest -q tests/dvr/test_dvr_gpu.py --junitxml "$RAW/gpu_dvr_tests.xml"
  # The vLLM plugin's speculative verifier (coupling) on CUDA logits: skipped where the
  # machine has no vllm (the junit counts say so).
  stage gpu_vllm_spec_tests 45 $PY -m pytest -q tests/vllm_plugin/test_vllm_coupling.py -m gpu \
    --junitxml "$RAW/gpu_vllm_spec_tests.xml"
  stage bench_dvr 120 $PY -m bik bench dvr --json "$RAW/bench_dvr.json"
fi
[ -n "${PLAN:-}" ] && exit 0
pack
echo "device_check: done; results in $OUT (device_check.json, device_check_raw.tar.gz)"
