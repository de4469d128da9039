#!/usr/bin/env bash
# One device call (about 6 minutes; carry .whl): the device step loop and look-ahead dispatches
# (EngineConfig.device_loop / lookahead) on the H200.
#   1. GPU tests: the batch-invariant engines' verify-equals-decode (now through the device
#      loop) and the kernels' invariance;
#   2. scripts/bench_engine_loop.py, stock and speculative, --batch-invariant: the bare step fed
#      fixed / chained / uploaded state, host loop against device loop, and Engine.generate per
#      token all-in with and without look-ahead.
# Logs and JSON under $OUT/loop, packed into $OUT/loop.tgz; a summary in $OUT/loop.log.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh || exit 1
ROOT=${OUT:-/tmp/out}
OUT=$ROOT/loop
mkdir -p "$OUT"
START=$SECONDS
{
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batch_invariance_gpu.py \
  -k "engine or qk_norm_rope" 2>&1 | tail -15 > "$OUT/pytest_gpu.log"; tail -3 "$OUT/pytest_gpu.log"
timeout 150 python3 scripts/bench_engine_loop.py --batch-invariant --out "$OUT/loop_stock.json" \
  > "$OUT/loop_stock.log" 2>&1 || echo "stock loop bench failed (rc $?)"
grep -E "^(host|device)_loop" "$OUT/loop_stock.log"
timeout 200 python3 scripts/bench_engine_loop.py --spec --batch-invariant \
  --draft-kv-dtype float8_e4m3fn --out "$OUT/loop_spec.json" > "$OUT/loop_spec.log" 2>&1 \
  || echo "spec loop bench failed (rc $?)"
grep -E "^(host|device)_loop" "$OUT/loop_spec.log"
tail -4 "$OUT/loop_spec.log" | grep -v "^device_loop\|^host_loop"
echo "elapsed $(( SECONDS - START )) s"
} 2>&1 | tee "$ROOT/loop.log"
tar -czf "$ROOT/loop.tgz" -C "$ROOT" loop
