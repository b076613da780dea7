#!/usr/bin/env bash
# GPU check (<= 10 min on one GPU): Triton kernel tests for real, the torch fallback, fused-vs-SDPA kernel
# timing, then `h2o bench --only speed,stream` (plain transformers vs h2o 10% at 1K/4K/8K) on the torch path
# and on the Triton path.
# Usage: bash scripts/gpu_check.sh   (needs torch with CUDA and `pip install triton==3.9.0`; the bench part also
# needs the model (H2O_GPU_MODEL, default smollm2-135m, converted under $H2O_HOME) and $H2O_DATA's book).
# Speed does not depend on the weights: H2O_GPU_MODEL may be a folder with random weights of the same shapes.
# Each part's time limit is an environment variable (seconds): T_TESTS, T_TIMING, T_BENCH (per kernel path).
set -euo pipefail
: "${T_TESTS:=300}" "${T_TIMING:=240}" "${T_BENCH:=240}" "${BENCH_CONTEXTS:=1024,4096,8000}" "${BENCH_ROUNDS:=2}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/kernels" TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout "$T_TESTS" python -m pytest tests/test_kernels.py tests/test_kernel_fallback.py -q -o addopts="" -p no:cacheprovider || echo "kernel tests failed (exit $?)"
timeout "$T_TIMING" python - <<'PY' || echo "kernel timing failed or ran past ${T_TIMING}s"
import torch
import torch.nn.functional as F
from h2o_kernels import decode as ref_decode, triton_decode, triton_prefill

dev, dtype = "cuda", torch.bfloat16
def timed(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize(); start = torch.cuda.Event(enable_timing=True); end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n): fn()
    end.record(); torch.cuda.synchronize(); return start.elapsed_time(end) / n
for n_heads, n_kv, d in [(9, 3, 64), (32, 8, 128)]:
    for slots in (1024, 4096, 16384):
        q = torch.randn(n_heads, d, device=dev, dtype=dtype)
        k = torch.randn(n_kv, slots, d, device=dev, dtype=dtype); v = torch.randn_like(k)
        valid = torch.ones(n_kv, slots, dtype=torch.bool, device=dev)
        pos = torch.arange(slots, device=dev).expand(n_kv, slots).contiguous()
        ang = torch.arange(slots + 1, device=dev)[:, None] * (1e-4 ** (torch.arange(d // 2, device=dev) / (d // 2)))
        ang = torch.cat((ang, ang), -1); cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        scores = torch.zeros(n_kv, slots, device=dev)
        args = (q, k, v, valid, pos, pos, pos, slots, cos, sin, d**-0.5, scores, slots - 64)
        fused = timed(lambda: triton_decode.decode_attention(*args))
        torch_ref = timed(lambda: ref_decode.decode_attention(*args))
        kk = k.repeat_interleave(n_heads // n_kv, 0)[None]; vv = v.repeat_interleave(n_heads // n_kv, 0)[None]
        sdpa = timed(lambda: F.scaled_dot_product_attention(q[None, :, None], kk, vv))
        print(f"decode h={n_heads} kv={n_kv} d={d} slots={slots}: fused {fused:.3f} ms  torch-ref {torch_ref:.3f} ms"
              f"  SDPA (no scores, no rotation) {sdpa:.3f} ms")
    chunk, slots = 1024, 4096
    q = torch.randn(n_heads, chunk, d, device=dev, dtype=dtype)
    tok = torch.arange(slots, device=dev).expand(n_kv, slots).contiguous()
    pf = timed(lambda: triton_prefill.prefill_attention(q, k[:, :slots], v[:, :slots], valid[:, :slots], tok, tok,
                                                        slots - chunk, slots - chunk, cos, sin, d**-0.5), n=10)
    qq = torch.randn(1, n_heads, chunk, d, device=dev, dtype=dtype)
    sd = timed(lambda: F.scaled_dot_product_attention(qq, kk[:, :, :slots], vv[:, :, :slots]), n=10)
    print(f"prefill chunk {chunk} over {slots}: fused two-pass {pf:.3f} ms  SDPA {sd:.3f} ms")
PY

# The same comparison as `h2o bench` on the CPU, once per kernel path (plain transformers is the same in both).
MODEL="${H2O_GPU_MODEL:-smollm2-135m}"
BOOK="${H2O_DATA:-../shared/data}/gutenberg_books/war_and_peace_pg2600.txt"
if [ ! -f "$BOOK" ]; then
  echo "bench skipped: $BOOK not found (set H2O_DATA)"
  exit 0
fi
for kernels in torch triton; do
  echo "== h2o bench, --kernels $kernels =="
  timeout "$T_BENCH" python -c "from h2o_cli.cli.app import main; main()" bench --only speed,stream --rounds "$BENCH_ROUNDS" \
    --contexts "$BENCH_CONTEXTS" \
    --device cuda --kernels "$kernels" --threads 0 --model "$MODEL" --json \
    | python -c "import json, sys; r = json.load(sys.stdin); print(json.dumps({k: r[k] for k in ('speed', 'stream', 'bandwidth')}, indent=1))" \
    || echo "h2o bench --kernels $kernels failed (is $MODEL converted under \$H2O_HOME?)"
done
