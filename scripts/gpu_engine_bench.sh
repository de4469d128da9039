#!/usr/bin/env bash
# Issue 3 / 4 measurements in one GPU-machine call (about 9 minutes; carry .whl):
#   bash scripts/gpu_engine_bench.sh        # results under $OUT
# 1. the Triton attention kernel vs copy bandwidth (scripts/bench_attention.py)
# 2. stock decode and the speculative iteration at 8B shape (scripts/bench_steps.py)
# 3. the transformers + torch.compile peer on a random 8B checkpoint, written after 1-2 so that
#    nothing else uses the GPU while they time
set -uo pipefail
. scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
# PARTS (default "attention steps peer") picks parts, e.g. PARTS="steps peer" for the stock
# figures and the peer in the same run.
PARTS=${PARTS:-attention steps peer}
if [[ " $PARTS " == *" attention "* ]]; then
  timeout 160 python3 scripts/bench_attention.py --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
fi
if [[ " $PARTS " == *" steps "* ]]; then
  timeout 190 python3 scripts/bench_steps.py --out "$OUT/steps.json" --split-lanes 1,32 2>&1 | tee "$OUT/steps.log"
fi
if [[ " $PARTS " == *" peer "* ]]; then
  timeout 60 python3 scripts/make_random_qwen3.py --preset qwen3-8b --out /tmp/q8b > "$OUT/ckpt.log" 2>&1 \
    || { echo "checkpoint writer failed"; cat "$OUT/ckpt.log"; exit 1; }
  timeout 150 python3 scripts/bench_peer_transformers.py --model /tmp/q8b --out "$OUT/peer.json" \
    --new-tokens 128 2>&1 | tail -30 | tee "$OUT/peer.log"
fi
