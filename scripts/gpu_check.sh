#!/usr/bin/env bash
# GPU check, <= 8 minutes on one GPU in three time-limited parts:
#   1. the Triton kernel tests for real (tests/test_kernels.py, tests/test_kernel_fallback.py)   T_TESTS (90 s)
#   1b. the `gpu`-marked tests: a CUDA + CPU device-map split streaming like one device, and the captured
#      decode step (CUDA graphs) equal to eager                                                   T_GPU_TESTS (60 s)
#   2. scripts/gpu_bench.py: fused Triton vs torch vs SDPA per attention call (at most 60 s), then plain
#      transformers vs h2o 10 % (and recall) on a random-weight Llama-2-7B shape in bf16 at 4K/16K/32K (see its
#      docstring)                                                                                  T_BENCH (330 s)
#      Its model part starts no row after BENCH_DEADLINE s (270, from its start) and stops a row after
#      ROW_LIMIT s (60; the first compiled row gets 2.5x for the compile).
# Writes docs/benchmarks.md's GPU table (between the gpu-bench markers), and copies it, the JSON rows and the
# log to $OUT when set (the device machine's return folder).
# Usage, from the repo root:   bash scripts/gpu_check.sh
# (GPU_BENCH_ARGS="--dry-run" T_TESTS=1 bash scripts/gpu_check.sh: the script's own plumbing, on a CPU.)
# Needs torch with CUDA and triton. Wheels in .whl/ are installed to /tmp/site first when present: the GPU
# image's transformers (5.17) is older than our floor and it has no bitsandbytes. Fetch them beforehand with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 bitsandbytes==0.50.2
# (.whl/ is git-ignored: name it in the device run's `carry`).
set -uo pipefail
: "${T_TESTS:=90}" "${T_GPU_TESTS:=60}" "${T_BENCH:=330}" "${BENCH_DEADLINE:=270}" "${ROW_LIMIT:=60}"
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
PY="${PYTHON:-python3}"
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE="/tmp/site:" || echo "installing .whl/ failed; using the image's packages"
fi
export PYTHONPATH="$PWD:$PWD/kernels:$SITE${PYTHONPATH:-}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 H2O_KERNELS=
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'triton', triton.__version__)"

echo "== 1. kernel tests (limit ${T_TESTS}s) =="
# ~60 kernel variants to compile: spread over 8 processes when pytest-xdist is there (the GPU image has it)
PARALLEL=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8" || true)
timeout "$T_TESTS" "$PY" -m pytest tests/test_kernels.py tests/test_kernel_fallback.py -v -o addopts="" $PARALLEL \
  -p no:cacheprovider || echo "kernel tests failed or ran past ${T_TESTS}s (exit $?)"

echo "== 1b. gpu-marked tests (limit ${T_GPU_TESTS}s) =="
timeout "$T_GPU_TESTS" "$PY" -m pytest tests/test_device_map.py tests/test_compiled_step.py -m gpu -v -o addopts="" \
  -p no:cacheprovider || echo "gpu-marked tests failed or ran past ${T_GPU_TESTS}s (exit $?)"

echo "== 2. gpu_bench (limit ${T_BENCH}s) =="
timeout "$T_BENCH" "$PY" scripts/gpu_bench.py ${GPU_BENCH_ARGS:-} --deadline "$BENCH_DEADLINE" --row-limit "$ROW_LIMIT" \
  --write docs/benchmarks.md --json "$OUT_DIR/gpu_bench.json" || echo "gpu_bench failed or ran past ${T_BENCH}s (exit $?)"
cp docs/benchmarks.md "$OUT_DIR/benchmarks.md" 2>/dev/null || true
