#!/usr/bin/env bash
# One device call (about 4 minutes, 7 with PARTS=sampler; carry .whl and out/prompts) that measures
# the CPU-only work since the last GPU run. Everything lands under $OUT/check and is packed into
# $OUT/check.tgz (the device hands back at most 8 files), with a summary in $OUT/check.log:
#   1. GPU tests: batch invariance (linear at every tile size, RMSNorm, logsumexp, the fused q/k
#      norms + RoPE, attention, engines incl. an S-shaped one), the attention kernel with fp8
#      drafter pages, and the jax-triton FFI route;
#   2. fixed-text fidelity of the stand-in with and without EngineConfig.batch_invariant;
#   3. stock step and speculative iteration at 1 and 32 lanes with --batch-invariant;
#   4. PARTS=sampler: stock step and iteration at 1 and 16 lanes at Qwen3's sampling (T 0.7,
#      top-k 20, top-p 0.8), with small top-k on the candidate path and on the bit search
#      (--candidate-top-k 0);
#   4b. PARTS=draftvocab: the speculative iteration and its draft / verify split at 1 and 16
#      lanes, with the whole vocabulary and with --draft-vocab ${DRAFT_VOCAB:-16384};
#   5. PARTS=fp8: the fp8 drafter pool at 32 lanes x 4096 (memory by sizes, iteration time);
#   6. PARTS=linear: the linear kernel's fixed split-K walks against XLA's GEMM
#      (scripts/bench_linear.py; a default part until 2026-12-01);
#   7. PARTS=profile, if time is left: a profile of the invariant stock step.
#   PARTS=sampler bash scripts/gpu_invariance_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh || exit 1
ROOT=${OUT:-/tmp/out}
OUT=$ROOT/check
mkdir -p "$OUT"
START=$SECONDS
# PARTS: the optional parts to add ("sampler fp8 linear profile"; fp8 and profile measured on
# 2026-11-30 at 0f0373d, linear on 2026-12-01).
PARTS=${PARTS:-}
{
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batch_invariance_gpu.py \
  tests/test_kernels_gpu.py \
  -k "invariant or fp8kv or rms_norm or logsumexp or linear or qk_norm_rope or ffi" 2>&1 \
  | tail -25 > "$OUT/pytest_gpu.log"; tail -3 "$OUT/pytest_gpu.log"
for inv in "" "--batch-invariant"; do
  tag=${inv:+_inv}
  timeout 120 python3 scripts/fidelity_probe.py --texts 8 $inv --out "$OUT/fid$tag.json" \
    > "$OUT/fid$tag.log" 2>&1 || echo "fidelity$tag failed (rc $?)"
  tail -1 "$OUT/fid$tag.log"
done
timeout 130 python3 scripts/bench_steps.py --lanes 1,32 --spec-lanes 1,32 --contexts 512 \
  --split-lanes "" --batch-invariant --out "$OUT/steps_inv.json" > "$OUT/steps_inv.log" 2>&1
tail -5 "$OUT/steps_inv.log"
if [[ " $PARTS " == *" sampler "* ]]; then
for path in candidate search; do  # small top-k on the candidate path, then on the bit search
  cand=64; [ $path = search ] && cand=0
  timeout 120 python3 scripts/bench_steps.py --lanes 1,16 --spec-lanes 1,16 --contexts 512 \
    --split-lanes "" --batch-invariant --draft-kv-dtype float8_e4m3fn --temperature 0.7 \
    --top-k 20 --top-p 0.8 --candidate-top-k $cand --out "$OUT/steps_qwen_$path.json" \
    > "$OUT/steps_qwen_$path.log" 2>&1
  echo "sampler, top-k by the $path path:"; tail -4 "$OUT/steps_qwen_$path.log"
done
fi
if [[ " $PARTS " == *" draftvocab "* ]]; then  # the draft vocabulary's cost (jspec/draft_vocab.py)
for dv in "" "--draft-vocab ${DRAFT_VOCAB:-16384}"; do
  tag=${dv:+_dv}
  timeout 150 python3 scripts/bench_steps.py --skip-stock --spec-lanes 1,16 --contexts 512 \
    --split-lanes 1,16 --batch-invariant --draft-kv-dtype float8_e4m3fn $dv \
    --out "$OUT/steps_spec$tag.json" > "$OUT/steps_spec$tag.log" 2>&1
  echo "speculative iteration ${dv:-(whole vocabulary)}:"; grep "^spec " "$OUT/steps_spec$tag.log"
done
fi
if [[ " $PARTS " == *" fp8 "* ]]; then
timeout 110 python3 scripts/bench_steps.py --lanes 1,32 --spec-lanes 1,32 --contexts 4096 \
  --split-lanes "" --draft-kv-dtype float8_e4m3fn --out "$OUT/steps_fp8.json" > "$OUT/steps_fp8.log" 2>&1
grep -E "speculation_extra|^\|" "$OUT/steps_fp8.log"
fi
if [[ " $PARTS " == *" linear "* ]]; then
timeout 100 python3 scripts/bench_linear.py --rows 1,8,32,256 --sweep-rows 1,8,32,256 \
  --shapes qkv,o,gate_up,down --block-m auto --block-n auto --split-k 1,2,3,4 \
  --budget-s 60 --out "$OUT/linear.json" > "$OUT/linear.log" 2>&1
tail -12 "$OUT/linear.log"
fi
if [[ " $PARTS " == *" profile "* ]] && (( SECONDS - START < 470 )); then
  timeout $(( 560 - (SECONDS - START) )) python3 scripts/profile_steps.py --no-trace-copy --trace-dir /tmp/trace --batch-invariant \
    --out "$OUT/profile_stock.json" > "$OUT/profile_stock.log" 2>&1
  tail -30 "$OUT/profile_stock.log"
fi
echo "elapsed $(( SECONDS - START )) s"
} 2>&1 | tee "$ROOT/check.log"
tar -czf "$ROOT/check.tgz" --exclude="*.pb" --exclude="*.gz" -C "$ROOT" check
