#!/usr/bin/env bash
# Cost probes on the GPU (first run 2026-12-04, docs/benchmarks.md), by stage, each
# under its own timeout so that a stage or two fit one device call (carry .whl and out/prompts):
#   bash scripts/gpu_cost_probes.sh vocab        # ~6.5 min: bench_steps at 1/16/32 lanes, 2/3/7
#                                                #   drafts, without and with --draft-vocab 16384
#   bash scripts/gpu_cost_probes.sh prefill      # ~3 min: bench_prefill (chunks 512 and 1024 at
#                                                #   0-3,072 cached tokens), the prefill tile sweep
#                                                #   at 1,024, 3,072 and 4,096 tokens of context
#   bash scripts/gpu_cost_probes.sh acceptance   # ~2 min: the shipped int8 pair on all 421 code
#                                                #   prompts, then DSpark / DFlash with its interval
#   bash scripts/gpu_cost_probes.sh int8         # ~5 min: bench_steps at 1, 16, 32 lanes, 3 and 7
#                                                #   drafts, drafter weights bf16 then int8
#                                                #   (--draft-weight-dtype); prints which is faster
# (2026-12-04 on one H200: vocab 349 s with its second half cut at 170 s, now 200; prefill 70 s
# with the sweep at one context, now three; acceptance 125 s). Everything lands in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh >/dev/null || exit 1
export JSPEC_LINEAR_MMA=${JSPEC_LINEAR_MMA:-mixed}
OUT=${OUT:-/tmp/out}
COMMON=(--batch-invariant --draft-kv-dtype float8_e4m3fn)
for stage in "$@"; do
  t0=$(date +%s)
  case "$stage" in
    vocab)
      STEPS=(--lanes 1,16,32 --spec-lanes 1,16,32 --contexts 512,3072 --steps 8 --num-draft 2,3,7
             --split-lanes "" "${COMMON[@]}")
      timeout 230 python3 scripts/bench_steps.py --out "$OUT/steps_full_vocab.json" "${STEPS[@]}" \
        > "$OUT/steps_full_vocab.log" 2>&1
      tail -n 12 "$OUT/steps_full_vocab.log"
      timeout 200 python3 scripts/bench_steps.py --out "$OUT/steps_vocab16k.json" "${STEPS[@]}" \
        --skip-stock --draft-vocab 16384 > "$OUT/steps_vocab16k.log" 2>&1
      tail -n 12 "$OUT/steps_vocab16k.log"
      ;;
    prefill)
      timeout 150 python3 scripts/bench_prefill.py --out "$OUT/prefill.json" "${COMMON[@]}" \
        --chunks 512,1024 --starts 0,1024,2048,3072 > "$OUT/prefill.log" 2>&1
      tail -n 12 "$OUT/prefill.log"
      timeout 200 python3 scripts/bench_attention.py --out "$OUT/attention_prefill.json" \
        --prefill-sweep --budget-s 170 > "$OUT/attention_prefill.log" 2>&1
      grep -E "^\| prefill" "$OUT/attention_prefill.log" | sort -t'|' -k2,2 -k5n | head -n 60
      ;;
    acceptance)
      timeout 420 python3 scripts/standin_acceptance.py --prompts-dir out/prompts --limit 0 \
        --out "$OUT/shipped_eval_all.json" > "$OUT/shipped_eval_all.log" 2>&1
      tail -n 6 "$OUT/shipped_eval_all.log"
      python3 scripts/compare_drafters.py "$OUT/shipped_eval_all.json" "$OUT/shipped_eval_all.json" \
        --a-name dspark --b-name dflash --out "$OUT/compare_all.json"
      ;;
    int8)
      STEPS=(--lanes 1 --spec-lanes 1,16,32 --contexts 512,3072 --steps 8 --num-draft 3,7 --split-lanes 1
             --skip-stock "${COMMON[@]}")
      for w in bf16 int8; do
        extra=(); [ "$w" = int8 ] && extra=(--draft-weight-dtype int8)
        timeout 200 python3 scripts/bench_steps.py --out "$OUT/steps_weights_$w.json" "${STEPS[@]}" \
          "${extra[@]}" > "$OUT/steps_weights_$w.log" 2>&1
        tail -n 4 "$OUT/steps_weights_$w.log"
      done
      # Which is faster, row by row, and whether int8 wins every row (INT8_WINS=1|0 on stdout and
      # in $OUT/int8_wins): a later command may choose its bench options from it.
      python3 - "$OUT/steps_weights_bf16.json" "$OUT/steps_weights_int8.json" <<'PY' | tee "$OUT/int8_wins"
import json, sys
a, b = (json.load(open(p))["spec"] for p in sys.argv[1:3])
key = lambda r: (r["lanes"], r["context"], r["num_draft"])
b = {key(r): r for r in b}
wins = []
for r in a:
    s = b.get(key(r))
    if s and "iteration_ms" in r and "iteration_ms" in s:
        wins.append(s["iteration_ms"] < r["iteration_ms"])
        print(f"# lanes {r['lanes']} ctx {r['context']} drafts {r['num_draft']}: bf16 "
              f"{r['iteration_ms']:.3f} ms, int8 {s['iteration_ms']:.3f} ms")
print(f"INT8_WINS={int(bool(wins) and all(wins))}")
PY
      ;;
    *) echo "usage: gpu_cost_probes.sh vocab|prefill|acceptance|int8 ..." >&2; exit 2 ;;
  esac
  echo "gpu_cost_probes: $stage took $(( $(date +%s) - t0 )) s"
done
exit 0
