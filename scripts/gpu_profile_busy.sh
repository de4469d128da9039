#!/usr/bin/env bash
# One device call (about 4 minutes; carry .whl): where busy's speculative iteration goes. Busy
# (32 lanes, prompts >= 3,000 tokens) verifies 256 rows per iteration, and its efficiency fell to
# 0.42 on 2026-12-02 (docs/benchmarks.md) while the profiles were at 16 lanes and context 1,024.
#   1. bench_linear.py --mma v3 at 256 rows with a sweep of v3 tiles there (the tiles above
#      V3_TUNED_MAX_ROWS in kernels/linear_triton.py were not swept), bits compared;
#   2. profile_steps.py with the default ("mixed") family: a speculative iteration and a stock
#      step at 32 lanes and context 3,072.
# Everything lands in $OUT: linear_v3_256.json / .log, profile_busy_{spec,stock}32.{json,log}.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
timeout 100 python3 scripts/bench_linear.py --mma v3 --rows 256 --sweep-rows 256 \
  --block-m 64,128 --block-n 32,64,128 --warps 4,8 --budget-s 80 --out "$OUT/linear_v3_256.json" \
  > "$OUT/linear_v3_256.log" 2>&1
tail -n 8 "$OUT/linear_v3_256.log"
for run in "spec32 --spec" "stock32"; do
  set -- $run; name=$1; shift
  timeout 70 python3 scripts/profile_steps.py --out "$OUT/profile_busy_$name.json" "$@" \
    --lanes 32 --context 3072 --steps 8 --batch-invariant --no-trace-copy \
    > "$OUT/profile_busy_$name.log" 2>&1
  echo "$name: $(grep -m1 'unprofiled' "$OUT/profile_busy_$name.log")"
  grep -m2 "_linear_kernel\|_rpa_fwd_kernel" "$OUT/profile_busy_$name.log"
done
rm -f "$OUT"/*.hlo.txt.gz
exit 0
