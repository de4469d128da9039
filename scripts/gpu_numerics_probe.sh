#!/usr/bin/env bash
# Batch invariance and verify-vs-decode fidelity on the GPU under several XLA_FLAGS (one device
# call, about 3 minutes; carry .whl and out/prompts):
#   bash scripts/gpu_numerics_probe.sh            # records under $OUT/numerics
# FLAG_SETS: "name=flags;name=flags" (default below). Flags XLA does not know abort that variant
# only (its log says so).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}/numerics
mkdir -p "$OUT"
FLAG_SETS=${FLAG_SETS:-"default=;cublas=--xla_gpu_enable_triton_gemm=false;nosplitk=--xla_gpu_enable_split_k_autotuning=false;autotune0=--xla_gpu_autotune_level=0"}
IFS=';' read -ra sets <<< "$FLAG_SETS"
for s in "${sets[@]}"; do
  name=${s%%=*}; flags=${s#*=}
  XLA_FLAGS="$flags" timeout 120 python3 scripts/invariance_probe.py --label "$name" \
    --out "$OUT/inv_$name.json" > "$OUT/inv_$name.log" 2>&1 || echo "invariance $name failed (rc $?)"
  tail -8 "$OUT/inv_$name.log"
done
for s in "${sets[@]}"; do
  name=${s%%=*}; flags=${s#*=}
  [ "${FIDELITY_ALL:-0}" = 1 ] || [ "$name" = default ] || continue
  XLA_FLAGS="$flags" timeout 150 python3 scripts/fidelity_probe.py --label "$name" --texts ${TEXTS:-8} \
    --out "$OUT/fid_$name.json" > "$OUT/fid_$name.log" 2>&1 || echo "fidelity $name failed (rc $?)"
  tail -2 "$OUT/fid_$name.log"
done
