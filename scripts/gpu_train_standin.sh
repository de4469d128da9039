#!/usr/bin/env bash
# Train the stand-in pair on the GPU machine in two device calls on one warm machine (carry .whl
# and out/prompts; state lives in $W = /tmp/standin between the calls, so the second call must
# follow the first within the machine's warm time):
#   bash scripts/gpu_train_standin.sh target     # corpus, S (data-parallel over every GPU, time-boxed)
#   bash scripts/gpu_train_standin.sh drafters   # S's replies, then DSpark and DFlash (same time box)
# With two or more GPUs the replies are sampled by two processes (T 0.7 / top-p / top-k on one,
# T 1.0 and the held-out greedy set on the other) and the two drafters train side by side, one per
# GPU, each evaluated through the engine afterwards; with one GPU everything runs in turn.
# CONTINUE=1 (both calls): keep the shipped S (its compact directory becomes $W/target, so the
# target call only gathers the corpus and the prompts) and start both drafters from the shipped
# ones: drafter training accumulates over sessions. The corpus must give S's vocabulary again
# (the same manifest); the run stops with a named error otherwise. FRESH_DRAFTERS=1 with it keeps
# S but starts the drafters from random weights.
# ABLATION=1 (drafters call): also train dspark_ce, DSpark's drafter on the CE-only objective, at
# the same budget, so its tau against dspark's and dflash's isolates the L1 term. On one GPU the
# three train in turn; with three or more GPUs side by side; two GPUs are refused. Compare from
# the same start: with CONTINUE=1, set FRESH_DRAFTERS=1.
# Each call writes int8 transfer shards and logs under $OUT; locally:
#   python scripts/standin_transfer.py load --src <files_at>/xfer_target --out out/standin_raw
# The corpus is the Python sources of the machine's standard library and site-packages (a seeded
# random 300 MB subset, deduplicated by content); its manifest comes back as manifest.json.gz.
# Step counts are set so that the cosine schedules end at the time boxes on nvidia-h200-x2, as
# measured on 2026-12-01 (docs/benchmarks.md): S 7.3 steps/s (3018 steps in the 412 s its deadline
# left), the drafters 8.5 (DSpark) and 9.3 (DFlash) steps/s. On one GPU, S makes about half as
# many steps in the same time: set TARGET_STEPS=1500 there.
# One GPU, a call per drafter (equal budgets, a warm machine not needed): SAVE_STATE=1
# REPLIES_ONLY=1 on the drafters call after the target call brings the prompts and replies back;
# then, with them carried as out/state/, `ONLY=dspark TIME_BOXED=1 DRAFT_MINUTES=M` and
# `ONLY=dflash ...` (CONTINUE=1 to start from the shipped drafters). TIME_BOXED=1: the learning
# rate's warm-up + cosine runs over the time box, not a step count (train_standin
# --draft-time-boxed). Replies are packed several to a training row (--pack-replies).
# DESCRIBED (0.25): the share of training prompts that ask for a function in words, from a
# corpus docstring's summary ("Write a function to return ..."), as MBPP's prompts do; half are
# code tasks (signature + docstring, as HumanEval's), the rest corpus windows. Before 2026-12-06
# there were none, and the shipped pair accepted 2.25 tokens per verify step on MBPP against 3.27
# on HumanEval at T = 1 (2026-12-04).
# DRAFT_BATCH (sequences of 2048 tokens per drafter step, 8) and PROMPTS (corpus prompts S replies
# to, 4096). PROMPT_SEED (0) draws the training prompts and their replies (the held-out set stays
# on the run's seed): a session whose replies were lost with its machine draws fresh ones with
# another value (2026-12-02's third session: 0, 16,384 prompts). REPLY_LANES (256): lanes the
# engine samples S's replies with (2026-12-02: 10.5 ms per prompt at 256, 9.6 at 512). By the
# full count of scripts/profile_drafter_train.py (an earlier count here, 1.6 TFLOP, left out the
# attention), a drafter step is about 5.4 TFLOP at 8 x 2048 with 512 anchors and 7.6 TFLOP at
# 4 x 4096 with 1,024 anchors, so the H200 did about 46-74 TFLOP/s; about 38 % of the count is the
# drafter's block attention, which scores every block query against the whole row. Where the
# time goes is not yet measured (that script, on the GPU, says). DRAFT_LR (1.5e-3) goes with it.
# Long contexts: the bench's busy prompts hold >= 3,000 tokens, and there the drafter accepted
# much less (CPU, 2026-12-02: 2.43 tokens per verify step at 82-token prompts, 1.60 at 3,058,
# while the target's replies grew more predictable). JOINED=SHARE joins that share of the packed
# rows into one long sequence each (train_standin --joined-rows); with DRAFT_SEQ=4096 (and
# DRAFT_BATCH=4, ANCHORS=1024 for the same tokens and anchors per step) the drafter trains at
# contexts up to 4096. EVAL_LONG (3000; 0 = off) adds a T = 1 engine eval on 16 such prompts.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
. scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
W=${W:-/tmp/standin}
LIMIT=${LIMIT:-570}  # seconds this call may run (the device allows 600)
GPUS=$(nvidia-smi --list-gpus | wc -l)
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
SITE=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
COMMON=(--corpus "$STDLIB" --corpus "$SITE" --max-corpus-bytes 300000000 --out "$W" --tokenizer qwen3
        --compact-rows 24576 --chat-tasks 60000
        --hidden 256 --layers 12 --heads 8 --kv-heads 2 --head-dim 128 --ffn 1024
        --seq-len 4096 --short-seq-len ${SHORT_SEQ:-1024} --long-every 5 --batch ${TARGET_BATCH:-32}
        --target-steps ${TARGET_STEPS:-3000} --target-lr ${TARGET_LR:-2e-3}
        --eval-every 1000 --eval-rows 64
        --prompts ${PROMPTS:-4096} --prompt-seed ${PROMPT_SEED:-0} --eval-prompts 64
        --described-tasks ${DESCRIBED:-0.25}
        --prompt-min 64 --prompt-max 1024 --reply-tokens 512
        --reply-lanes ${REPLY_LANES:-256} --reply-t1
        --draft-seq-len ${DRAFT_SEQ:-2048} --draft-layers 2 --block-size 7 --anchors ${ANCHORS:-512}
        --markov-rank 32 --joined-rows ${JOINED:-0}
        --draft-batch ${DRAFT_BATCH:-8} --draft-steps ${DRAFT_STEPS:-3000} --draft-lr ${DRAFT_LR:-1.5e-3}
        --draft-minutes ${DRAFT_MINUTES:-4.5}
        --compute-dtype bfloat16 --export-dtype float32 --attn cudnn --no-remat --ckpt-every 1000
        --log-every 20 --quiet --row-chunk ${ROW_CHUNK:-2048})
# LOSS_REMAT (0): 0 keeps the drafter loss chunks' residuals for the backward; 1 recomputes them
# (less memory, more compute). BLOCK_ATTN (cudnn_chunks): the drafter's block attention on cuDNN
# per chunk of 128 anchors, each chunk seeing the context and only its own blocks' keys (about
# 2.3x fewer scores at 1,024 anchors than cudnn); cudnn: one fused cuDNN attention over every
# block key under a mask; split: the einsums. train_standin checks a cuDNN route against split
# on the GPU first and falls back where it differs. On the H100 (2026-12-06, 4 x 4096 rows, 1,024
# anchors, half the rows joined, synthetic data, scripts/profile_drafter_train.py) a step took
# 81.0 ms with cudnn, 65.0 with cudnn_chunks and 62.8 with cudnn_chunks and LOSS_REMAT=0 (1.29x
# the steps per second); the H200 took 72.7 ms with cudnn against 94.7 with split (2026-12-03).
[ "${LOSS_REMAT:-0}" = 0 ] && COMMON+=(--no-loss-remat)
COMMON+=(--block-attn "${BLOCK_ATTN:-cudnn_chunks}")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
left() { echo $((START + LIMIT - $(date +%s))); }
# SAVE_STATE=1: the prompts and replies come back as one archive cut into parts of 15 MB,
# state.tgz.part00, part01, ... (6.5 MB for 4096 prompts on 2026-12-02; a call returns at most
# 8 files of 16 MB each); carried as out/state/, they let a later call on a fresh machine skip
# the corpus and the replies (the drafters call restores them with the shipped S).
save_state() {
  [ "${SAVE_STATE:-0}" = 1 ] || return 0
  # only the files there are: a call that ran out of time before the held-out sets (an H100 of
  # 2026-12-08 sampled 182 s a training set, against 129 s on the one of 2026-12-07) saves the
  # rest, and the drafters call samples what is missing
  local f files=()
  for f in manifest.json data/prompts.jsonl data/prompts_eval.jsonl data/replies.jsonl \
           data/replies_t1.jsonl data/replies_eval.jsonl data/replies_eval_t1.jsonl; do
    if [ -f "$W/$f" ]; then files+=("$f"); else echo "save_state: $f not sampled yet, not saved"; fi
  done
  tar czf - -C "$W" "${files[@]}" | split -b 15000000 -d - "$OUT/state.tgz.part"
  ls -la "$OUT"/state.tgz.part*
}
# the saved state carried as out/state/: its parts in order (or one state.tgz, as saved before), or
# state.tar.xz, the same files recompressed on the development machine (`cat state.tgz.part* | tar
# xzf - -C tmp && tar cf - -C tmp . | xz -9 > out/state/state.tar.xz`: 7.7 MB against 24 MB for
# 2026-12-03's 16,384 + 16,384 replies, so that it travels beside the tracked tree)
STATE_FILES=$(ls out/state/state.tar.xz 2>/dev/null || ls out/state/state.tgz.part* 2>/dev/null \
  || ls out/state/state.tgz 2>/dev/null)
unpack_state() {  # the saved archive's files into $W
  case "$STATE_FILES" in
    *.xz) python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
            "$STATE_FILES" | tar xf - -C "$W" ;;
    *) cat $STATE_FILES | tar xzf - -C "$W" ;;
  esac
}
case "${1:-}" in
  target)
    if [ "${CONTINUE:-0}" = 1 ] && [ ! -f "$W/target/config.json" ]; then
      mkdir -p "$W" && cp -r "$(python3 -m jspec.standin path standin --compact)" "$W/target"
    fi
    # S stops training in time for its export, the prompts and the transfer (about 70 s).
    timeout $(left) python3 scripts/train_standin.py "${COMMON[@]}" --only-target \
      --target-until $((START + LIMIT - ${TAIL_S:-75})) 2>&1 | tee "$OUT/train_target.log"
    # (with CONTINUE=1, S is the shipped one: nothing to bring back)
    [ -f "$W/target/config.json" ] && [ "${CONTINUE:-0}" != 1 ] && \
      python3 scripts/standin_transfer.py save --dir target="$W/target" --out "$OUT/xfer_target"
    gzip -c "$W/manifest.json" > "$OUT/manifest.json.gz" 2>/dev/null
    tar czf "$OUT/target_logs.tgz" -C "$W" logs target_heldout.json 2>/dev/null
    ;;
  drafters)
    if [ ! -f "$W/target/config.json" ] && [ -n "$STATE_FILES" ]; then
      # a fresh machine: the prompts and replies an earlier call saved (SAVE_STATE=1), the shipped S
      mkdir -p "$W" && unpack_state || { echo "out/state: unreadable archive ($STATE_FILES)"; exit 2; }
      cp -r "$(python3 -m jspec.standin path standin --compact)" "$W/target"
      echo "restored $W from out/state: $(ls "$W/data" | tr '\n' ' ')"
    fi
    [ -f "$W/target/config.json" ] || { echo "no $W/target: run the target phase first (same machine)"; exit 2; }
    EVAL=(--eval-prompts-dir out/prompts --eval-limit ${EVAL_LIMIT:-100} --eval-max-tokens 256
          --eval-long-tokens ${EVAL_LONG:-3000})
    [ "${TIME_BOXED:-0}" = 1 ] && EVAL+=(--draft-time-boxed)
    NAMES=(dspark dflash)
    if [ -n "${ONLY:-}" ]; then
      [ "$GPUS" -eq 1 ] || { echo "ONLY= trains one drafter on a one-GPU machine"; exit 2; }
      NAMES=("$ONLY")
      EVAL+=(--only-drafter "$ONLY")
    fi
    if [ "${ABLATION:-0}" = 1 ]; then
      [ "$GPUS" -eq 2 ] && { echo "ABLATION=1 runs on one GPU or on three or more, not two"; exit 2; }
      NAMES+=(dspark_ce)
      EVAL+=(--ablation-ce)
    fi
    if [ "${CONTINUE:-0}" = 1 ] && [ "${FRESH_DRAFTERS:-0}" != 1 ]; then
      for d in dspark dflash; do
        EVAL+=(--init-drafter "$d=$(python3 -m jspec.standin path standin-$d --compact)")
      done
    fi
    if [ "$GPUS" -ge 2 ]; then
      CUDA_VISIBLE_DEVICES=0 python3 scripts/train_standin.py "${COMMON[@]}" --stop-after-replies \
        --reply-sets train > "$OUT/replies_0.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=1 python3 scripts/train_standin.py "${COMMON[@]}" --stop-after-replies \
        --reply-sets train_t1,eval,eval_t1 > "$OUT/replies_1.log" 2>&1
      wait
      tail -n 3 "$OUT"/replies_*.log
      save_state
      # the drafters' time box: what is left after loading, export, the engine eval and the transfer
      EVAL+=(--draft-minutes $(python3 -c "print(max(1.0, ($(left) - ${DRAFT_TAIL_S:-190}) / 60))"))
      CUDA_VISIBLE_DEVICES=0 timeout $(left) python3 scripts/train_standin.py "${COMMON[@]}" "${EVAL[@]}" \
        --only-drafter dspark > "$OUT/train_dspark.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=1 timeout $(left) python3 scripts/train_standin.py "${COMMON[@]}" "${EVAL[@]}" \
        --only-drafter dflash > "$OUT/train_dflash.log" 2>&1 &
      if [ "${ABLATION:-0}" = 1 ]; then
        CUDA_VISIBLE_DEVICES=2 timeout $(left) python3 scripts/train_standin.py "${COMMON[@]}" "${EVAL[@]}" \
          --only-drafter dspark_ce > "$OUT/train_dspark_ce.log" 2>&1 &
      fi
      wait
      tail -n 8 "$OUT"/train_d*.log
    else
      # one GPU: the replies that are missing (~2.5 min for all four sets), then each drafter in
      # turn with its export and engine eval, in what is left (or DRAFT_MINUTES each)
      timeout $(left) python3 scripts/train_standin.py "${COMMON[@]}" --stop-after-replies 2>&1 \
        | tee "$OUT/replies.log"
      save_state
      [ "${REPLIES_ONLY:-0}" = 1 ] && exit 0
      n=${#NAMES[@]}
      [ -n "${DRAFT_MINUTES:-}" ] || \
        EVAL+=(--draft-minutes $(python3 -c "print(max(1.0, ($(left) - 40 - $n * 110) / ($n * 60)))"))
      timeout $(left) python3 scripts/train_standin.py "${COMMON[@]}" "${EVAL[@]}" 2>&1 \
        | tee "$OUT/train_drafters.log"
    fi
    dirs=()
    for d in "${NAMES[@]}"; do [ -f "$W/$d/config.json" ] && dirs+=(--dir "$d=$W/$d"); done
    [ ${#dirs[@]} -gt 0 ] && python3 scripts/standin_transfer.py save "${dirs[@]}" --out "$OUT/xfer_drafters"
    (cd "$W" && tar czf "$OUT/drafter_logs.tgz" logs summary*.json engine_eval*.json 2>/dev/null)
    ;;
  *) echo "usage: gpu_train_standin.sh target|drafters" >&2; exit 2 ;;
esac
exit 0
