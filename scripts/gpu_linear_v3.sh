#!/usr/bin/env bash
# One device call (about 5 minutes; carry .whl) that checks the wgmma (v3) family of the
# batch-invariant linear kernel against mma.sync (v2) (kernels/linear_triton.py). Run on
# 2026-12-02 (docs/benchmarks.md): v3 kept its bits and gave v2's, so "mixed" (v2 up to 32 rows,
# v3 above) became the default; run it again on another GPU or Triton before trusting that:
#   1. bench_linear.py --mma v3: the v3 plan against XLA and the v2 16-row plan at 1..256 rows,
#      and a sweep of v3 tiles at 128 and 256 rows (verify at 16 and 32 lanes), bits compared;
#   2. the GPU invariance tests with JSPEC_LINEAR_MMA=v3 (the linear test runs both families; the
#      engine's verify-equals-decode test then runs on v3);
#   3. profile_steps.py, v2, v3 and mixed: one speculative iteration at 16 lanes and a stock step at 1
#      lane (the 2026-12-02 v2 profile: 13.4 ms and 6.1 ms; _linear_kernel 8.5 ms of the 13.4).
# Everything lands in $OUT: linear_v3.json / .log, pytest_v3.log, profiles.tgz (profile_*.json / .log).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
timeout 110 python3 scripts/bench_linear.py --mma v3 --rows 1,16,128,256 --sweep-rows 128,256 \
  --block-m 64,128 --block-n 16,32,64,128 --warps 4,8 --budget-s 90 --out "$OUT/linear_v3.json" \
  > "$OUT/linear_v3.log" 2>&1
tail -n 25 "$OUT/linear_v3.log"
JSPEC_LINEAR_MMA=v3 timeout 150 python3 -m pytest -q -m gpu tests/test_batch_invariance_gpu.py \
  > "$OUT/pytest_v3.log" 2>&1
tail -n 5 "$OUT/pytest_v3.log"
for mma in v2 v3 mixed; do
  for run in "spec16 --spec --lanes 16" "stock1 --lanes 1"; do
    set -- $run; name=$1; shift
    JSPEC_LINEAR_MMA=$mma timeout 80 python3 scripts/profile_steps.py --out "$OUT/profile_${mma}_$name.json" \
      "$@" --context 1024 --steps 8 --batch-invariant --no-trace-copy > "$OUT/profile_${mma}_$name.log" 2>&1
    echo "$mma $name: $(grep -m1 'unprofiled' "$OUT/profile_${mma}_$name.log")"
  done
done
rm -f "$OUT"/*.hlo.txt.gz
(cd "$OUT" && tar czf profiles.tgz profile_* && rm -f profile_*)  # a call returns at most 8 files
exit 0
