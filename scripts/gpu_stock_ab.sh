# Stock decode steps of this tree against an older one, alternating in one call (same GPU, same
# warm machine), plus the GPU invariance tests, the row-kernel timings and a profile of this
# tree's stock step.
#   git archive <old> pyproject.toml jspec kernels convert scripts | tar -x -C out/old
#   (drop out/old/jspec/assets), then on the device, carrying .whl, out/old:
#   . scripts/device_env.sh; bash scripts/gpu_stock_ab.sh out/old [RMS_WARPS...]
# Each RMS_WARPS value (default: 4) runs this tree with JSPEC_RMS_NUM_WARPS set to it.
# Writes tests.log, rowwise.json, steps_{w<N>,old}_{1,2}.json (+ .log), profile_w<N>.json into
# $OUT/ab.tgz (one file: the device tool brings back only a few files a call).
set -u
FINAL_OUT=$OUT
OUT=/tmp/stock_ab
mkdir -p "$OUT"
trap 'tar czf "$FINAL_OUT/ab.tgz" -C "$OUT" --exclude="*.hlo.txt.gz" .' EXIT
OLD=${1:?usage: gpu_stock_ab.sh OLD_TREE [RMS_WARPS...]}
shift
WARPS=${*:-4}
NEW=$PWD
export JSPEC_LINEAR_MMA=${JSPEC_LINEAR_MMA:-mixed}
STEPS_ARGS="--lanes 1 --contexts 512,3072 --steps 8 --skip-spec --batch-invariant"

timeout 150 python3 -m pytest -q -m gpu tests/test_batch_invariance_gpu.py \
  -k "add_rms or partials or rms_norm or qk_norm or verify_equals_decode" >"$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
timeout 60 python3 scripts/bench_rowwise.py --out "$OUT/rowwise.json" >"$OUT/rowwise.log" 2>&1
echo "rowwise rc=$?"; cat "$OUT/rowwise.log" | cut -c1-120

run_steps() {  # tree-name dir rep [warps]
  (cd "$2" && JSPEC_RMS_NUM_WARPS=${4:-4} PYTHONPATH="$PWD:/tmp/site" timeout 90 python3 \
    scripts/bench_steps.py --out "$OUT/steps_$1_$3.json" $STEPS_ARGS >"$OUT/steps_$1_$3.log" 2>&1)
  echo "$1 $3 rc=$?"; grep "^stock" "$OUT/steps_$1_$3.log" | cut -c1-90
}
for rep in 1 2; do
  for w in $WARPS; do run_steps "w$w" "$NEW" $rep $w; done
  run_steps old "$OLD" $rep
done

for w in $WARPS; do
  JSPEC_RMS_NUM_WARPS=$w timeout 100 python3 scripts/profile_steps.py --out "$OUT/profile_w$w.json" \
    --lanes 1 --context 512 --steps 8 --batch-invariant --no-trace-copy >"$OUT/profile_w$w.log" 2>&1
  echo "profile w$w rc=$?"; grep -E "unprofiled:|profiled:|device busy|_kernel " "$OUT/profile_w$w.log" | cut -c1-110
done
