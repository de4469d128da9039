#!/usr/bin/env bash
# One device call (about 8 minutes; carry .whl and out/prompts) that measures what the last
# CPU-only changes promise:
#   1. the batch-invariant kernels on the GPU: pytest -m gpu tests/test_batch_invariance_gpu.py
#      (exact verify == decode through a whole engine), and the attention kernel's GPU suite;
#   2. fixed-text fidelity of the stand-in with and without EngineConfig.batch_invariant;
#   3. stock step and speculative iteration at 1 and 32 lanes, with and without it (the
#      sampler's host-sync fix is in both);
#   4. the linear kernel's speed against XLA's GEMM (scripts/bench_linear.py, a small sweep).
#   bash scripts/gpu_invariance_check.sh        # records under $OUT/invariance
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}/invariance
mkdir -p "$OUT"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batch_invariance_gpu.py \
  tests/test_kernels_gpu.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu.log"
for inv in "" "--batch-invariant"; do
  tag=${inv:+_inv}
  timeout 150 python3 scripts/fidelity_probe.py --texts 8 $inv --out "$OUT/fid$tag.json" \
    > "$OUT/fid$tag.log" 2>&1 || echo "fidelity$tag failed (rc $?)"
  tail -1 "$OUT/fid$tag.log"
done
for inv in "" "--batch-invariant"; do
  tag=${inv:+_inv}
  timeout 150 python3 scripts/bench_steps.py --lanes 1,32 --spec-lanes 1,32 --contexts 512 \
    --split-lanes "" $inv --out "$OUT/steps$tag.json" 2>&1 | tail -8 | tee "$OUT/steps$tag.log"
done
# 4. the linear kernel's tile width against XLA's GEMM (a small sweep; none changes the bits)
timeout 150 python3 scripts/bench_linear.py --rows 1,8,256 --block-n 16,32,64 --stages 4 \
  --out "$OUT/linear.json" 2>&1 | tail -14 | tee "$OUT/linear.log"
