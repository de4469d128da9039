#!/usr/bin/env bash
# Train the stand-in pair on the GPU machine in two device calls on one warm machine (carry .whl
# and out/prompts; state lives in $W = /tmp/standin between the calls):
#   bash scripts/gpu_train_standin.sh target     # corpus, S (time-boxed), S's replies via the engine
#   bash scripts/gpu_train_standin.sh drafters   # DSpark + DFlash (same time box), engine eval
# Each writes int8 transfer shards and logs under $OUT; locally:
#   python scripts/standin_transfer.py load --src <files_at>/xfer_target --out out/standin_raw
# The corpus is the Python sources of the machine's standard library and site-packages (a seeded
# random 300 MB subset, deduplicated by content); its manifest comes back as manifest.json.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
W=${W:-/tmp/standin}
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
SITE=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
COMMON=(--corpus "$STDLIB" --corpus "$SITE" --max-corpus-bytes 300000000 --out "$W" --tokenizer qwen3
        --compact-rows 24576 --chat-tasks 60000
        --hidden 256 --layers 12 --heads 8 --kv-heads 2 --head-dim 128 --ffn 1024
        --seq-len 4096 --batch 16 --target-steps ${TARGET_STEPS:-900} --target-lr 1.5e-3
        --target-minutes ${TARGET_MINUTES:-4.5} --eval-every 300 --eval-rows 64
        --prompts 4096 --eval-prompts 64 --prompt-min 64 --prompt-max 1024 --reply-tokens 512
        --reply-lanes 256
        --draft-seq-len 2048 --draft-layers 2 --block-size 7 --anchors 512 --markov-rank 32
        --draft-batch 8 --draft-steps ${DRAFT_STEPS:-900} --draft-lr 1.5e-3
        --draft-minutes ${DRAFT_MINUTES:-2.2}
        --compute-dtype bfloat16 --export-dtype float32 --attn cudnn --ckpt-every 300
        --log-every 20 --quiet)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case "${1:-}" in
  target)
    timeout ${LIMIT:-545} python3 scripts/train_standin.py "${COMMON[@]}" --stop-after-replies 2>&1 \
      | tee "$OUT/train_target.log"
    [ -f "$W/target/config.json" ] && python3 scripts/standin_transfer.py save --dir target="$W/target" \
      --out "$OUT/xfer_target"
    gzip -c "$W/manifest.json" > "$OUT/manifest.json.gz" 2>/dev/null
    tar czf "$OUT/target_logs.tgz" -C "$W" logs target_heldout.json data 2>/dev/null
    ;;
  drafters)
    [ -f "$W/target/config.json" ] || { echo "no $W/target: run the target phase first (same machine)"; exit 2; }
    timeout ${LIMIT:-560} python3 scripts/train_standin.py "${COMMON[@]}" --eval-prompts-dir out/prompts \
      --eval-limit ${EVAL_LIMIT:-100} --eval-max-tokens 256 2>&1 | tee "$OUT/train_drafters.log"
    dirs=()
    for d in dspark dflash; do [ -f "$W/$d/config.json" ] && dirs+=(--dir "$d=$W/$d"); done
    [ ${#dirs[@]} -gt 0 ] && python3 scripts/standin_transfer.py save "${dirs[@]}" --out "$OUT/xfer_drafters"
    tar czf "$OUT/drafter_logs.tgz" -C "$W" logs summary.json engine_eval.json 2>/dev/null
    ;;
  *) echo "usage: gpu_train_standin.sh target|drafters" >&2; exit 2 ;;
esac
exit 0
