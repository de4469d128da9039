#!/usr/bin/env bash
# SpecScore and the lossless gate on the GPU machine (shared/protocol.md): build the 8B graft of
# the stand-in pair, then run `jspec bench` on it.
#
#   bash scripts/gpu_bench.sh [STAGE ...]
#
# STAGE (default: all):
#   graft   python3 -m jspec.convert.graft --target $STANDIN_TARGET --draft $STANDIN_DRAFT
#           --out $GRAFT (skipped when $GRAFT/target/config.json exists: the graft renames its
#           output into place only when complete)
#   solo    solo workload + roofline + fixed-text fidelity          (--peer off)
#   team    team workload + greedy agreement
#   busy    busy workload + the device-memory check
#   peer    the transformers + PyTorch peer at solo (its own process: no JAX on the GPU)
#   all     graft, then every stage in order
#
# One device command may run 10 minutes; the whole bench does not fit in one. Run it as this
# documented sequence of commands on ONE warm machine ($GRAFT and $BENCH_DIR live in its /tmp):
#   bash scripts/gpu_bench.sh graft solo
#   bash scripts/gpu_bench.sh team
#   bash scripts/gpu_bench.sh busy
#   bash scripts/gpu_bench.sh peer
# (Measured on the H200 on 2026-11-30, stand-in pair at T = 1: graft + solo 5.4 min, team about
# 3 min, busy 4.1 min; with --batch-invariant graft + solo 5.0 min, team 2.8 min. On 2026-12-01,
# with look-ahead dispatches: `graft solo team` 7.2 min in one command, `busy peer` 7.9 min
# (peer 3.4 min). Every stage prints what it took.)
# The configuration whose gates can pass (docs/benchmarks.md): verify == decode to the bit needs
# the batch-invariant kernels in both engines, and busy's memory gate (spec <= stock + 4 GiB)
# needs the fp8 drafter pool at DSpark-8B size:
#   BENCH_ARGS="--batch-invariant --draft-kv-dtype float8_e4m3fn" bash scripts/gpu_bench.sh graft solo
# and the headline of 2026-12-03 (SpecScore 1.335) added `--num-draft-tokens team=3,busy=3` to
# BENCH_ARGS (team and busy verify 3 drafts; docs/benchmarks.md says why), and the one of the
# third session (SpecScore 1.379) also `--prefill-chunk 512` (busy's prefill 8.5 -> 6.6 s a pass).
# Each engine's warm-up compiles every prefill size (EngineConfig.prefill_sizes: chunk / 8 .. chunk).
# Pass JSPEC_COMMIT explicitly from the submitting checkout: the device's .git can be stale.
# Every stage writes $BENCH_DIR/parts/<stage>.json and re-assembles $BENCH_DIR/bench.{json,md,png}
# from all parts of the same run (same model, drafter, sampling, knobs and commit; the peer's part
# only needs the same model, sampling and commit, since no jspec knob touches it); the last stage
# leaves the complete record. Each command copies $BENCH_DIR to $OUT/bench so what was measured
# comes back even if a later command fails. If the machine is handed back between commands,
# start again from `graft`.
#
# Side by side on a machine of several GPUs (nvidia-h200-x2): JOBS lists one job per GPU, each
# SAMPLING:STAGE[,STAGE...]; job i runs on GPU i into $BENCH_ROOT/<sampling>/gpu<i>. After the
# jobs, each sampling's parts from every GPU are merged into $BENCH_ROOT/<sampling>/merged
# (`jspec bench --workloads none --merge-parts ...`: one record) and come back as
# $OUT/bench-<sampling>.tgz, with each job's log. The three samplings in three calls:
#   JOBS="t1:solo greedy:solo" bash scripts/gpu_bench.sh graft
#   JOBS="t1:team,busy greedy:team,busy" bash scripts/gpu_bench.sh
#   JOBS="qwen:solo,peer qwen:team,busy" bash scripts/gpu_bench.sh   # one sampling on two GPUs
# (peer with qwen measures the transformers peer once: its tokens/s do not depend on the sampling
# of the jspec engines beside it, but the record keeps it with the run it came with.)
# The GPUs share the host's CPUs: each process drives its own GPU, so the timings should not
# interfere much, but that is assumed, not measured.
#
# Environment (defaults in brackets):
#   STANDIN_TARGET [standin], STANDIN_DRAFT [standin-dspark]   the small stand-in files
#   GRAFT [/tmp/graft]          graft output: $GRAFT/target, $GRAFT/dspark
#   BENCH_DIR [/tmp/jspec-bench]   (JOBS: BENCH_ROOT [/tmp/jspec-benches])
#   GRAFT_ARGS []               extra graft options ("--check": S vs the 8B graft's logits on the GPU)
#   SAMPLING [t1]               t1 | greedy | qwen
#   BENCH_ARGS []               extra `jspec bench` options (e.g. "--attn-impl triton")
#   JSPEC_PROMPTS_DIR           where humaneval.jsonl and mbpp.jsonl are; else the first of
#                               ./shared/data/prompts, ../shared/data/prompts, ./out/prompts
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/device_env.sh

STANDIN_TARGET=${STANDIN_TARGET:-standin}
STANDIN_DRAFT=${STANDIN_DRAFT:-standin-dspark}
GRAFT=${GRAFT:-/tmp/graft}
BENCH_DIR=${BENCH_DIR:-/tmp/jspec-bench}
SAMPLING=${SAMPLING:-t1}
BENCH_ARGS=${BENCH_ARGS:-}
OUT=${OUT:-/tmp/out}

if [ -z "${JSPEC_PROMPTS_DIR:-}" ]; then
  for d in shared/data/prompts ../shared/data/prompts out/prompts; do
    if [ -f "$d/humaneval.jsonl" ] && [ -f "$d/mbpp.jsonl" ]; then
      export JSPEC_PROMPTS_DIR="$PWD/$d"
      break
    fi
  done
fi
if [ -z "${JSPEC_PROMPTS_DIR:-}" ]; then
  echo "gpu_bench: no humaneval.jsonl / mbpp.jsonl found; set JSPEC_PROMPTS_DIR" >&2
  exit 2
fi

stages=("$@")
if [ -n "${JOBS:-}" ]; then
  for stage in "${stages[@]}"; do
    [ "$stage" = graft ] || { echo "gpu_bench: with JOBS only 'graft' may be given as a stage" >&2; exit 2; }
  done
else
  [ ${#stages[@]} -eq 0 ] && stages=(all)
  [ "${stages[*]}" = "all" ] && stages=(graft solo team busy peer)
fi
BENCH_ROOT=${BENCH_ROOT:-/tmp/jspec-benches}

bench() {  # bench WORKLOADS [options], into $BENCH_DIR at $SAMPLING
  local t0=$SECONDS
  # shellcheck disable=SC2086
  python3 -m jspec.bench.run --model "$GRAFT/target" --draft "$GRAFT/dspark" --out "$BENCH_DIR" \
    --sampling "$SAMPLING" --workloads "$@" $BENCH_ARGS || return 1
  echo "gpu_bench: $SAMPLING $1 took $((SECONDS - t0)) s"
  if [ -z "${JOBS:-}" ]; then  # JOBS bring their records back as one tgz per sampling instead
    mkdir -p "$OUT/bench"
    cp -r "$BENCH_DIR"/. "$OUT/bench/"
  fi
}

for stage in "${stages[@]}"; do
  case "$stage" in
    graft)
      if [ -f "$GRAFT/target/config.json" ] && [ -f "$GRAFT/dspark/config.json" ]; then
        echo "gpu_bench: $GRAFT already built"
      else
        t0=$SECONDS
        # shellcheck disable=SC2086
        python3 -m jspec.convert.graft --target "$STANDIN_TARGET" --draft "$STANDIN_DRAFT" \
          --out "$GRAFT" --force ${GRAFT_ARGS:-}
        echo "gpu_bench: graft took $((SECONDS - t0)) s"
      fi
      ;;
    solo) bench solo --peer off ;;
    team) bench team ;;
    busy) bench busy ;;
    peer) bench peer ;;
    *) echo "gpu_bench: unknown stage $stage (graft | solo | team | busy | peer | all)" >&2; exit 2 ;;
  esac
done

run_job() {  # run_job GPU SAMPLING STAGE[,STAGE...]: one bench after another on one GPU (a subshell)
  export CUDA_VISIBLE_DEVICES=$1
  SAMPLING=$2 BENCH_DIR="$BENCH_ROOT/$2/gpu$1"
  IFS=, read -ra job_stages <<< "$3"
  for stage in "${job_stages[@]}"; do
    case "$stage" in
      solo) bench solo --peer off || return 1 ;;
      team|busy|peer) bench "$stage" || return 1 ;;
      *) echo "gpu_bench: unknown stage $stage in JOBS (solo | team | busy | peer)" >&2; return 2 ;;
    esac
  done
}

if [ -n "${JOBS:-}" ]; then
  read -ra jobs <<< "$JOBS"
  gpus=$(nvidia-smi --list-gpus | wc -l)
  if [ ${#jobs[@]} -gt "$gpus" ]; then
    echo "gpu_bench: ${#jobs[@]} jobs for $gpus GPUs" >&2
    exit 2
  fi
  pids=()
  samplings=()
  for i in "${!jobs[@]}"; do
    sampling=${jobs[$i]%%:*}
    [[ " ${samplings[*]} " == *" $sampling "* ]] || samplings+=("$sampling")
    run_job "$i" "$sampling" "${jobs[$i]#*:}" > "$OUT/job$i-$sampling.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  for sampling in "${samplings[@]}"; do
    merge=()
    for d in "$BENCH_ROOT/$sampling"/gpu*; do [ -d "$d/parts" ] && merge+=(--merge-parts "$d"); done
    (SAMPLING=$sampling BENCH_DIR="$BENCH_ROOT/$sampling/merged" bench none "${merge[@]}" --no-progress) \
      > "$OUT/merge-$sampling.log" 2>&1 || failed=1
    tar czf "$OUT/bench-$sampling.tgz" -C "$BENCH_ROOT/$sampling" . 2>/dev/null
    [ -f "$BENCH_ROOT/$sampling/merged/bench.md" ] && cat "$BENCH_ROOT/$sampling/merged/bench.md"
  done
  tail -n 4 "$OUT"/job*.log
  exit $failed
fi
[ -f "$BENCH_DIR/bench.md" ] && cat "$BENCH_DIR/bench.md"
exit 0
